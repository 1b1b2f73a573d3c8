"""``ft=torchft`` launched by torchrun, the way torchft itself is used: a lighthouse
(``python -m easgd_lightning.ft.lighthouse``, README "Fault tolerance"; started here with the
workers, which wait until it answers) and one
``torchrun --standalone --nnodes 1 --nproc-per-node 1 --max-restarts 1`` per worker (replica
group), each ``-m easgd_lightning.cli.train ft=torchft ft.lighthouse=... ft.replica_id=I``
into the same run directory.

Three workers; worker 1 is SIGKILLed from outside (its pid from ``ranks/ft/rank1.json``) a
moment after every worker committed its first exchange. The lighthouse forms quorums of all
three (``--min-replicas 3``): the two others wait in their next quorum until it is back
(bounded by ``ft.quorum_timeout_s``), so it rejoins however long a fresh interpreter takes to
start on a loaded machine (with quorums of fewer the others may finish first: it then ends
``ended_before_rejoin``, as tried by hand); ``ft.min_replicas`` 1 (the default): the exchange
it rejoins in, where it contributes nothing, commits with the others (with 2, a kill inside an
all-reduce that also leaves a survivor one commit behind leaves a single participant, and that
exchange cannot commit: README, Fault tolerance). torchrun starts it again
(``TORCHELASTIC_RESTART_COUNT`` 1), it receives the run's state from a live peer and trains
to the end with the others: every torchrun exits 0, summary.json (written by worker 0) says
``ok``, one restart and one rejoin of worker 1 with the bytes it received, every worker at the
run's last step, and every worker ends with the same model (the same validation loss and
accuracy, each evaluated on the whole validation set by the worker itself). No process of
the run is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from easgd_lightning.utils.rank_env import free_port
from tests.e2e.test_ft_torchft import _json, _wait
from tests.helpers import REPO, base_env, pid_alive

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS = 15 * 20  # digits: 15 steps per epoch per worker at 3 workers
RUN = ["strategy=sync_easgd", "trainer.devices=3", "trainer.max_epochs=20", "logger=none",
       "trainer.enable_progress_bar=false", "data.num_workers=0", "checkpoint.enabled=false"]


@pytest.fixture
def lighthouse(tmp_path: Path):
    """The lighthouse as the README starts it, on a free port; quorums of all three workers
    (``--min-replicas 3``). Not waited for: the workers wait until it answers."""
    port = free_port()
    with open(tmp_path / "lighthouse.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "easgd_lightning.ft.lighthouse", "--bind", f"127.0.0.1:{port}",
                                 "--min-replicas", "3"], env=base_env(RUST_LOG="warn"), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        yield f"127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_torchrun_worker_sigkilled_restarts_and_rejoins(tmp_path: Path, lighthouse) -> None:
    address, lh_proc = lighthouse
    run = tmp_path / "run"
    procs, logs = [], []
    started = time.monotonic()
    for i in range(3):
        logs.append(tmp_path / f"group{i}.log")
        with open(logs[-1], "wb") as log:
            procs.append(subprocess.Popen(
                [TORCHRUN, "--standalone", "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "1",
                 "--monitor-interval", "0.1", "-m", "easgd_lightning.cli.train", "ft=torchft",
                 f"ft.lighthouse={address}", f"ft.replica_id={i}", *RUN, f"hydra.run.dir={run}"],
                env=base_env(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    joined = [run / "ranks" / "ft" / f"rank{r}.json" for r in range(3)]
    pids: set[int] = {p.pid for p in procs}
    try:
        _wait(lambda: all(f.exists() for f in joined), 120, "the three workers' first exchange")
        time.sleep(0.5)
        victim = _json(joined[1])["pid"]
        pids |= {_json(f)["pid"] for f in joined}
        os.kill(victim, signal.SIGKILL)
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    wall = time.monotonic() - started
    tails = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in logs)
    print(f"3 torchruns, one worker SIGKILLed and restarted: {wall:.1f}s")
    assert codes == [0, 0, 0], tails
    rejoined = _json(joined[1])
    assert rejoined["attempt"] == 1 and rejoined["pid"] != victim and rejoined["healed"] is True
    pids.add(rejoined["pid"])
    s = _json(run / "summary.json")
    assert s is not None and s["status"] == "ok", (s or {}).get("error") or tails
    ft = s["ft"]
    assert ft["restarts"] == [0, 1, 0]
    assert ft["deaths"] == [{"rank": 1, "attempt": 0, "t_s": None}]  # torchrun does not say when or how
    (rejoin,) = ft["rejoins"]
    assert rejoin["rank"] == 1 and rejoin["attempt"] == 1 and 0 < rejoin["at_step"] < STEPS
    assert rejoin["recovery_bytes"] > 0 and rejoin["restart_to_rejoin_s"] > 0
    assert ft["finished_ranks"] == [0, 1, 2] and ft["lost_ranks"] == []
    assert ft["lighthouse"] == f"http://{address}"
    # every worker, the restarted one too, ended at the run's last step, with the same model
    assert s["steps_per_rank"] == [STEPS] * 3
    reports = [_json(run / "ranks" / f"rank{r}.json") for r in range(3)]
    assert len({(r["val_loss"], r["val_acc"]) for r in reports}) == 1, [(r["val_loss"], r["val_acc"]) for r in reports]
    assert s["val_acc"] > 0.9
    assert lh_proc.poll() is None  # the run leaves the lighthouse it did not start
    assert not [p for p in pids if pid_alive(p)], "processes of the run are left"
