"""``ft=torchft`` under an external launcher: torchrun (one torchrun per worker) or SLURM
(one task per worker); each worker is its own replica group with a torchft ``Manager``
(ft/worker.py), exactly as under easgd-train's own launcher (ft/launch.py).

Rules (README "Fault tolerance"), every wait bounded:

* **Which worker.** The workers are the run's world, ``trainer.devices x trainer.num_nodes``,
  as under easgd-train's own launcher. Under torchrun each torchrun is one worker of one
  process (``--nnodes 1 --nproc-per-node 1``), named by ``ft.replica_id``; under SLURM a
  task is worker ``SLURM_PROCID`` and the job must have one task per worker
  (``hydra/launcher=slurm`` gives it ``trainer.num_nodes x trainer.devices`` tasks).
* **The lighthouse.** torchrun: the user starts one first (``python -m
  easgd_lightning.ft.lighthouse``, or torchft's ``torchft_lighthouse``) and gives
  ``ft.lighthouse``; every worker waits until it answers (``ft.quorum_timeout_s``).
  SLURM, ``ft.lighthouse=null``: task 0 starts one on its node (every interface, a free
  port), publishes its address in the run directory (``ranks/ft/lighthouse.json``, with the
  job's run id), and stops it after the summary; the other tasks wait for that address to
  answer (``ft.quorum_timeout_s``). With ``ft.lighthouse=HOST:PORT`` that one is used.
* **Restarts.** torchrun's own (``--max-restarts``; ``TORCHELASTIC_RESTART_COUNT`` is the
  start; ``ft.max_restarts`` does not apply). SLURM restarts no task, so each task runs its
  worker as a child (``python -m easgd_lightning.cli.worker``, as easgd-train's launcher
  does) and restarts it up to ``ft.max_restarts`` times -- not after a signal to the task,
  nor once the lighthouse stops answering. A restarted worker rejoins from a live peer; one
  whose first quorum holds no peer ends, ``ended_before_rejoin`` (ft/worker.py).
* **The summary.** As for every external launch, the lowest worker that reported writes
  ``summary.json``; the workers share no process group to gather reports over, so every
  worker must be given the same ``hydra.run.dir`` (a shared file system across hosts, which
  SLURM's submitit launcher needs anyway). torchrun: the merging worker waits for the
  others' final reports (ok, ended before rejoin, or failed with no restart left) at most
  ``ft.quorum_timeout_s`` -- a live worker ends with it (the last exchange ties them), a
  late restart ends at its first quorum -- and counts a worker without one as lost; the
  first start of worker 0 removes an earlier run's reports from the directory (torchrun's
  run ids differ between the torchruns). SLURM: every task writes a record of its worker
  (restarts, deaths with their times, how it ended; ``ranks/ft/task<R>.json``) and task 0,
  which lives as long as the lighthouse, merges after every record came (``timeout_s``).
  Under torchrun a death's time is unknown to the workers: ``deaths[].t_s`` and a rejoin's
  ``recovery_s`` are null there, ``restart_to_rejoin_s`` is measured.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from easgd_lightning.ft.config import lighthouse_address
from easgd_lightning.ft.lighthouse import answers
from easgd_lightning.ft.worker import ENV_ATTEMPT, ENV_EXTERNAL, ENV_LIGHTHOUSE
from easgd_lightning.utils.atomic import atomic_write_json

log = logging.getLogger("easgd_lightning")

__all__ = ["Placement", "placement", "check_own_launcher", "train_as_replica", "final_report", "torchrun_record",
           "external_ft_summary"]

_POLL_S = 0.1


@dataclass(frozen=True)
class Placement:
    """Where this process stands in an externally launched ``ft=torchft`` run."""

    launcher: str  # "torchrun" or "slurm"
    replica: int  # this worker's rank among the workers
    replicas: int  # the workers
    lighthouse: str | None  # http://host:port; None: task 0 of the SLURM job starts one
    attempt: int  # which start of this worker (torchrun: TORCHELASTIC_RESTART_COUNT)
    max_restarts: int  # torchrun: its --max-restarts; SLURM: ft.max_restarts


def _world(cfg: Any) -> int:
    return int(cfg.trainer.devices) * int(cfg.trainer.get("num_nodes", 1))


def placement(cfg: Any, env: dict[str, str]) -> Placement:
    """This worker's place from the config and the launcher's variables (module doc).

    Raises:
        ConfigError: one line naming the key or the launcher option to change.
    """
    from easgd_lightning.ft.config import rejoins_natively
    from easgd_lightning.utils.errors import ConfigError

    ft, world = cfg.ft, _world(cfg)
    if rejoins_natively(cfg):
        raise ConfigError(f"ft=torchft: strategy={cfg.strategy.name} re-admits restarted workers under easgd-train's "
                          "own launcher only (its server and workers share one world); launch it with easgd-train, "
                          "or use ft=none under torchrun / SLURM")
    if "TORCHELASTIC_RESTART_COUNT" in env:  # set by torchrun for every worker it starts
        size = int(env.get("WORLD_SIZE", "1"))
        if size != 1:
            raise ConfigError(f"ft=torchft under torchrun: each torchrun is one worker of one process (torchrun "
                              f"--nnodes 1 --nproc-per-node 1, one torchrun per worker); got WORLD_SIZE={size}")
        if ft.get("replica_id") is None:
            raise ConfigError(f"ft.replica_id: under torchrun each torchrun is one worker: give ft.replica_id=0.."
                              f"{world - 1} (trainer.devices x trainer.num_nodes = {world} workers)")
        if ft.get("lighthouse") is None:
            raise ConfigError("ft.lighthouse: under torchrun start a lighthouse first (python -m "
                              "easgd_lightning.ft.lighthouse) and give every worker ft.lighthouse=HOST:PORT")
        return Placement("torchrun", int(ft.replica_id), world, lighthouse_address(ft.lighthouse),
                         int(env["TORCHELASTIC_RESTART_COUNT"]), int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")))
    if "SLURM_PROCID" in env and "RANK" not in env:
        if ft.get("replica_id") is not None:
            raise ConfigError("ft.replica_id: under SLURM task SLURM_PROCID is that worker; drop ft.replica_id")
        tasks = int(env.get("SLURM_NTASKS", "1"))
        if tasks != world:
            raise ConfigError(f"ft=torchft under SLURM: one task per worker, but the job has {tasks} tasks "
                              f"(SLURM_NTASKS) for trainer.devices x trainer.num_nodes = {world} workers")
        lighthouse = ft.get("lighthouse")
        return Placement("slurm", int(env["SLURM_PROCID"]), world,
                         lighthouse_address(lighthouse) if lighthouse is not None else None, 0,
                         int(ft.get("max_restarts", 3)))
    raise ConfigError("ft=torchft: of the external launchers only torchrun (one torchrun per worker) and SLURM (one "
                      "task per worker) are supported -- they restart lost workers; use easgd-train's own launcher "
                      "or one of them, or ft=none")


def check_own_launcher(cfg: Any) -> None:
    """``ft.replica_id`` only under torchrun: easgd-train's own launcher numbers its workers.

    Raises:
        ConfigError: one line.
    """
    from easgd_lightning.utils.errors import ConfigError

    if cfg.ft.get("replica_id") is not None:
        raise ConfigError("ft.replica_id: only under torchrun (one torchrun per worker); easgd-train's own launcher "
                          "numbers its workers 0..trainer.devices-1: drop ft.replica_id")


def _wait_answering(address: str, bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while not answers(address):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def _no_lighthouse(key: str, bound_s: float):
    from easgd_lightning.utils.errors import ConfigError

    return ConfigError(f"{key}: nothing answers there within {bound_s:.0f}s (ft.quorum_timeout_s); start it first "
                       "(python -m easgd_lightning.ft.lighthouse), or check the address")


def train_as_replica(cfg: Any, out_dir: Path) -> dict:
    """Run this process's worker under torchrun or SLURM and, if it is the one that merges,
    write summary.json (module doc); returns the summary ({} where another worker merges)."""
    from omegaconf import OmegaConf

    p = placement(cfg, dict(os.environ))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if p.launcher == "torchrun":
        return _torchrun_worker(cfg, resolved, Path(out_dir), p)
    return _slurm_task(cfg, resolved, Path(out_dir), p)


# ------------------------------------------------------------------------------ torchrun
def _remove_earlier_reports(out_dir: Path) -> None:
    """Worker 0's first start: an earlier run's reports and summary in this directory go."""
    ranks = out_dir / "ranks"
    for path in [*ranks.glob("rank*.json"), *(ranks / "ft").glob("rank*.json"), out_dir / "summary.json"]:
        path.unlink(missing_ok=True)


def _torchrun_worker(cfg: Any, resolved: dict, out_dir: Path, p: Placement) -> dict:
    from easgd_lightning.cli.worker import run_worker
    from easgd_lightning.comm.ops import close_process_group
    from easgd_lightning.ft.worker import NoPeerToRecover
    from easgd_lightning.utils import stop

    started = time.time()
    bound = float(cfg.ft.get("quorum_timeout_s", 60))
    if p.attempt == 0 and p.replica == 0:
        _remove_earlier_reports(out_dir)
    if not _wait_answering(p.lighthouse, bound):
        raise _no_lighthouse(f"ft.lighthouse={cfg.ft.lighthouse}", bound)
    os.environ.update({"RANK": str(p.replica), "WORLD_SIZE": str(p.replicas), "LOCAL_RANK": "0",
                       ENV_ATTEMPT: str(p.attempt), ENV_LIGHTHOUSE: p.lighthouse, ENV_EXTERNAL: "torchrun"})
    os.environ.setdefault("RUST_LOG", "warn")
    failure: BaseException | None = None
    try:
        run_worker(cfg, out_dir)  # on failure it has written this worker's report
    except NoPeerToRecover as err:  # its report says so; exit 0: torchrun has nothing to restart
        log.warning("ft: %s", err)
    except BaseException as err:  # noqa: BLE001 -- re-raised below
        failure = err
    close_process_group()
    signalled = stop.stop_signal() is not None
    if failure is not None and p.attempt < p.max_restarts and not signalled:
        raise failure  # torchrun starts this worker again: not its end
    wait_s = bound if not signalled else max(1.0, stop.grace_s() / 2)
    summary = _merge_torchrun(cfg, resolved, out_dir, p, wait_s, started)
    if failure is not None:
        raise failure
    return summary


def final_report(rep: dict | None, max_restarts: int) -> bool:
    """Whether a torchrun worker's report is its last: it finished, it ended before
    rejoining, or it failed on its last start (``ft_attempt`` >= torchrun's --max-restarts)."""
    if rep is None:
        return False
    if rep.get("status") in ("ok", "ended_before_rejoin"):
        return True
    return int(rep.get("ft_attempt", 0)) >= max_restarts


def _attempt_of(rep: dict) -> int:
    ft = (rep.get("extras") or {}).get("ft") or {}
    return int(ft.get("attempt", rep.get("ft_attempt", 0)))


def torchrun_record(rank: int, rep: dict | None) -> dict:
    """What the merging worker knows of worker ``rank`` under torchrun, from its last report:
    how it ended, its restarts (its start number), its deaths (times unknown: ``wall`` None)."""
    if rep is None:
        return {"rank": rank, "outcome": "lost", "restarts": None, "deaths": []}
    status = rep.get("status")
    outcome = "finished" if status == "ok" else "ended_before_rejoin" if status == "ended_before_rejoin" else "lost"
    attempt = _attempt_of(rep)
    return {"rank": rank, "outcome": outcome, "restarts": attempt,
            "deaths": [{"rank": rank, "attempt": a, "wall": None} for a in range(attempt)]}


def _merge_torchrun(cfg: Any, resolved: dict, out_dir: Path, p: Placement, wait_s: float, started: float) -> dict:
    from easgd_lightning.cli.summary import current_run_id, read_rank_reports

    deadline = time.monotonic() + wait_s
    while True:  # no run-id filter: each torchrun has its own (the module doc: earlier reports removed)
        reports = read_rank_reports(out_dir, p.replicas)
        if all(final_report(rep, p.max_restarts) for rep in reports) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    reporters = [r for r, rep in enumerate(reports) if rep is not None]
    if not reporters or reporters[0] != p.replica:
        return {}
    records = [torchrun_record(r, rep if final_report(rep, p.max_restarts) else None) for r, rep in enumerate(reports)]
    return _write_summary(cfg, resolved, out_dir, reports, records, p.lighthouse, current_run_id(), started,
                          lighthouse_lost=not answers(p.lighthouse))


# ------------------------------------------------------------------------------ SLURM
def _published_lighthouse(ft_dir: Path, run_id: str | None, bound_s: float) -> str | None:
    """The address task 0 published for this job, once it answers (None after ``bound_s``)."""
    import json

    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            info = json.loads((ft_dir / "lighthouse.json").read_text())
        except (OSError, ValueError):
            info = {}
        if info.get("run_id") == run_id and info.get("address") and answers(info["address"]):
            return info["address"]
        time.sleep(0.2)
    return None


def _slurm_task(cfg: Any, resolved: dict, out_dir: Path, p: Placement) -> dict:
    from easgd_lightning.cli.summary import current_run_id
    from easgd_lightning.ft.lighthouse import LighthouseProcess
    from easgd_lightning.utils.errors import ConfigError

    ft, run_id, started = cfg.ft, current_run_id(), time.time()
    ft_dir = out_dir / "ranks" / "ft"
    ft_dir.mkdir(parents=True, exist_ok=True)
    bound = float(ft.get("quorum_timeout_s", 60))
    lh: LighthouseProcess | None = None
    try:
        if p.lighthouse is not None:
            address = p.lighthouse
            if not _wait_answering(address, bound):
                raise _no_lighthouse(f"ft.lighthouse={ft.lighthouse}", bound)
        elif p.replica == 0:
            lh = LighthouseProcess(out_dir, int(ft.get("min_replicas", 1)), float(ft.get("join_timeout_s", 10)),
                                   float(ft.get("heartbeat_timeout_s", 2)), bind="0.0.0.0:0")
            address = lh.start(timeout_s=bound)
            atomic_write_json(ft_dir / "lighthouse.json", {"run_id": run_id, "address": address, "pid": lh.pid})
            log.info("ft: task 0 serves the lighthouse at %s", address)
        else:
            address = _published_lighthouse(ft_dir, run_id, bound)
            if address is None:
                raise ConfigError(f"ft.lighthouse=null: task 0's lighthouse (ranks/ft/lighthouse.json) did not answer "
                                  f"within {bound:.0f}s (ft.quorum_timeout_s)")
        record = _supervise_worker(cfg, resolved, out_dir, p, address, run_id)
        atomic_write_json(ft_dir / f"task{p.replica}.json", record)
        if p.replica != 0:  # task 0 merges: it lives as long as the lighthouse
            return {}
        records = _task_records(ft_dir, p.replicas, run_id, float(cfg.get("timeout_s", 300)))
        lost = (lh is not None and not lh.alive()) or (lh is None and not answers(address))
        return _merge_records(cfg, resolved, out_dir, p.replicas, records, address, run_id, started, lost)
    finally:
        if lh is not None:
            lh.stop()


def _worker_env(p: Placement, address: str, run_id: str | None, grace: float) -> dict[str, str]:
    """The worker child's environment: a process of the task, not a SLURM task itself
    (Lightning would take ``SLURM_PROCID`` for its rank), with the local launcher's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update({"RANK": str(p.replica), "WORLD_SIZE": str(p.replicas), "LOCAL_RANK": "0", "NODE_RANK": "0",
                "EASGD_LAUNCHER_PID": str(os.getpid()), "EASGD_STOP_GRACE_S": str(grace),
                ENV_LIGHTHOUSE: address, ENV_EXTERNAL: "slurm"})
    if run_id:
        env["EASGD_RUN_ID"] = run_id
    env.setdefault("RUST_LOG", "warn")
    return env


def _supervise_worker(cfg: Any, resolved: dict, out_dir: Path, p: Placement, address: str,
                      run_id: str | None) -> dict:
    """Start this task's worker, restart it while the rules allow (module doc); its record."""
    from omegaconf import OmegaConf

    from easgd_lightning.cli import launch as L
    from easgd_lightning.cli.summary import read_rank_reports
    from easgd_lightning.utils.atomic import atomic_write_text

    cfg_file = out_dir / "ranks" / "ft" / f"config{p.replica}.yaml"
    atomic_write_text(cfg_file, OmegaConf.to_yaml(OmegaConf.create(resolved)))
    grace = L.stop_grace_s(float(cfg.get("timeout_s", 300)))
    env = _worker_env(p, address, run_id, grace)
    record: dict = {"run_id": run_id, "rank": p.replica, "outcome": None, "restarts": 0, "deaths": [],
                    "interrupted_by": None}
    with L.LauncherSignals() as signals:
        while True:
            env[ENV_ATTEMPT] = str(record["restarts"])
            proc = subprocess.Popen([sys.executable, "-m", "easgd_lightning.cli.worker", str(cfg_file), str(out_dir)],
                                    env=env, stdin=subprocess.DEVNULL, start_new_session=True)
            code = _wait_worker(proc, signals, grace)
            rep = read_rank_reports(out_dir, p.replicas, run_id)[p.replica]
            if code == 0 or (rep or {}).get("status") == "ended_before_rejoin":
                record["outcome"] = "finished" if code == 0 else "ended_before_rejoin"
                break
            record["deaths"].append({"rank": p.replica, "attempt": record["restarts"], "wall": time.time(),
                                     **L.describe_returncode(code)})
            if signals.received or record["restarts"] >= p.max_restarts or not answers(address):
                record["outcome"] = "lost"
                break
            record["restarts"] += 1
            log.warning("ft: worker %d died (%s): restart %d of %d (ft.max_restarts)", p.replica,
                        L.describe_returncode(code), record["restarts"], p.max_restarts)
        if signals.first is not None:
            record["interrupted_by"] = signal.Signals(signals.first).name
    return record


def _wait_worker(proc: subprocess.Popen, signals, grace: float) -> int:
    """Its exit status; a signal to the task is forwarded, SIGKILL ``grace`` s later."""
    from easgd_lightning.cli import launch as L

    forwarded_at: float | None = None
    while proc.poll() is None:
        if signals.received and forwarded_at is None:
            forwarded_at = time.monotonic()
            L._signal_group(proc, signals.first)
            L._signal_group(proc, signal.SIGCONT)
        if forwarded_at is not None and (time.monotonic() - forwarded_at >= grace or len(signals.received) > 1):
            L._signal_group(proc, signal.SIGKILL)
            proc.wait(timeout=10)
            break
        time.sleep(_POLL_S)
    return proc.returncode


def _task_records(ft_dir: Path, tasks: int, run_id: str | None, bound_s: float) -> list[dict]:
    """Every task's record of this job (a task that wrote none by ``bound_s``: its worker lost)."""
    import json

    deadline = time.monotonic() + bound_s
    while True:
        records: list[dict | None] = []
        for r in range(tasks):
            try:
                rec = json.loads((ft_dir / f"task{r}.json").read_text())
            except (OSError, ValueError):
                rec = None
            records.append(rec if rec is not None and rec.get("run_id") == run_id else None)
        if all(records) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    return [rec or {"rank": r, "outcome": "lost", "restarts": None, "deaths": []} for r, rec in enumerate(records)]


def _merge_records(cfg: Any, resolved: dict, out_dir: Path, world: int, records: list[dict], address: str,
                   run_id: str | None, started: float, lighthouse_lost: bool) -> dict:
    from easgd_lightning.cli.summary import read_rank_reports

    reports = read_rank_reports(out_dir, world, run_id)
    return _write_summary(cfg, resolved, out_dir, reports, records, address, run_id, started, lighthouse_lost)


# ------------------------------------------------------------------------------ summary
def _launch_wall(reports: list[dict | None], default: float) -> float:
    """The first start of the run: the earliest first-start worker's, else ``default``."""
    starts = [((rep.get("extras") or {}).get("ft") or {}).get("started_at") for rep in reports
              if rep and rep.get("status") == "ok" and _attempt_of(rep) == 0]
    starts = [s for s in starts if s]
    return min(starts) if starts else default


def external_ft_summary(resolved: dict, reports: list[dict | None], records: list[dict], lighthouse: str,
                        min_replicas: int, launch_wall: float, lighthouse_lost: bool = False,
                        out_dir: Path | None = None) -> dict:
    """summary.json of an externally launched ``ft=torchft`` run from the workers' reports
    and the records of how each ended (:func:`torchrun_record`, the SLURM tasks')."""
    from easgd_lightning.ft.launch import FTOutcome, ft_run_summary, ft_summary

    outcome = FTOutcome(exit_codes=[None] * len(reports), restarts=[rec["restarts"] for rec in records],
                        deaths=[d for rec in records for d in rec["deaths"]],
                        finished_ranks=[rec["rank"] for rec in records if rec["outcome"] == "finished"
                                        and (reports[rec["rank"]] or {}).get("status") == "ok"],
                        ended_waiting=[rec["rank"] for rec in records if rec["outcome"] == "ended_before_rejoin"],
                        lighthouse=lighthouse, lighthouse_lost=lighthouse_lost)
    outcome.lost_ranks = [rec["rank"] for rec in records if rec["rank"] not in outcome.finished_ranks
                          and rec["rank"] not in outcome.ended_waiting]
    ft = ft_summary(outcome, reports, min_replicas, launch_wall, out_dir)
    signals = sorted({rec["interrupted_by"] for rec in records if rec.get("interrupted_by")})
    status, error = "ok", None
    if signals:
        status, error = "failed", f"interrupted by {signals[0]}"
    detail = "the lighthouse stopped answering" if lighthouse_lost else None
    summary = ft_run_summary(resolved, reports, ft, status, error, detail=detail)
    summary.update(first_failure=None, interrupted_by=signals[0] if signals else None, ft=ft)
    return summary


def _write_summary(cfg: Any, resolved: dict, out_dir: Path, reports: list[dict | None], records: list[dict],
                   lighthouse: str, run_id: str | None, started: float, lighthouse_lost: bool) -> dict:
    from easgd_lightning.cli.summary import write_summary

    summary = external_ft_summary(resolved, reports, records, lighthouse, int(cfg.ft.get("min_replicas", 1)),
                                  _launch_wall(reports, started), lighthouse_lost, out_dir)
    summary["run_id"] = run_id
    path = write_summary(out_dir, summary)
    log.info("summary: %s (status %s, val_acc=%s, lost workers %s)", path, summary["status"], summary["val_acc"],
             summary["ft"]["lost_ranks"])
    return summary
