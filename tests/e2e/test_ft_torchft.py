"""``ft=torchft`` through the real CLI: a real lighthouse (started by the launcher), three real
worker processes, each its own replica group with a torchft Manager (easgd_lightning/ft/).

* No fault: ``ft=torchft`` trains bitwise the same centre as ``ft=none`` (float64,
  ``trainer.precision=64-true``; the centre in ``last.ckpt``), for local_sgd and sync_easgd;
  the same weights up to rounding (1e-14) for ddp; bitwise for ddp with top-k and for diloco
  (one fragment).
* One worker SIGKILLed from outside mid-run (its pid from ``ranks/launch.json``; or by
  ``faults.kill_rank``): the run finishes ``ok``, the worker was restarted once and rejoined
  (its state received from a peer, bytes counted), the validation accuracy is within 0.02 of
  the same run without the fault, and no process of the run is left.
* The lighthouse SIGKILLed mid-run: exit 1 within a bounded time, the error names the
  lighthouse, no process of the run is left.
* The parameter-server family (``async_easgd``, 3 workers + server; no lighthouse): a worker
  SIGKILLed from outside is restarted and re-admitted by the server, the run ends ``ok``
  within 0.02 of the fault-free accuracy; with ``async_sgd`` and ``stop_policy=all``, a
  worker killed by ``faults.kill_rank`` and one stopped from outside (dropped, then killed)
  are both restarted and end at the others' step.
* Refusals before launch (exit 2, one line naming the key).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import base_env, one_error_line, pid_alive, run_cli, start_cli, wait_until

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

COMMON = ["logger=none", "trainer.enable_progress_bar=false", "data.num_workers=0", "trainer.devices=3",
          "ft=torchft"]


def _centre(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


_wait = functools.partial(wait_until, poll_s=0.05)


def _every_pid(run_dir: Path, seen: set[int]) -> set[int]:
    """The run's worker and lighthouse pids named in launch.json now, added to ``seen``."""
    info = _json(run_dir / "ranks" / "launch.json") or {}
    seen.update(int(p) for p in info.get("worker_pids", []))
    if (info.get("ft") or {}).get("lighthouse_pid"):
        seen.add(int(info["ft"]["lighthouse_pid"]))
    return seen


# -------------------------------------------------------------------------- no fault
#: ddp with top-k on every tensor (the digits MLP's are all under the default min_numel)
TOPK = ["compression=topk", "compression.min_numel=0"]


@pytest.mark.parametrize("strategy,extra", [("local_sgd", []), ("sync_easgd", []), ("ddp", []), ("diloco", []),
                                            ("ddp", TOPK)], ids=["local_sgd", "sync_easgd", "ddp", "diloco", "ddp-topk"])
def test_no_fault_is_bitwise_ft_none(tmp_path: Path, strategy: str, extra: list[str]) -> None:
    """Bitwise for local_sgd and sync_easgd. ddp: equal to rounding only -- under ft=torchft
    DDP's reducer keeps its first bucket layout (find_unused_parameters=True, as torchft's
    DDP: a joiner's first step would otherwise pair its buckets with differently ordered
    ones), so the ring sums the elements of a bucket in another order than ft=none's rebuilt
    buckets. ddp with top-k: bitwise again -- after the dense first step (the same first
    buckets in both) every tensor's mean is its ranks' all-gathered payloads summed in rank
    order, whatever bucket it is in."""
    over = [f"strategy={strategy}", "trainer.max_epochs=2", "trainer.precision=64-true",
            *(["strategy.tau=4"] if strategy in ("local_sgd", "diloco") else []), *extra]
    runs = {}
    for ft in ("none", "torchft"):
        runs[ft] = tmp_path / ft
        common = [c for c in COMMON if not c.startswith("ft=")]
        run_cli([f"hydra.run.dir={runs[ft]}", *common, f"ft={ft}", *over], timeout=300)
    a, b = _centre(runs["none"]), _centre(runs["torchft"])
    assert a.keys() == b.keys()
    for key in a:
        if strategy == "ddp" and not extra:
            assert torch.allclose(a[key], b[key], rtol=0, atol=1e-14), (key, (a[key] - b[key]).abs().max())
        else:
            assert torch.equal(a[key], b[key]), (key, (a[key] - b[key]).abs().max())
    sa, sb = _summary(runs["none"]), _summary(runs["torchft"])
    assert sb["status"] == "ok" and sb["steps_per_rank"] == sa["steps_per_rank"] == [30, 30, 30]
    # the same centre, evaluated once on the whole validation set under ft (no reduction across
    # workers) instead of per shard and averaged: equal up to the order of the float64 sums
    assert sb["val_acc"] == pytest.approx(sa["val_acc"], abs=1e-12)
    assert sb["train_loss"] == pytest.approx(sa["train_loss"], rel=1e-12)
    kind = {"local_sgd": "model_averaging", "sync_easgd": "elastic", "ddp": "data_parallel",
            "diloco": "pseudo_gradient"}[strategy]
    assert sb["comm"]["by_kind"][kind]["bytes_sent"] == sa["comm"]["by_kind"][kind]["bytes_sent"] > 0
    ft = sb["ft"]
    assert ft["restarts"] == [0, 0, 0] and ft["rejoins"] == [] and ft["deaths"] == []
    assert [q["members"] for q in ft["quorum_changes"]] == [[0, 1, 2]]
    assert ft["steps_not_committed"] == [[], [], []]


# -------------------------------------------------------------------------- one SIGKILL
LONG = ["trainer.max_epochs=20"]  # 300 steps per worker: a kill at step 50 leaves time to rejoin
#: the SIGKILL-from-outside runs: 300 steps (~5 s alone on 2 cores), so that a worker killed
#: a moment after the first exchange (its restart forked, back in ~2 s) rejoins well before
#: the end; validated once, at the end (the final accuracy is what is compared: per-epoch
#: validations only cost time here; at 300 steps the fault-free runs are at 0.96-0.97).
#: ddp with top-k trains 600: its rejoined run needs them to come within 0.02 (at 300 it was
#: 0.028 below the fault-free run once: the compressed run converges later)
LONGER_STEPS = 300
STEPS_PER_EPOCH = 15


def _longer(extra: list[str]) -> tuple[int, list[str]]:
    """(steps, overrides) of a SIGKILL-from-outside run with ``extra``."""
    steps = 2 * LONGER_STEPS if extra == TOPK else LONGER_STEPS
    epochs = steps // STEPS_PER_EPOCH
    return steps, [f"trainer.max_epochs={epochs}", f"trainer.check_val_every_n_epoch={epochs}"]


def _fault_free(tmp_path: Path, strategy: str, extra: list[str]) -> dict:
    run = tmp_path / "fault_free"
    run_cli([f"hydra.run.dir={run}", *COMMON, f"strategy={strategy}", *_longer(extra)[1], *extra], timeout=400)
    return _summary(run)


@pytest.mark.parametrize("strategy,extra", [
    ("local_sgd", ["strategy.tau=4"]), ("sync_easgd", []), ("ddp", []),
    # the outer step without momentum: with the paper's Nesterov 0.9 at lr 0.7 this toy run is
    # too unstable for a 0.02 criterion (README, Fault tolerance: measured)
    ("diloco", ["strategy.tau=4", "strategy.outer_momentum=0.0"]),
    ("ddp", TOPK),
], ids=["local_sgd", "sync_easgd", "ddp", "diloco", "ddp-topk"])
def test_sigkill_from_outside_rejoins(tmp_path: Path, strategy: str, extra: list[str]) -> None:
    base = _fault_free(tmp_path, strategy, extra)
    assert base["status"] == "ok"
    run = tmp_path / "killed"
    log = tmp_path / "killed.log"
    steps, longer = _longer(extra)
    proc = start_cli([f"hydra.run.dir={run}", *COMMON, f"strategy={strategy}", *longer, *extra], base_env(), log)
    pids: set[int] = set()
    try:
        # every worker has committed its first exchange: kill worker 1 a moment later
        _wait(lambda: all((run / "ranks" / "ft" / f"rank{r}.json").exists() for r in range(3)), 120,
              "the three workers' first exchange")
        time.sleep(0.5)
        victim = _json(run / "ranks" / "launch.json")["worker_pids"][1]
        _every_pid(run, pids)
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(timeout=300)
        _every_pid(run, pids)
    finally:
        if proc.poll() is None:
            proc.kill()
    s = _summary(run)
    assert code == 0, log.read_text()[-3000:]
    assert s["status"] == "ok", s["error"]
    ft = s["ft"]
    assert ft["restarts"] == [0, 1, 0]
    assert [d["rank"] for d in ft["deaths"]] == [1] and ft["deaths"][0]["signal"] == "SIGKILL"
    (rejoin,) = ft["rejoins"]
    assert rejoin["rank"] == 1 and rejoin["attempt"] == 1
    assert 0 < rejoin["at_step"] < steps
    # a kill inside an exchange may leave a live worker one commit behind a peer (torchft's
    # commit vote is per replica group): it catches up from that peer at the next quorum
    assert all(c["rank"] != 1 and c["attempt"] == 0 for c in ft["catch_ups"]), ft["catch_ups"]
    assert len(ft["catch_ups"]) <= sum(len(n) for n in ft["steps_not_committed"])
    total = rejoin["recovery_bytes"] + sum(c["recovery_bytes"] for c in ft["catch_ups"])
    assert rejoin["recovery_bytes"] > 0 and ft["recovery_bytes"] == total
    assert rejoin["recovery_s"] is not None and rejoin["recovery_s"] > 0
    assert ft["finished_ranks"] == [0, 1, 2] and ft["lost_ranks"] == []
    # every worker, the restarted one too, ended at the run's last step
    assert s["steps_per_rank"] == [steps] * 3
    # every worker, the rejoined one too, ends with the same model
    finals = [_json(run / "ranks" / f"rank{r}.json")["val_acc"] for r in range(3)]
    assert finals[0] == finals[1] == finals[2], finals
    assert abs(s["val_acc"] - base["val_acc"]) <= 0.02, (s["val_acc"], base["val_acc"])
    assert s["val_acc"] > 0.9
    if extra == TOPK:  # compressed on every worker, the rejoined one too
        assert all(e["compression_stats"]["compression_ratio"] > 5 for e in s["extras"]), s["extras"]
    assert len(pids) >= 5  # three workers, the restarted one, the lighthouse
    assert not [p for p in pids if pid_alive(p)], "processes of the run are left"


def test_faults_kill_rank_restarts_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_cli([f"hydra.run.dir={run}", *COMMON, "strategy=local_sgd", "strategy.tau=4", *LONG,
             "faults.kill_rank=2", "faults.kill_at_step=50"], timeout=400)
    s = _summary(run)
    assert s["status"] == "ok"
    assert s["ft"]["restarts"] == [0, 0, 1]
    assert s["ft"]["deaths"][0]["signal"] == "SIGKILL"
    assert [j["rank"] for j in s["ft"]["rejoins"]] == [2]
    assert s["steps_per_rank"] == [300, 300, 300]
    rounds = [e["rounds"] for e in s["extras"]]
    assert rounds == [75, 75, 75], rounds  # the rejoined worker is in step with the others


def test_faults_kill_every_s_kills_seeded_victims_and_each_rejoins(tmp_path: Path) -> None:
    import random

    run = tmp_path / "run"
    run_cli([f"hydra.run.dir={run}", *COMMON, "strategy=local_sgd", "strategy.tau=4", "trainer.max_epochs=80", "trainer.check_val_every_n_epoch=40",
             "faults.kill_every_s=5", "faults.kill_seed=3", "ft.max_restarts=10"], timeout=400)
    s = _summary(run)
    assert s["status"] == "ok", s["error"]
    ft = s["ft"]
    kills = ft["injected_kills"]
    assert len(kills) >= 1, ft
    # every worker was up and had restarts left at each kill: the draw is the seeded one over all three
    ref = random.Random(3)
    assert [k["rank"] for k in kills] == [ref.choice([0, 1, 2]) for _ in kills]
    assert all(b["t_s"] - a["t_s"] >= 5.0 for a, b in zip(kills, kills[1:]))
    injected = [d for d in ft["deaths"] if d.get("injected") == "faults.kill_every_s"]
    assert [(d["rank"], d["attempt"], d["signal"]) for d in injected] == [
        (k["rank"], k["attempt"], "SIGKILL") for k in kills]
    assert sum(ft["restarts"]) == len(kills)
    # every restarted start rejoined (each start's own record), unless the others finished first
    late = ft["ended_before_rejoin"]
    assert len(ft["rejoins"]) == len(kills) - len(late), (ft["rejoins"], kills, late)
    never_rejoined = {(r, ft["restarts"][r]) for r in late}  # a late rank's last start
    assert sorted((j["rank"], j["attempt"]) for j in ft["rejoins"]) == sorted(
        {(k["rank"], k["attempt"] + 1) for k in kills} - never_rejoined)
    assert all(j["recovery_bytes"] > 0 and j["recovery_s"] > 0 for j in ft["rejoins"])
    assert ft["lost_ranks"] == late
    if not late:
        assert s["steps_per_rank"] == [1200] * 3


def test_diloco_outer_momentum_survives_a_rejoin(tmp_path: Path) -> None:
    """diloco with the paper's outer Nesterov momentum (0.9, lr 0.7), worker 1 killed before
    the exchange of step 100: the others take that outer step on the mean of their two
    pseudo-gradients, the restarted worker receives theta and the outer momentum and takes
    the same step once (with the same divisor), so every worker -- the rejoined one too --
    ends with the same theta (validation loss equal to the last bit) after the same number
    of outer steps. A joiner left without the momentum, or applying the step twice or over
    3, ends elsewhere. (Accuracy against the fault-free run is not asserted: this toy setting
    swings with any perturbation, README, Fault tolerance: measured.)"""
    run = tmp_path / "run"
    run_cli([f"hydra.run.dir={run}", *COMMON, "strategy=diloco", "strategy.tau=4", "trainer.max_epochs=20",
             "faults.kill_rank=1", "faults.kill_at_step=100"], timeout=400)
    s = _summary(run)
    assert s["status"] == "ok" and s["ft"]["restarts"] == [0, 1, 0]
    (rejoin,) = s["ft"]["rejoins"]
    assert rejoin["rank"] == 1 and rejoin["at_step"] == 100
    assert s["ft"]["quorum_changes"][-1]["participants"] == 2  # the joiner contributed nothing to it
    assert [e["outer_syncs"] for e in s["extras"]] == [[75], [75], [75]]
    finals = [_json(run / "ranks" / f"rank{r}.json") for r in range(3)]
    assert finals[0]["val_loss"] == finals[1]["val_loss"] == finals[2]["val_loss"], [f["val_loss"] for f in finals]


# -------------------------------------------------------------------------- the lighthouse lost
def test_lighthouse_killed_ends_the_run_cleanly(tmp_path: Path) -> None:
    run = tmp_path / "run"
    log = tmp_path / "run.log"
    proc = start_cli([f"hydra.run.dir={run}", *COMMON, "strategy=sync_easgd", "trainer.max_epochs=400"],
                     base_env(), log)
    pids: set[int] = set()
    try:
        _wait(lambda: all((run / "ranks" / "ft" / f"rank{r}.json").exists() for r in range(3)), 120,
              "the three workers' first exchange")
        lighthouse = _json(run / "ranks" / "launch.json")["ft"]["lighthouse_pid"]
        _every_pid(run, pids)
        killed = time.monotonic()
        os.kill(lighthouse, signal.SIGKILL)
        code = proc.wait(timeout=120)
        took = time.monotonic() - killed
        _every_pid(run, pids)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 1, log.read_text()[-3000:]
    s = _summary(run)
    assert s["status"] == "failed"
    assert "lighthouse" in s["error"] and "died" in s["error"], s["error"]
    assert s["ft"]["lighthouse_lost"] is True
    assert s["ft"]["restarts"] == [0, 0, 0]  # no restart without a lighthouse
    assert took < 60, took  # bounded by the stop grace (30 s); the workers leave their quorum wait at once
    assert not [p for p in pids if pid_alive(p)], "processes of the run are left"


# -------------------------------------------------------------------------- refusals
REFUSALS = [
    (["ft.min_replicas=0"], "ft.min_replicas must be an integer in [1, 3], got 0"),
    (["ft.min_replicas=3"], "ft.min_replicas=3: with every worker required a restarted worker could never rejoin"),
    (["ft.replica_id=0"], "ft.replica_id: only under torchrun (one torchrun per worker)"),
    (["ft.replica_id=3"], "ft.replica_id must be an integer in [0, 2] or null, got 3"),
    (["ft.max_restarts=-1"], "ft.max_restarts must be an integer >= 0, got -1"),
    (["ft.lighthouse=nowhere"], "ft.lighthouse must be host:port (or http://host:port) or null, got 'nowhere'"),
    (["strategy=pipeline_3d"], "ft=torchft: strategy=pipeline_3d cannot survive a lost worker"),
    (["strategy=easgd_round_robin"], "ft=torchft: strategy=easgd_round_robin cannot survive a lost worker"),
    (["strategy=diloco", "strategy.fragments=2"], "ft=torchft: strategy.fragments=2 is not supported with strategy=diloco"),
    (["strategy=ddp", "compression=topk", "compression.plan=secopa"],
     "ft=torchft: compression.plan=secopa is not supported"),
    (["strategy=hogwild_easgd"], "ft=torchft: strategy=hogwild_easgd cannot survive a lost worker"),
    (["strategy=local_sgd", "compression=topk"], "ft=torchft: compression=topk is supported with strategy=ddp only"),
]


@pytest.mark.parametrize("overrides,expected", REFUSALS, ids=[" ".join(o) for o, _ in REFUSALS])
def test_refused_before_launch(tmp_path: Path, overrides: list[str], expected: str) -> None:
    run = tmp_path / "run"
    over = overrides if any(o.startswith("strategy=") for o in overrides) else ["strategy=local_sgd", *overrides]
    proc = run_cli([f"hydra.run.dir={run}", *COMMON, *over], check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expected in one_error_line(proc.stderr)
    assert not (run / "ranks").exists()


# -------------------------------------------------------------------------- SIGSTOP, SIGTERM
def _start_and_wait_joined(run: Path, log: Path, overrides: list[str]):
    proc = start_cli([f"hydra.run.dir={run}", *COMMON, *overrides], base_env(), log)
    _wait(lambda: all((run / "ranks" / "ft" / f"rank{r}.json").exists() for r in range(3)), 120,
          "the three workers' first exchange")
    time.sleep(1.0)
    return proc


def test_sigstopped_worker_is_dropped_killed_and_rejoins(tmp_path: Path) -> None:
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = _start_and_wait_joined(run, log, ["strategy=sync_easgd", "trainer.max_epochs=50", "ft.quorum_timeout_s=5",
                                             "ft.collective_timeout_s=3"])
    pids: set[int] = set()
    try:
        _every_pid(run, pids)
        os.kill(_json(run / "ranks" / "launch.json")["worker_pids"][1], signal.SIGSTOP)
        code = proc.wait(timeout=300)
        _every_pid(run, pids)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, log.read_text()[-3000:]
    s = _summary(run)
    ft = s["ft"]
    assert s["status"] == "ok"
    (death,) = ft["deaths"]
    assert death["rank"] == 1 and death["stopped"] is True and death["signal"] == "SIGKILL"
    # the quorum went on without it (members [0, 2]) before the launcher killed it
    assert [0, 2] in [q["members"] for q in ft["quorum_changes"]], ft["quorum_changes"]
    # killed after ft.quorum_timeout_s stopped, restarted, rejoined (on a slow machine the run
    # may end first: then it is killed at the end and named as lost)
    rejoined = ft["restarts"] == [0, 1, 0] and [j["rank"] for j in ft["rejoins"]] == [1]
    assert rejoined or (ft["restarts"] == [0, 0, 0] and ft["lost_ranks"] == [1]), ft
    if rejoined:
        assert s["steps_per_rank"] == [750, 750, 750]
    assert not [p for p in pids if pid_alive(p)], "processes of the run are left"


def test_sigterm_to_the_launcher_ends_as_without_ft(tmp_path: Path) -> None:
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = _start_and_wait_joined(run, log, ["strategy=local_sgd", "trainer.max_epochs=400"])
    pids: set[int] = set()
    try:
        _every_pid(run, pids)
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=120)
        _every_pid(run, pids)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 143, log.read_text()[-3000:]
    s = _summary(run)
    assert s["status"] == "failed" and s["error"] == "interrupted by SIGTERM"
    assert s["ft"]["restarts"] == [0, 0, 0] and s["ft"]["deaths"] == []  # a stop, not a death
    assert not [p for p in pids if pid_alive(p)], "processes of the run are left"


# -------------------------------------------------------------------------- the parameter server
#: 3 workers + the server, no lighthouse (the server re-admits restarted workers itself)
PS_COMMON = [c for c in COMMON if not c.startswith("trainer.devices=")] + ["trainer.devices=4"]
PS_EPOCHS = ["trainer.max_epochs=40"]  # 600 steps per worker (15 per epoch)


def _first_epoch(run: Path) -> bool:
    return (run / "checkpoints" / "epoch000.ckpt").exists()


def _signal_rank_and_wait(proc, run: Path, rank: int, sig: signal.Signals) -> tuple[int, set[int]]:
    """Once rank 0 finished its first epoch, send ``sig`` to rank ``rank`` (its pid from
    ranks/launch.json, as a cluster would); wait for the run's end: (exit status, every pid
    the run had). Nothing is left running if a wait fails."""
    pids: set[int] = set()
    try:
        _wait(lambda: _first_epoch(run), 120, "rank 0's first epoch")
        _every_pid(run, pids)
        os.kill(_json(run / "ranks" / "launch.json")["worker_pids"][rank], sig)
        code = proc.wait(timeout=300)
        _every_pid(run, pids)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, pids


def test_parameter_server_readmits_a_worker_killed_from_outside(tmp_path: Path) -> None:
    """async_easgd under ft=torchft: worker 1 SIGKILLed from outside (its pid from
    ranks/launch.json) once rank 0 finished its first epoch is restarted by the launcher and
    re-admitted by the server; the run ends ok with the accuracy of the same run without it."""
    base_dir = tmp_path / "fault_free"
    run_cli([f"hydra.run.dir={base_dir}", *PS_COMMON, "strategy=async_easgd", *PS_EPOCHS], timeout=400)
    base = _summary(base_dir)
    assert base["status"] == "ok" and base["ft"]["restarts"] == [0, 0, 0, 0] and base["ft"]["rejoins"] == []
    run, log = tmp_path / "killed", tmp_path / "killed.log"
    proc = start_cli([f"hydra.run.dir={run}", *PS_COMMON, "strategy=async_easgd", *PS_EPOCHS], base_env(), log)
    code, pids = _signal_rank_and_wait(proc, run, 1, signal.SIGKILL)
    s = _summary(run)
    assert code == 0, log.read_text()[-3000:]
    assert s["status"] == "ok" and s["error"] is None, s["error"]
    ft = s["ft"]
    assert ft["lighthouse"] is None and ft["restarts"] == [0, 1, 0, 0]
    (death,) = ft["deaths"]
    assert death["rank"] == 1 and death["signal"] == "SIGKILL"
    (rejoin,) = ft["rejoins"]
    assert rejoin["rank"] == 1 and rejoin["attempt"] == 1 and rejoin["recovery_s"] > 0
    n_bytes = sum(v.numel() * v.element_size() for v in _centre(run).values())
    assert rejoin["recovery_bytes"] > n_bytes  # the centre, and the server's state with it
    assert 0 < rejoin["at_step"] < 600
    assert ft["finished_ranks"] == [0, 1, 2, 3] and ft["lost_ranks"] == [] and ft["catch_ups"] == []
    # the server's membership: everyone, worker 1 gone, everyone again
    assert [q["members"] for q in ft["quorum_changes"]] == [[0, 1, 2], [0, 2], [0, 1, 2]], ft["quorum_changes"]
    server = s["extras"][3]
    (lost,) = server["lost_workers"]
    assert lost["rank"] == 1 and lost["restarted"] == 1 and server["dead_workers"] == []
    assert sorted(server["done_workers"]) == [0, 1, 2]
    # the rejoined worker went on from the step it had reached, with the others to the end
    assert rejoin["at_step"] < s["steps_per_rank"][1]
    assert abs(s["val_acc"] - base["val_acc"]) <= 0.02, (s["val_acc"], base["val_acc"])
    assert len(pids) >= 5  # four processes and the restarted one
    assert not [p for p in pids if pid_alive(p)], "processes of the run are left"


def test_parameter_server_restarts_a_self_killed_and_a_stopped_worker(tmp_path: Path) -> None:
    """async_sgd (the server steps the optimizer) with stop_policy=all: worker 2 SIGKILLs
    itself (faults.kill_rank) and worker 1 is stopped from outside (SIGSTOP). The server drops
    the stopped one after worker_timeout_s, the launcher then kills it; both are restarted,
    re-admitted, and, their step counts continued, end at the others' step with every step
    pushed exactly once (the server counts them)."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = start_cli([f"hydra.run.dir={run}", *PS_COMMON, "strategy=async_sgd", "strategy.stop_policy=all",
                      "strategy.worker_timeout_s=3", "trainer.max_epochs=10", "faults.kill_rank=2",
                      "faults.kill_at_step=40"], base_env(), log)
    code, pids = _signal_rank_and_wait(proc, run, 1, signal.SIGSTOP)
    s = _summary(run)
    assert code == 0, log.read_text()[-3000:]
    assert s["status"] == "ok", s["error"]
    ft = s["ft"]
    assert ft["restarts"] == [0, 1, 1, 0]
    deaths = {d["rank"]: d for d in ft["deaths"]}
    assert sorted(deaths) == [1, 2] and deaths[2]["signal"] == "SIGKILL"
    assert deaths[1]["stopped"] is True and deaths[1]["signal"] == "SIGKILL"  # killed once dropped
    lost = {w["rank"]: w for w in s["extras"][3]["lost_workers"]}
    assert lost[1]["cause"] == "heartbeat stopped" and lost[1]["restarted"] == 1
    rejoins = {j["rank"]: j for j in ft["rejoins"]}
    assert sorted(rejoins) == [1, 2] and rejoins[2]["at_step"] == 39  # killed at its 40th batch
    assert s["steps_per_rank"][:3] == [150, 150, 150]
    assert s["extras"][3]["served_per_rank"][:3] == [150, 150, 150]  # every step pushed, once
    assert ft["finished_ranks"] == [0, 1, 2, 3]
    assert not [p for p in pids if pid_alive(p)], "processes of the run are left"


def test_parameter_server_killed_ends_the_run_cleanly(tmp_path: Path) -> None:
    """The server holds the centre: it is not restarted, its death ends the run (exit 1, the
    error names it), no worker is restarted after it, nothing is left running."""
    run, log = tmp_path / "run", tmp_path / "run.log"
    proc = start_cli([f"hydra.run.dir={run}", *PS_COMMON, "strategy=async_easgd", "trainer.max_epochs=400"],
                     base_env(), log)
    code, pids = _signal_rank_and_wait(proc, run, 3, signal.SIGKILL)
    assert code == 1, log.read_text()[-3000:]
    s = _summary(run)
    assert s["status"] == "failed"
    assert s["error"].startswith("the parameter server (rank 3) died (signal SIGKILL)"), s["error"]
    assert s["ft"]["restarts"] == [0, 0, 0, 0]
    assert not [p for p in pids if pid_alive(p)], "processes of the run are left"


def test_a_worker_killed_after_its_last_step_is_restarted_and_reports_its_end(tmp_path: Path) -> None:
    """async_sgd, stop_policy=all: worker 1 SIGKILLs itself after its last step, before it
    tells the server it is done (faults.kill_at_end). Restarted, it rejoins at that step:
    with its epochs all done Lightning used to skip its fit loop -- and the loop's end, where
    the worker reports -- so the server and the two others waited for it with no end (a
    full-suite run hung 300 s). It must train no step and end the run with the others."""
    run = tmp_path / "run"
    run_cli([f"hydra.run.dir={run}", *PS_COMMON, "strategy=async_sgd", "strategy.stop_policy=all",
             "strategy.worker_timeout_s=3", "trainer.max_epochs=4", "faults.kill_rank=1",
             "faults.kill_at_end=true"], timeout=240)
    s = _summary(run)
    assert s["status"] == "ok", s["error"]
    ft = s["ft"]
    assert ft["restarts"] == [0, 1, 0, 0]
    (rejoin,) = ft["rejoins"]
    assert rejoin["rank"] == 1 and rejoin["at_step"] == 60  # after its last step (4 x 15)
    assert s["steps_per_rank"][:3] == [60, 60, 60]
    assert s["extras"][3]["served_per_rank"][:3] == [60, 60, 60]  # no step taken twice
    assert ft["finished_ranks"] == [0, 1, 2, 3]
