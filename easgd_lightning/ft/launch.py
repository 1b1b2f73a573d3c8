"""The local launcher under ``ft=torchft``: a lighthouse, workers that are restarted, a summary
that says who was lost and how the run recovered.

Rules (README "Fault tolerance"), every wait bounded:

* ``ft.lighthouse=null``: a lighthouse process (:mod:`easgd_lightning.ft.lighthouse`) is
  started first and waited for until it answers; it is stopped at the end, whatever
  happened. ``ft.lighthouse=host:port``: that one must answer before any worker starts.
* Each worker is started as by ``cli/launch.py`` (fork server or spawn, its own session,
  SIGTERM when the launcher dies), plus ``EASGD_FT_*`` variables (its rank among the workers,
  their number, which start this is, the lighthouse).
* A worker that exits non-zero or by a signal while the run goes on is restarted, up to
  ``ft.max_restarts`` times per worker; it rejoins through torchft (live state from a peer).
  No restart once a worker has finished (there is nothing left to rejoin), once the launcher
  was signalled, or once the lighthouse is gone. A worker found stopped (SIGSTOP) for
  ``ft.quorum_timeout_s`` is killed (the others' quorum has dropped it by then) and restarted.
* A worker beyond its restarts is lost. The run is ``ok`` when at least ``ft.min_replicas``
  workers finished; the summary names the lost ones.
* A restarted worker still waiting to rejoin, or a stopped one, when every other worker has
  finished is killed (a joiner holds no state of its own yet): the run is over, there is no
  peer to recover from; the summary counts it as lost.
* The lighthouse dying mid-run ends the run: the error names it, the workers get SIGTERM,
  SIGKILL after the stop grace; nothing started is left running.
* SIGINT / SIGTERM / SIGHUP to the launcher: as without ft (forwarded; a second one kills).
* ``faults.kill_every_s``: seeded random SIGKILLs of one worker at a time (:mod:`.punisher`),
  recorded in the summary's ``injected_kills`` and marked ``injected`` among the deaths.

The parameter-server family (``ft/config.py`` ``rejoins_natively``) takes the same path with
no lighthouse (:class:`_ServerRun`): its server re-admits a restarted worker itself
(``strategies/ps/rejoin.py``). The server (the last rank) is not restarted: its death ends
the run as the lighthouse's does. A stopped worker is killed (and restarted) once the server
has declared it lost (after ``strategy.worker_timeout_s`` without heartbeat); a stopped server
after ``timeout_s``. A worker given up (no restart left, or the run over) is marked gone in
the store, so the server does not wait for it to come back.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from easgd_lightning.cli import forkserver
from easgd_lightning.cli import launch as L
from easgd_lightning.cli.summary import build_summary
from easgd_lightning.comm.liveness import GONE_KEY
from easgd_lightning.ft.config import lighthouse_address, rejoins_natively
from easgd_lightning.ft.lighthouse import LighthouseProcess, answers
from easgd_lightning.ft.punisher import Punisher
from easgd_lightning.ft.worker import ENV_ATTEMPT, ENV_LIGHTHOUSE
from easgd_lightning.utils.atomic import atomic_write_json

log = logging.getLogger("easgd_lightning")

__all__ = ["FTOutcome", "spawn_and_supervise_ft", "ft_summary", "ft_run_summary"]


@dataclass
class FTOutcome(L.LaunchOutcome):
    """What the supervisor saw, plus the fault-tolerance record."""

    restarts: list[int] = field(default_factory=list)
    deaths: list[dict] = field(default_factory=list)  # every worker death it saw
    lost_ranks: list[int] = field(default_factory=list)
    finished_ranks: list[int] = field(default_factory=list)
    ended_waiting: list[int] = field(default_factory=list)  # restarted, ended before rejoining
    lighthouse: str | None = None
    lighthouse_pid: int | None = None
    lighthouse_lost: bool = False
    servers: list[int] = field(default_factory=list)  # processes that are not replicas (never restarted)
    error: str | None = None
    injected_kills: list[dict] = field(default_factory=list)  # faults.kill_every_s: {rank, attempt, t_s}


@dataclass
class _ServerRun:
    """A parameter-server run under ft=torchft (module doc): its server rank, the run's store
    (the launcher hosts it), and how long a stopped server is left before it is killed."""

    server: int
    store: Any
    timeout_s: float

    def declared_lost(self, world: int) -> set[int]:
        return set(L._read_lost(self.store, world))

    def give_up(self, rank: int) -> None:
        """Nobody waits for ``rank`` to rejoin any more."""
        try:
            self.store.set(GONE_KEY.format(rank=rank), "1")
        except Exception:  # pragma: no cover - the store is this process's own
            log.debug("could not mark rank %d gone", rank, exc_info=True)


def _start_worker(rank: int, attempt: int, env: dict, cfg_file: Path, out_dir: Path, server, preload):
    rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), ENV_ATTEMPT: str(attempt)}
    if server is not None:
        return server.start([L._WORKER_FILE, str(cfg_file), str(out_dir)], rank_env, os.getcwd(), list(preload or ()))
    return subprocess.Popen([sys.executable, "-m", "easgd_lightning.cli.worker", str(cfg_file), str(out_dir)],
                            env=rank_env, stdin=subprocess.DEVNULL, start_new_session=True)


def _joined(out_dir: Path, rank: int, attempt: int) -> bool:
    try:
        info = json.loads((out_dir / "ranks" / "ft" / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return False
    return info.get("attempt") == attempt


def _punisher(cfg: Any) -> Punisher | None:
    """``faults.kill_every_s`` (null: no injected kills); the draw is seeded with
    ``faults.kill_seed``, else the run's ``seed``."""
    faults = cfg.get("faults") or {}
    every = faults.get("kill_every_s")
    if every is None:
        return None
    seed = faults.get("kill_seed")
    return Punisher(float(every), int(cfg.get("seed", 0) if seed is None else seed))


def spawn_and_supervise_ft(cfg: Any, cfg_file: Path, out_dir: Path, world: int, timeout_s: float, run_id: str,
                           signals: L.LauncherSignals, start_method: str = "spawn",
                           preload: list[str] | None = None) -> FTOutcome:
    """Start the lighthouse (unless ``ft.lighthouse`` names one) and ``world`` workers; watch,
    restart, end them (module doc). Never raises for a worker's failure: it is in the outcome."""
    ft = cfg.ft
    grace = L.stop_grace_s(timeout_s)
    quorum_s = float(ft.get("quorum_timeout_s", 60))
    max_restarts = int(ft.get("max_restarts", 3))
    outcome = FTOutcome(exit_codes=[None] * world, restarts=[0] * world)
    native = rejoins_natively(cfg)
    lh: LighthouseProcess | None = None
    server = forkserver.current_server() if start_method == "fork" else None
    if native:  # no lighthouse: the parameter server re-admits restarted workers
        outcome.servers = [world - 1]
    elif ft.get("lighthouse") is None:
        lh = LighthouseProcess(out_dir, int(ft.get("min_replicas", 1)), float(ft.get("join_timeout_s", 10)),
                               float(ft.get("heartbeat_timeout_s", 2)))
        try:
            outcome.lighthouse = lh.start(timeout_s=min(60.0, timeout_s), fork_server=server)
        except RuntimeError as err:
            outcome.error = str(err)
            return outcome
        outcome.lighthouse_pid = lh.pid
    else:
        outcome.lighthouse = lighthouse_address(ft.lighthouse)
        if not answers(outcome.lighthouse, timeout=5.0):
            outcome.error = f"ft.lighthouse={ft.lighthouse}: nothing answers there"
            return outcome
    store = L._rendezvous_store(timeout_s)  # the initial workers' barrier (ft/worker.py)
    store_port = store.port
    env = dict(os.environ)
    env.pop("EASGD_PARENT_PID", None)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port), TORCHELASTIC_USE_AGENT_STORE="True",
               WORLD_SIZE=str(world), NODE_RANK="0", EASGD_RUN_ID=run_id, EASGD_LAUNCHER_PID=str(os.getpid()),
               EASGD_STOP_GRACE_S=str(grace))
    if outcome.lighthouse is not None:
        env[ENV_LIGHTHOUSE] = outcome.lighthouse
    ps = _ServerRun(world - 1, store, timeout_s) if native else None
    env.setdefault("RUST_LOG", "warn")
    procs: list = []
    attempts = [0] * world
    t0 = time.monotonic()

    def write_launch() -> None:
        atomic_write_json(out_dir / "ranks" / "launch.json", {
            "run_id": run_id, "launcher_pid": os.getpid(), "worker_pids": [p.pid for p in procs],
            "attempts": list(attempts), "rendezvous_port": store_port,
            "start_method": "fork" if server is not None else "spawn",
            "fork_server_pid": server.pid if server is not None else None,
            "ft": {"lighthouse": outcome.lighthouse, "lighthouse_pid": outcome.lighthouse_pid},
        })

    try:
        for rank in range(world):
            procs.append(_start_worker(rank, 0, env, cfg_file, out_dir, server, preload))
        write_launch()
        _supervise_ft(procs, attempts, outcome, lh, env, cfg_file, out_dir, server, preload, signals,
                      max_restarts, quorum_s, grace, t0, write_launch, ps, _punisher(cfg))
    finally:
        for p in procs:  # nothing we started outlives the launcher
            if p.poll() is None:
                L._signal_group(p, signal.SIGKILL)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refusable
                    log.error("worker pid %d did not die after SIGKILL", p.pid)
        if lh is not None:
            lh.stop()
        store = None  # noqa: F841 -- the barrier's store closes with its last reference
    return outcome


def _stopped_too_long(r: int, stopped_for: float, quorum_s: float, ps: _ServerRun | None, declared: set[int]) -> bool:
    """Whether a stopped (SIGSTOP) process is killed now: under torchft after
    ``ft.quorum_timeout_s`` (the quorum has dropped it by then); a parameter-server worker
    once the server declared it lost; the server after ``timeout_s``."""
    if ps is None:
        return stopped_for >= quorum_s
    return stopped_for >= ps.timeout_s if r == ps.server else r in declared


def _server_up(procs, ps: _ServerRun | None) -> bool:
    """The parameter server is running and not stopped (True without one)."""
    if ps is None:
        return True
    p = procs[ps.server]
    return p.poll() is None and L._proc_state(p.pid) not in ("T", "t")


def _supervise_ft(procs, attempts, outcome: FTOutcome, lh, env, cfg_file, out_dir, server, preload, signals,
                  max_restarts: int, quorum_s: float, grace: float, t0: float, write_launch,
                  ps: _ServerRun | None = None, punisher: Punisher | None = None) -> None:
    world = len(procs)
    done = [False] * world
    stopped_since: list[float | None] = [None] * world
    term_at: float | None = None
    kill_at: float | None = None
    forwarded = 0
    lost_read, declared = -L._LOST_POLL_S, set()
    while True:
        now = time.monotonic()
        stopping = bool(signals.received) or outcome.lighthouse_lost
        if ps is not None and now - lost_read >= L._LOST_POLL_S:
            lost_read, declared = now, ps.declared_lost(world)
        for r, p in enumerate(procs):
            if done[r]:
                continue
            code = p.poll()
            if code is None:
                if L._proc_state(p.pid) in ("T", "t"):  # stopped: dropped by the others after a while
                    stopped_since[r] = stopped_since[r] or now
                    if r not in outcome.killed_ranks and _stopped_too_long(r, now - stopped_since[r], quorum_s,
                                                                           ps, declared):
                        log.error("rank %d has been stopped for %.0fs and dropped by the others: killing it", r,
                                  now - stopped_since[r])
                        outcome.killed_ranks.append(r)
                        L._signal_group(p, signal.SIGKILL)
                else:
                    stopped_since[r] = None
                continue
            outcome.exit_codes[r] = code
            if code == 0:
                done[r] = True
                outcome.finished_ranks.append(r)
                continue
            if stopping or (term_at is not None and r not in outcome.killed_ranks):
                done[r] = True  # told to stop (a signal, the lighthouse lost): not a death
                continue
            death = {"rank": r, "attempt": attempts[r], "t_s": round(now - t0, 3), "wall": time.time(),
                     **L.describe_returncode(code)}
            if r in outcome.killed_ranks:
                death["stopped"] = True
                outcome.killed_ranks.remove(r)
            if any(k["rank"] == r and k["attempt"] == attempts[r] for k in outcome.injected_kills):
                death["injected"] = "faults.kill_every_s"
            outcome.deaths.append(death)
            stopped_since[r] = None
            if r in outcome.servers:  # it holds the centre: not replaceable, the run ends
                done[r] = True
                how = " ".join(f"{k} {v}" for k, v in L.describe_returncode(code).items())
                outcome.error = (f"the parameter server (rank {r}) died ({how}): it holds the centre and cannot "
                                 "be restarted; stopping the workers")
                log.error(outcome.error)
                term_at = term_at or _stop_all(procs, done)
                continue
            can_restart = (not stopping and not outcome.finished_ranks and outcome.restarts[r] < max_restarts
                           and term_at is None and (lh is None or lh.alive()) and _server_up(procs, ps))
            if can_restart:
                attempts[r] += 1
                outcome.restarts[r] += 1
                procs[r] = _start_worker(r, attempts[r], env, cfg_file, out_dir, server, preload)
                death["restarted_wall"] = time.time()
                log.warning("worker %d died (%s): restart %d of %d (ft.max_restarts)", r,
                            L.describe_returncode(code), outcome.restarts[r], max_restarts)
                write_launch()
                continue
            done[r] = True
            if ps is not None:
                ps.give_up(r)
            if r in outcome.ended_waiting:
                continue
            outcome.lost_ranks.append(r)
            if not stopping and term_at is None:
                outcome.failures.append({"rank": r, "t_s": death["t_s"], **L.describe_returncode(code),
                                         "error": "lost: no restart left (ft.max_restarts)" if not outcome.finished_ranks
                                         else "died after other workers had finished", "consequence": False})
        alive = [r for r in range(world) if not done[r]]
        if not alive:
            break
        if punisher is not None and term_at is None and not stopping and not outcome.finished_ranks:
            _punish(punisher, procs, attempts, alive, stopped_since, outcome, out_dir, max_restarts, now, t0, ps)
        if lh is not None and not lh.alive() and not outcome.lighthouse_lost:
            outcome.lighthouse_lost = True
            outcome.error = (f"the torchft lighthouse (pid {lh.pid}, {outcome.lighthouse}) died "
                             f"(exit {lh.proc.returncode}): no quorum is possible; stopping the workers")
            log.error(outcome.error)
            term_at = term_at or _stop_all(procs, done)
        # the others have finished: end the restarted workers still waiting to rejoin and the
        # stopped ones (SIGSTOP), which no quorum will take any more
        if outcome.finished_ranks and term_at is None:
            waiting = [r for r in alive if (attempts[r] > 0 and not _joined(out_dir, r, attempts[r]))
                       or stopped_since[r] is not None]
            if waiting and len(waiting) == len(alive):
                # a joiner holds no state of its own yet (it comes from a peer): nothing to save
                log.warning("workers %s were restarted but the run ended before they rejoined, or are "
                            "stopped: killing them", waiting)
                outcome.ended_waiting.extend(waiting)
                for r in waiting:
                    outcome.killed_ranks.append(r)
                    L._signal_group(procs[r], signal.SIGKILL)
                term_at = now
        if len(signals.received) > forwarded:
            forwarded = len(signals.received)
            if forwarded == 1:
                sig = signals.received[0]
                log.warning("received %s: stopping the workers (up to %.0fs)", signal.Signals(sig).name, grace)
                for r in alive:
                    L._signal_group(procs[r], sig)
                    L._signal_group(procs[r], signal.SIGCONT)
                term_at = term_at or now
            elif kill_at is None:
                kill_at = now
        kill_at = L.kill_after_grace(procs, alive, outcome.killed_ranks, term_at, kill_at, grace, now, "worker")
        time.sleep(L._POLL_S)
    outcome.interrupted_by = signals.first


def _punish(punisher: Punisher, procs, attempts, alive, stopped_since, outcome: FTOutcome, out_dir: Path,
            max_restarts: int, now: float, t0: float, ps: _ServerRun | None = None) -> None:
    """One step of ``faults.kill_every_s``: arm the clock once every worker has joined, then
    SIGKILL the drawn worker when a kill is due and every unfinished worker is up. The
    parameter server is never drawn (it is not replaceable); a parameter-server worker's first
    start is up from its start (it records only rejoins)."""
    workers = [r for r in alive if ps is None or r != ps.server]

    def joined(r: int) -> bool:
        return (ps is not None and attempts[r] == 0) or _joined(out_dir, r, attempts[r])

    up = [r for r in workers if stopped_since[r] is None and joined(r)]
    all_up = len(up) == len(workers) and (ps is None or ps.server in alive)
    if all_up:
        punisher.arm(now)
    victim = punisher.pick(now, [r for r in up if outcome.restarts[r] < max_restarts], all_up)
    if victim is None:
        return
    log.warning("faults.kill_every_s: SIGKILL to worker %d (pid %d)", victim, procs[victim].pid)
    outcome.injected_kills.append({"rank": victim, "attempt": attempts[victim], "t_s": round(now - t0, 3)})
    L._signal_group(procs[victim], signal.SIGKILL)


def _stop_all(procs, done: list[bool]) -> float:
    """SIGTERM (and SIGCONT) to every process still running; returns when (monotonic)."""
    for r, p in enumerate(procs):
        if not done[r]:
            L._signal_group(p, signal.SIGTERM)
            L._signal_group(p, signal.SIGCONT)
    return time.monotonic()


def ft_summary(outcome: FTOutcome, reports: list[dict | None], min_replicas: int, launch_wall: float,
               out_dir: Path | None = None) -> dict:
    """The ``ft`` part of summary.json from the launcher's record, the workers' reports (their
    last start's) and, under ``out_dir``, each start's join record (the rejoins of starts that
    were killed again before the end)."""
    per_rank = [((r or {}).get("extras") or {}).get("ft") if r and r.get("status") == "ok" else None for r in reports]
    changes: dict[Any, dict] = {}
    for rep in per_rank:
        for q in (rep or {}).get("quorum_changes", []):
            key = q.get("quorum_id")
            if key not in changes or q["t"] < changes[key]["t"]:
                changes[key] = q
    # members: the workers in the quorum; participants: how many of them contributed (a
    # worker rejoining in that exchange receives its peer's state and contributes nothing)
    quorum_changes = [{"step": q["step"], "quorum_id": q["quorum_id"], "members": q["members"],
                       "participants": q.get("participants"), "t_s": round(q["t"] - launch_wall, 3)}
                      for q in sorted(changes.values(), key=lambda q: q["t"])]
    rejoins, catch_ups = [], []
    for r, rep in enumerate(per_rank):
        for i, rec in enumerate((rep or {}).get("recoveries") or []):
            if i > 0 or rep["attempt"] == 0:  # a live worker that fell one commit behind
                catch_ups.append({"rank": r, "attempt": rep["attempt"], "at_step": rec["step"],
                                  "recovery_bytes": rec["bytes"], "t_s": round(rec["joined_at"] - launch_wall, 3)})
                continue
            rejoins.append(_rejoin(r, rep, rec, outcome, launch_wall))
    rejoins += _earlier_rejoins(outcome, per_rank, out_dir, launch_wall) if out_dir is not None else []
    rejoins.sort(key=lambda j: j["rejoined_t_s"])
    finished = sorted(set(outcome.finished_ranks))
    return {
        "lighthouse": outcome.lighthouse,
        "min_replicas": min_replicas,
        "quorum_changes": quorum_changes,
        "restarts": list(outcome.restarts),
        "deaths": [{**{k: v for k, v in d.items() if k not in ("wall", "restarted_wall", "t_s")},  # wall None:
                    "t_s": round(d["wall"] - launch_wall, 3) if d.get("wall") else None}   # unknown (torchrun)
                   for d in outcome.deaths],
        "steps_not_committed": [(rep or {}).get("not_committed") if rep else None for rep in per_rank],
        "rejoins": rejoins,
        "catch_ups": catch_ups,
        "recovery_s": [j["recovery_s"] for j in rejoins],
        "recovery_bytes": sum(j["recovery_bytes"] for j in rejoins + catch_ups),
        "finished_ranks": finished,
        "lost_ranks": sorted(set(outcome.lost_ranks) | set(outcome.ended_waiting)),
        "ended_before_rejoin": sorted(set(outcome.ended_waiting)),
        "lighthouse_lost": outcome.lighthouse_lost,
        "injected_kills": list(outcome.injected_kills),
        "enough_replicas": len(set(finished) - set(outcome.servers)) >= min_replicas,
    }


def _earlier_rejoins(outcome: FTOutcome, per_rank: list, out_dir: Path, launch_wall: float) -> list[dict]:
    """Rejoins of restarted starts whose report is not the rank's last (they died again): from
    the join record each start writes at its first committed exchange (ft/worker.py)."""
    out = []
    for r, rep in enumerate(per_rank):
        last = (rep or {}).get("attempt")
        for path in sorted((out_dir / "ranks" / "ft").glob(f"rank{r}.attempt*.json")):
            try:
                info = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if info.get("attempt", 0) == 0 or info.get("attempt") == last or not info.get("healed"):
                continue
            rec = {"step": info.get("step"), "bytes": info.get("recovery_bytes", 0),
                   "joined_at": info["joined_at"], "started_at": info.get("started_at", info["joined_at"])}
            out.append(_rejoin(r, {"attempt": info["attempt"]}, rec, outcome, launch_wall))
    return out


def ft_run_summary(resolved: dict, reports: list[dict | None], ft: dict, status: str = "ok",
                   error: str | None = None, detail: str | None = None) -> dict:
    """summary.json of an ``ft=torchft`` run (this launcher's or an external one's,
    ft/external.py) but its launch fields: ``failed`` when fewer than ``ft.min_replicas``
    workers finished (``detail`` appended to the error); under ft a lost worker is not a
    failed run (role ``lost``, as the parameter server's): the other fields are over the
    finished workers."""
    if status == "ok" and not ft["enough_replicas"]:
        status, error = "failed", (f"only workers {ft['finished_ranks']} finished, fewer than ft.min_replicas="
                                   f"{ft['min_replicas']}" + (f"; {detail}" if detail else ""))
    finished = set(ft["finished_ranks"])
    lost = [r for r in range(len(reports)) if r not in finished] if status == "ok" else []
    summary = build_summary(resolved, [rep if r in finished else None for r, rep in enumerate(reports)]
                            if status == "ok" else reports, status=status, error=error, lost=lost)
    summary["status"] = status
    if status == "ok":
        summary["error"] = None
    return summary


def _rejoin(r: int, rep: dict, rec: dict, outcome: FTOutcome, launch_wall: float) -> dict:
    """A restarted worker's rejoin: its recovery, timed from its death as the launcher saw it."""
    died = [d for d in outcome.deaths if d["rank"] == r and d["attempt"] == rep["attempt"] - 1]
    died_wall = died[-1]["wall"] if died else None
    return {
        "rank": r, "attempt": rep["attempt"], "at_step": rec["step"], "recovery_bytes": rec["bytes"],
        "died_t_s": round(died_wall - launch_wall, 3) if died_wall else None,
        "rejoined_t_s": round(rec["joined_at"] - launch_wall, 3),
        # death (as the launcher saw it) to the first committed exchange of the new start
        "recovery_s": round(rec["joined_at"] - died_wall, 3) if died_wall else None,
        "restart_to_rejoin_s": round(rec["joined_at"] - rec["started_at"], 3),
    }


def train_local_ft(cfg: Any, resolved: dict, cfg_yaml: str, out_dir: Path, world: int, timeout_s: float,
                   run_id: str, signals: L.LauncherSignals, start_method: str, preload: list[str]) -> dict:
    """``easgd-train``'s local run under ``ft=torchft``: launch, merge the reports, write
    summary.json (its ``ft`` part: :func:`ft_summary`); returns the summary."""
    from easgd_lightning.cli.summary import read_rank_reports, write_summary
    from easgd_lightning.utils.atomic import atomic_write_text

    cfg_file = out_dir / "ranks" / "config.yaml"
    atomic_write_text(cfg_file, cfg_yaml)
    launch_wall = time.time()
    log.info("launching %d workers under ft=torchft -> %s (run id %s)", world, out_dir, run_id)
    outcome = spawn_and_supervise_ft(cfg, cfg_file, out_dir, world, timeout_s, run_id, signals,
                                     start_method=start_method, preload=preload)
    for path in L.remove_stray_temp_files(out_dir):
        log.warning("removed %s, left by an interrupted write", path)
    reports = read_rank_reports(out_dir, world, run_id)
    min_replicas = int(cfg.ft.get("min_replicas", 1))
    ft = ft_summary(outcome, reports, min_replicas, launch_wall, out_dir)
    first = outcome.first_failure
    status, error = "ok", None
    if outcome.interrupted_by is not None:
        status, error = "failed", f"interrupted by {signal.Signals(outcome.interrupted_by).name}"
    elif outcome.error is not None:
        status, error = "failed", outcome.error
    summary = ft_run_summary(resolved, reports, ft, status, error,
                             detail=L.failure_message(first, outcome.exit_codes) if first else None)
    summary.update(run_id=run_id, exit_codes=outcome.exit_codes, first_failure=first,
                   killed_ranks=outcome.killed_ranks,
                   interrupted_by=signal.Signals(outcome.interrupted_by).name if outcome.interrupted_by else None,
                   ft=ft)
    path = write_summary(out_dir, summary)
    log.info("summary: %s (val_acc=%s, wall=%.1fs)", path, summary["val_acc"], summary["wall_time_s"])
    return summary
