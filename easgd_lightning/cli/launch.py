"""The local launcher of ``easgd-train``: start the ranks, watch them, end them, every wait bounded.

Rules (README, "Signals, exit codes and run directories"):

* Each rank is a process running ``easgd_lightning.cli.worker`` in its own session, so a
  terminal's Ctrl-C reaches only the launcher, which forwards it; a rank whose launcher
  dies gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``). ``launcher.start_method``
  (:func:`resolve_start_method`): ``fork`` -- forked by the launcher's fork server
  (``cli/forkserver.py``), which has imported the libraries once; ``spawn`` -- a fresh
  ``python -m easgd_lightning.cli.worker``; ``auto`` -- fork on Linux for CPU runs, spawn
  for GPU ones (forking after CUDA is initialised is invalid) and where this process has
  no fork server (it was not started as ``easgd-train``).
* The launcher hosts the rendezvous store itself, bound on a free port at once (port 0),
  before any rank starts: no other program can take the port in between.
* SIGINT / SIGTERM / SIGHUP to the launcher: forwarded to every rank, which stops at the
  next step (writing ``last.ckpt`` when checkpointing is on); ``grace_s`` later the ranks
  still alive get SIGKILL. A second signal kills at once.
* A rank that exits non-zero or by a signal is a failure; the others get ``timeout_s`` to
  finish (the asynchronous strategies go on without it), then SIGTERM, then SIGKILL.
* A rank found stopped (``SIGSTOP``, state T in ``/proc``) for ``timeout_s`` has stopped
  answering: it is killed and named as the failure. Synchronous peers time out in their
  collectives after the same ``timeout_s``, so the run ends within ``timeout_s`` plus the
  exit time of the processes.
* The first failure is the earliest one seen; failures within ``_TIE_S`` seconds of it
  that the rank reported as a consequence of a lost peer yield to one that was not.
* A rank the run declared lost in the rendezvous store (``comm/liveness.py``
  ``LOST_KEY``: the parameter server does when it drops a dead or frozen worker) is one the
  others go on without: its failure starts no ``timeout_s`` countdown (unless it was not
  declared within ``_DECLARE_S`` of its exit), is not the run's failure
  (:func:`lost_rank_records`, ``summary.json`` ``ft.lost_ranks``), and once every rank not
  declared lost has ended, the declared ranks still running (a frozen worker) are killed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from easgd_lightning.cli import forkserver
from easgd_lightning.cli.forkserver import RankProcess
from easgd_lightning.cli.rules import strategy_spec_of
from easgd_lightning.cli.summary import read_rank_reports
from easgd_lightning.cli.values import START_METHODS, resolve_start_method

__all__ = [
    "LaunchOutcome",
    "LauncherSignals",
    "RunDirInUse",
    "claim_run_dir",
    "release_run_dir",
    "held_by_another_run",
    "new_run_id",
    "spawn_and_supervise",
    "resolve_start_method",
    "preload_modules",
    "START_METHODS",
    "first_failure",
    "first_failure_of_reports",
    "lost_rank_records",
    "is_peer_loss",
    "describe_returncode",
    "remove_stray_temp_files",
    "stop_grace_s",
]

log = logging.getLogger("easgd_lightning")

_POLL_S = 0.05
_TIE_S = 2.0  # failures this close to the first are ordered by cause, not by when they were seen
_DECLARE_S = 1.0  # how long after a rank's exit the run may still declare it lost
_LOST_POLL_S = 0.25  # how often the store's lost declarations are read
LOCK_NAME = "run.lock"
_WORKER_FILE = str(Path(__file__).with_name("worker.py"))  # a forked rank's sys.argv[0]


def stop_grace_s(timeout_s: float) -> float:
    """Seconds the ranks get to stop after SIGTERM before SIGKILL: min(30, timeout_s)."""
    return min(30.0, float(timeout_s))


def new_run_id() -> str:
    """A fresh run id: time, launcher PID and a random part (unique across hosts and restarts)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


# ---------------------------------------------------------------------------- run directory
class RunDirInUse(RuntimeError):
    """Another live run holds this run directory."""


_held_locks: dict[str, int] = {}  # run dir -> fd of the lock this process holds


def claim_run_dir(out_dir: Path, run_id: str) -> None:
    """Own ``out_dir`` for this run: an exclusive ``flock`` on ``out_dir/run.lock``.

    The kernel releases the lock when its holder dies, however it dies, so a lock left by a
    killed run never blocks a new one. The file names the holder (PID, host, run id).

    Raises:
        RunDirInUse: another live process holds the directory.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _read_holder(path)
        raise RunDirInUse(
            f"hydra.run.dir={out_dir} is in use by another live run "
            f"(pid {holder.get('pid', '?')} on {holder.get('host', '?')}, run id {holder.get('run_id', '?')}); "
            "give this run its own hydra.run.dir"
        ) from None
    os.ftruncate(fd, 0)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "run_id": run_id, "started": time.time()}
    os.write(fd, (json.dumps(info) + "\n").encode())
    _held_locks[str(out_dir.resolve())] = fd


def release_run_dir(out_dir: Path) -> None:
    fd = _held_locks.pop(str(Path(out_dir).resolve()), None)
    if fd is None:
        return
    try:
        os.unlink(Path(out_dir) / LOCK_NAME)
    except OSError:
        pass
    os.close(fd)  # closing releases the flock


def held_by_another_run(out_dir: Path) -> bool:
    """True when a process other than this one holds ``out_dir``'s run lock."""
    if str(Path(out_dir).resolve()) in _held_locks:
        return False
    path = Path(out_dir) / LOCK_NAME
    if not path.exists():
        return False
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _read_holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------------------- signals
class LauncherSignals:
    """While active, SIGINT / SIGTERM / SIGHUP are recorded (not raised) for the supervisor."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def _handler(self, signum, _frame) -> None:
        self.received.append(int(signum))

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None

    def __enter__(self) -> LauncherSignals:
        if threading.current_thread() is not threading.main_thread():  # only the main thread may
            return self
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------------------- outcome
def describe_returncode(code: int | None) -> dict:
    """``Popen.returncode`` as summary fields: ``{"exitcode": N}`` or ``{"signal": "SIGKILL"}``."""
    if code is None:
        return {"state": "running"}
    if code < 0:
        try:
            return {"signal": signal.Signals(-code).name}
        except ValueError:
            return {"signal": f"signal {-code}"}
    return {"exitcode": code}


def first_failure(failures: list[dict]) -> dict | None:
    """The failure that came first.

    ``failures``: dicts with ``rank``, ``t_s`` (seconds since launch when it happened or was
    seen) and ``consequence`` (True when the rank itself reported a lost peer or a stop
    caused by another rank). The earliest wins, except that within ``_TIE_S`` of the
    earliest a failure that is not a consequence is preferred.
    """
    if not failures:
        return None
    ordered = sorted(failures, key=lambda f: f["t_s"])
    window = [f for f in ordered if f["t_s"] - ordered[0]["t_s"] <= _TIE_S]
    causes = [f for f in window if not f.get("consequence")]
    return (causes or ordered)[0]


def failure_message(first: dict | None, codes: list[int | None] | None) -> str | None:
    """One line for ``summary.error``: who failed first and how, then every rank's exit
    (when the launcher saw them: ``codes`` None under torchrun / SLURM)."""
    if first is None:
        return None
    rank, at = first["rank"], first.get("t_s")
    when = f" at {at:.1f}s" if at is not None else ""
    if first.get("state") == "stopped":
        what = f"rank {rank} stopped answering (process stopped{when}, killed after timeout_s)"
        return what if codes is None else f"{what}; worker exit codes {codes}"  # its error says the same
    elif first.get("state") == "lost":  # its error is LOST_RANK_ERROR: said here once
        what = f"rank {rank} failed first: it ended without a report (SIGKILL, os._exit, or a lost node)"
        return what if codes is None else f"{what}; worker exit codes {codes}"
    elif "signal" in first:
        what = f"rank {rank} failed first: killed by {first['signal']}{when}"
    else:
        what = f"rank {rank} failed first: exit code {first.get('exitcode')}{when}"
    if first.get("error"):
        what += f" ({first['error']})"
    return what if codes is None else f"{what}; worker exit codes {codes}"


#: what gloo, NCCL and the TCP store say when a peer died or stopped answering (torch 2.14's
#: gloo raises these as plain ``RuntimeError``, not ``torch.distributed.DistError``)
PEER_LOSS_MARKS = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote worker crashing",
    "timed out", "Timed out", "NCCL communicator was aborted",
)
_DIST_ERRORS = {"DistError", "DistBackendError", "DistNetworkError", "DistStoreError"}


def is_peer_loss(err: BaseException | None) -> bool:
    """Whether ``err``, or an error it was raised from, says another rank was lost: a
    ``torch.distributed`` error, or a message of :data:`PEER_LOSS_MARKS` (also inside the
    ``RuntimeError`` a future's callback wraps it in). Such a rank's failure is a
    consequence of another's, not a cause (:func:`first_failure_of_reports`)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if _DIST_ERRORS & {k.__name__ for k in type(err).__mro__}:
            return True
        if any(mark in str(err) for mark in PEER_LOSS_MARKS):
            return True
        err = err.__cause__ or err.__context__
    return False


#: ``first_failure["error"]`` of a rank that left no report under an external launcher
LOST_RANK_ERROR = "no report: the process ended without a word (SIGKILL, os._exit, or a lost node)"


def first_failure_of_reports(reports: list[dict | None], started: float) -> dict | None:
    """The first failure of a run whose ranks another launcher started (torchrun, SLURM),
    from the ranks' own reports (``cli/worker.py``); ``started``: the time (``time.time()``)
    the ``t_s`` fields count from.

    Rule: a rank's own error (not a lost peer, not a stop signal) is a cause; the earliest
    cause wins (as :func:`first_failure`). Without one, a rank that left no report (it died
    without a word: SIGKILL, ``os._exit``, a lost node) is the first failure -- a stop
    signal always leaves a report, so signalled survivors were stopped after it (torchrun
    and SLURM signal every rank once one has died). Otherwise the earliest signal or peer
    error. None when every rank reported success.
    """
    failures, lost = [], []
    for rank, rep in enumerate(reports):
        if rep is None:
            lost.append(rank)
            continue
        if rep.get("status") == "ok":
            continue
        at = rep.get("failed_at")
        sig = rep.get("signal")
        failures.append({
            "rank": rank,
            "t_s": round(at - started, 2) if isinstance(at, (int, float)) else None,
            "exitcode": 128 + int(signal.Signals[sig]) if sig else 1,  # what the rank exits with
            "error": rep.get("error"),
            "consequence": bool(rep.get("peer_error")) or bool(sig),
        })
    causes = [f for f in failures if not f["consequence"] and f["t_s"] is not None]
    if causes:
        return first_failure(causes)
    if lost:
        return {"rank": lost[0], "t_s": None, "state": "lost", "error": LOST_RANK_ERROR}
    timed = [f for f in failures if f["t_s"] is not None]
    return first_failure(timed) if timed else (failures[0] if failures else None)


@dataclass
class LaunchOutcome:
    """What the supervisor saw."""

    exit_codes: list[int | None]
    failures: list[dict] = field(default_factory=list)
    killed_ranks: list[int] = field(default_factory=list)
    interrupted_by: int | None = None
    #: ranks the run declared lost (rank -> the declaration: ``at``, ``cause``, ...)
    lost: dict[int, dict] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    @property
    def first_failure(self) -> dict | None:
        before = [f for f in self.failures if not f.get("after_interrupt") and f["rank"] not in self.lost]
        return first_failure(before)

    @property
    def failed_ranks(self) -> list[int]:
        """Ranks that ended badly and were not declared lost (those fail the run)."""
        return [r for r, c in enumerate(self.exit_codes) if c != 0 and r not in self.lost]


def lost_rank_records(outcome: LaunchOutcome) -> list[dict]:
    """``summary.json`` ``ft.lost_ranks``: per rank the run went on without, ``why`` --
    ``killed`` (a signal from outside: SIGKILL, the OOM killer), ``terminated`` (it stopped
    on a SIGTERM / SIGINT / SIGHUP sent to it alone: 128 + N), ``crashed`` (another non-zero
    exit), ``stopped`` (frozen, e.g. SIGSTOP: killed by the launcher), ``unresponsive``
    (running but declared lost: killed by the launcher) -- ``t_s`` (when it was declared
    lost, seconds after launch), ``exit`` (as ``describe_returncode``), ``detected`` (the
    declarer's cause: ``connection lost``, ``heartbeat stopped``) and the server's
    ``updates`` and the worker's last step at that moment."""
    records = []
    for rank, info in sorted(outcome.lost.items()):
        code = outcome.exit_codes[rank]
        states = {f.get("state") for f in outcome.failures if f["rank"] == rank}
        if "stopped" in states:
            why = "stopped"
        elif rank in outcome.killed_ranks:
            why = "unresponsive"
        elif code is not None and code < 0:
            why = "killed"
        elif code is not None and code - 128 in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            why = "terminated"  # it stopped on a signal to it alone (a preempted worker)
        else:
            why = "crashed" if code else "left"
        at = info.get("at")
        records.append({
            "rank": rank, "why": why, "t_s": round(at - outcome.started, 2) if isinstance(at, (int, float)) else None,
            "exit": describe_returncode(code), "detected": info.get("cause"),
            "updates": info.get("updates"), "worker_step": info.get("worker_step"),
        })
    return records








def preload_modules(cfg: Any) -> list[str]:
    """What the fork server imports before forking this run's ranks, beyond what every rank
    imports (:data:`easgd_lightning.cli.forkserver.WORKER_MODULES`): what validating the
    config imported here (the data set's and the model's modules), and what the strategy's
    registry entry asks for (``preload_modules``: DeepSpeed for ``pipeline_3d``)."""
    names = forkserver.imported_since_start()
    names.extend(strategy_spec_of(cfg).preload)
    return names


# ---------------------------------------------------------------------------- processes
def _rendezvous_store(timeout_s: float):
    """A TCPStore served by the launcher on a port bound now (port 0 = any free one)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def _proc_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from /proc (T: stopped), None when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def kill_after_grace(procs, alive: list[int], killed: list[int], term_at: float | None, kill_at: float | None,
                     grace: float, now: float, what: str) -> float | None:
    """The last step of stopping: once ``grace`` seconds have passed since the stop began
    (``term_at``), or a second signal asked for it (``kill_at`` set), SIGKILL every process in
    ``alive`` not killed yet (recorded in ``killed``). Returns ``kill_at``."""
    if term_at is not None and kill_at is None and now - term_at >= grace:
        kill_at = now
    if kill_at is not None:
        for r in alive:
            if r not in killed:
                log.error("%s %d did not stop: SIGKILL", what, r)
                killed.append(r)
                _signal_group(procs[r], signal.SIGKILL)
    return kill_at


def _signal_group(proc: subprocess.Popen | RankProcess, sig: int) -> None:
    """Send ``sig`` to the rank's process group (the rank and its data-loader processes)."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _report_of(out_dir: Path, rank: int, run_id: str) -> dict | None:
    return read_rank_reports(out_dir, rank + 1, run_id)[rank]


def spawn_and_supervise(
    cfg_file: Path,
    out_dir: Path,
    world: int,
    timeout_s: float,
    run_id: str,
    signals: LauncherSignals,
    start_method: str = "spawn",
    preload: list[str] | None = None,
) -> LaunchOutcome:
    """Start ``world`` ranks and watch them until every one has exited (bounded; see module doc).

    ``start_method``: ``fork`` (from this process's fork server, ``cli/forkserver.py``,
    importing ``preload`` first; spawn when it has none) or ``spawn``.
    """
    grace = stop_grace_s(timeout_s)
    server = forkserver.current_server() if start_method == "fork" else None
    if start_method == "fork" and server is None:
        log.info("no fork server in this process: the ranks are spawned")
    # the store's thread lives in this process only: the fork server was forked before it
    store = _rendezvous_store(timeout_s)
    env = _launch_env(store.port, world, run_id, grace)
    procs: list[subprocess.Popen | RankProcess] = []
    try:
        for rank in range(world):
            procs.append(_start_rank(rank, env, server, cfg_file, out_dir, preload))
        from easgd_lightning.utils.atomic import atomic_write_json

        atomic_write_json(out_dir / "ranks" / "launch.json", {  # who is who, for users and tests
            "run_id": run_id, "launcher_pid": os.getpid(), "worker_pids": [p.pid for p in procs],
            "rendezvous_port": store.port, "start_method": "fork" if server is not None else "spawn",
            "fork_server_pid": server.pid if server is not None else None,
        })
        return _supervise(procs, out_dir, timeout_s, grace, run_id, signals, store)
    finally:
        _kill_leftovers(procs)  # whatever happened above, nothing we started outlives the launcher
        del store


def _launch_env(port: int, world: int, run_id: str, grace: float) -> dict[str, str]:
    """The environment every rank gets (its ``RANK`` / ``LOCAL_RANK`` aside)."""
    env = dict(os.environ)
    env.pop("EASGD_PARENT_PID", None)  # set for each forked rank by the fork server only
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # every rank is a client of the launcher's store
        WORLD_SIZE=str(world),
        NODE_RANK="0",
        EASGD_RUN_ID=run_id,
        EASGD_LAUNCHER_PID=str(os.getpid()),
        EASGD_STOP_GRACE_S=str(grace),
    )
    return env


def _start_rank(rank: int, env: dict[str, str], server: Any, cfg_file: Path, out_dir: Path,
                preload: list[str] | None) -> subprocess.Popen | RankProcess:
    """Rank ``rank``: forked by ``server`` (when there is one) or spawned, in its own session."""
    rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
    if server is not None:
        return server.start([_WORKER_FILE, str(cfg_file), str(out_dir)], rank_env, os.getcwd(), list(preload or ()))
    return subprocess.Popen(
        [sys.executable, "-m", "easgd_lightning.cli.worker", str(cfg_file), str(out_dir)],
        env=rank_env,
        stdin=subprocess.DEVNULL,  # in their own session, a read from the terminal would stop them
        start_new_session=True,
    )


def _kill_leftovers(procs: list[subprocess.Popen | RankProcess]) -> None:
    """SIGKILL every rank still running (bounded wait for each)."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not refusable
                log.error("rank pid %d did not die after SIGKILL", p.pid)


def _read_lost(store, world: int) -> dict[int, dict]:
    from easgd_lightning.comm.liveness import read_lost

    try:
        return read_lost(store, range(world))
    except Exception:  # pragma: no cover - the store is this process's own; be safe anyway
        log.debug("could not read the lost ranks", exc_info=True)
        return {}


def _supervise(
    procs: list[subprocess.Popen | RankProcess], out_dir: Path, timeout_s: float, grace: float, run_id: str,
    signals: LauncherSignals, store=None,
) -> LaunchOutcome:
    """Poll the ranks until every one has exited (module doc: the rules)."""
    watch = _Supervisor(procs, out_dir, timeout_s, grace, run_id, signals, store)
    while watch.step(time.monotonic()):
        time.sleep(_POLL_S)
    watch.outcome.interrupted_by = signals.first
    return watch.outcome


class _Supervisor:
    """The state of one launch's watch over its ranks; :meth:`step` is one poll."""

    def __init__(self, procs: list[subprocess.Popen | RankProcess], out_dir: Path, timeout_s: float, grace: float,
                 run_id: str, signals: LauncherSignals, store: Any) -> None:
        self.procs, self.out_dir, self.run_id, self.signals, self.store = procs, out_dir, run_id, signals, store
        self.timeout_s, self.grace = timeout_s, grace
        world = len(procs)
        self.t0 = time.monotonic()
        self.lost_read = -_LOST_POLL_S
        self.done = [False] * world
        self.stopped_since: list[float | None] = [None] * world
        self.outcome = LaunchOutcome(exit_codes=[None] * world)
        self.failed_at: float | None = None  # when the first failure was seen (the survivors' clock)
        self.term_at: float | None = None  # when SIGTERM went to the ranks still alive
        self.kill_at: float | None = None
        self.forwarded = 0

    def step(self, now: float) -> bool:
        """One poll at ``now``; False once every rank has exited."""
        for r, p in enumerate(self.procs):
            if not self.done[r]:
                self._poll_rank(r, p, now)
        alive = [r for r in range(len(self.procs)) if not self.done[r]]
        self._read_declarations(now, alive)
        if not alive:
            return False
        self._kill_lost_still_running(now, alive)
        self._track_failure(now)
        self._forward_signals(now, alive)
        if self.failed_at is not None and self.term_at is None and now - self.failed_at >= self.timeout_s:
            log.error("ranks %s still running %.0fs after a failure: SIGTERM", alive, self.timeout_s)
            for r in alive:
                _signal_group(self.procs[r], signal.SIGTERM)
                _signal_group(self.procs[r], signal.SIGCONT)
            self.term_at = now
        self.kill_at = kill_after_grace(self.procs, alive, self.outcome.killed_ranks, self.term_at, self.kill_at,
                                        self.grace, now, "rank")
        return True

    def _failure(self, r: int, t_s: float, **fields: Any) -> None:
        self.outcome.failures.append({"rank": r, "t_s": round(t_s, 2), **fields,
                                      "after_interrupt": bool(self.signals.received)})

    def _poll_rank(self, r: int, p: subprocess.Popen | RankProcess, now: float) -> None:
        """Record rank ``r``'s exit (a failure unless 0 or killed by us); kill it when it has
        been stopped (SIGSTOP) for ``timeout_s``."""
        code = p.poll()
        if code is not None:
            self.done[r] = True
            self.outcome.exit_codes[r] = code
            if code != 0 and r not in self.outcome.killed_ranks:
                rep = _report_of(self.out_dir, r, self.run_id) or {}
                # a rank we told to stop, or one that lost a peer, is not the cause
                self._failure(r, now - self.t0, **describe_returncode(code), error=rep.get("error"),
                              consequence=bool(rep.get("peer_error")) or self.term_at is not None)
            return
        if _proc_state(p.pid) not in ("T", "t"):
            self.stopped_since[r] = None
            return
        since = self.stopped_since[r] = self.stopped_since[r] or now
        if now - since >= self.timeout_s:
            log.error("rank %d has been stopped for %.0fs (timeout_s): killing it", r, now - since)
            self._failure(r, since - self.t0, state="stopped", error=f"process stopped for {self.timeout_s:g}s",
                          consequence=False)
            self.outcome.killed_ranks.append(r)
            _signal_group(p, signal.SIGKILL)

    def _read_declarations(self, now: float, alive: list[int]) -> None:
        """The ranks declared lost (comm/liveness.py), read every ``_LOST_POLL_S``; they count
        until the launcher itself signals the ranks (then ranks leave because they were told
        to, and that is not a loss the run went on without)."""
        if self.store is None or self.term_at is not None or (now - self.lost_read < _LOST_POLL_S and alive):
            return
        self.lost_read = now
        declared = _read_lost(self.store, len(self.procs))  # a declaration may also be withdrawn
        for r in sorted(set(declared) - set(self.outcome.lost)):
            log.warning("rank %d was declared lost (%s); the run goes on without it", r, declared[r].get("cause"))
        self.outcome.lost = declared

    def _kill_lost_still_running(self, now: float, alive: list[int]) -> None:
        """When every rank left is declared lost, nobody waits for them any more: SIGKILL."""
        lost = self.outcome.lost
        if not lost or not all(r in lost for r in alive):
            return
        for r in alive:
            if r in self.outcome.killed_ranks:
                continue
            stopped = _proc_state(self.procs[r].pid) in ("T", "t")
            log.warning("rank %d was declared lost and is still running (%s): SIGKILL", r,
                        "stopped" if stopped else "not stopped")
            self._failure(r, now - self.t0, state="stopped" if stopped else "lost",
                          error="declared lost and still running at the end of the run", consequence=False)
            self.outcome.killed_ranks.append(r)
            _signal_group(self.procs[r], signal.SIGKILL)

    def _track_failure(self, now: float) -> None:
        """Start (or reset) the survivors' ``timeout_s`` clock on a failure not tolerated
        (a rank not declared lost within ``_DECLARE_S``)."""
        untolerated = [f for f in self.outcome.failures
                       if f["rank"] not in self.outcome.lost and (now - self.t0) - f["t_s"] >= _DECLARE_S]
        if not untolerated:
            self.failed_at = None
        elif self.failed_at is None and not self.signals.received:  # after a signal: stopping, said once
            self.failed_at = now
            log.warning("a worker failed; the others get up to %.0fs (timeout_s) to finish", self.timeout_s)

    def _forward_signals(self, now: float, alive: list[int]) -> None:
        """The launcher was signalled: forward the first signal once, escalate on a second."""
        if len(self.signals.received) <= self.forwarded:
            return
        self.forwarded = len(self.signals.received)
        if self.forwarded == 1:
            sig = self.signals.received[0]
            log.warning("received %s: stopping the workers (up to %.0fs)", signal.Signals(sig).name, self.grace)
            for r in alive:
                _signal_group(self.procs[r], sig)
                _signal_group(self.procs[r], signal.SIGCONT)
            self.term_at = self.term_at or now
        elif self.kill_at is None:
            self.kill_at = now


def remove_stray_temp_files(out_dir: Path) -> list[Path]:
    """Remove ``.NAME.*.tmp`` files of interrupted atomic writes under ``out_dir``.

    Call only when no process of the run is alive: then nobody can be writing one.
    """
    removed = []
    for path in Path(out_dir).rglob(".*.tmp"):
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed
