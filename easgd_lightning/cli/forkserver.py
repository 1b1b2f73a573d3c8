"""The fork server of the local launcher: ranks forked from one process that has imported
the libraries once, instead of a fresh interpreter per rank.

A fresh ``python -m easgd_lightning.cli.worker`` spends seconds importing torch, Lightning
and what Lightning pulls in (torchmetrics, torchvision, scipy); on a small machine with
several ranks that is most of a short run. ``easgd-train`` therefore forks a *fork server*
at the start of :func:`easgd_lightning.cli.train.main`, when it has imported everything and
has done nothing else yet: no thread of its own, no torch operation, no rendezvous store,
no Hydra logging, no lock. The launcher later asks the server for ranks; the server forks
each one, which then runs :func:`easgd_lightning.cli.worker.worker_main` exactly as the
spawned worker does (``launch.start_method=spawn`` keeps that path; GPU runs always use
it, since a process that forks after CUDA is initialised is broken).

Contract of a forked rank (the same as a spawned one, README "Signals, exit codes and run
directories"): its own session (``os.setsid``); ``PR_SET_PDEATHSIG`` (SIGTERM when its
parent, the server, dies; the server gets SIGKILL when the launcher dies, so a killed
launcher still stops every rank); stdin ``/dev/null``, stdout and stderr the launcher's;
the environment, working directory and ``sys.argv`` the launcher gives it; the signal
handlers of a fresh interpreter; its exit status (``os.waitstatus_to_exitcode``: N, or -S
for signal S) reported to the launcher, which sees a :class:`RankProcess` with the
``pid`` / ``poll`` / ``wait`` of ``subprocess.Popen``. Every wait here is bounded.

Protocol (JSON lines over two pipes): the launcher writes ``{"op": "start", "id", "argv",
"env", "cwd", "preload", "entry"}`` (``entry``: ``module:function`` called with
``argv[1:]``, :data:`WORKER_ENTRY` for a rank); the server answers ``{"op": "started", "id", "pid"}`` (or
``{"op": "error", "id", "error"}``) and ``{"op": "exit", "pid", "code"}`` when a rank has
ended. The server ends when the launcher closes its end (end of file) or dies.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback

from easgd_lightning.utils.procs import exit_now, pid_alive

__all__ = ["ForkServer", "RankProcess", "start_server", "spawn_server", "current_server", "stop_server",
           "imported_since_start", "WORKER_MODULES", "WORKER_ENTRY"]

log = logging.getLogger("easgd_lightning")

#: what every rank imports (cli/worker.run_worker): imported once, by the server
WORKER_MODULES = (
    "torch",
    "pytorch_lightning",
    "easgd_lightning",
    "easgd_lightning.callbacks",
    "easgd_lightning.cli.build",
    "easgd_lightning.cli.trainer_config",
    "easgd_lightning.cli.worker",
    "easgd_lightning.comm",
    "easgd_lightning.guards",
    "easgd_lightning.utils.checkpoint",
)
WORKER_ENTRY = "easgd_lightning.cli.worker:worker_main"
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.05
_START_TIMEOUT_S = 120.0  # a preload (DeepSpeed) on a loaded machine plus one fork

_server: ForkServer | None = None


def _set_parent_death_signal(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux (fork is Linux-only here)
        pass


def _fork_safe() -> str | None:
    """Why this process must not fork a server now (None: it may)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return "not Linux"
    if threading.active_count() != 1:
        return f"{threading.active_count()} Python threads are running"
    return None


# ---------------------------------------------------------------------------- launcher side
class RankProcess:
    """A rank the server forked: the part of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._server.pump(_POLL_S)
        return self.returncode


class ForkServer:
    """The launcher's handle on its fork server (a child process of the launcher)."""

    def __init__(self, pid: int, requests: int, statuses: int, baseline: frozenset[str],
                 popen: subprocess.Popen | None = None) -> None:
        self.pid = pid
        self._popen = popen  # a server started as a fresh interpreter (spawn_server)
        self.owner = os.getpid()
        self.baseline = baseline  # the modules the server had when it was forked
        self._requests = requests  # write end
        self._statuses = statuses  # read end (non-blocking)
        self._buffer = b""
        self._exits: dict[int, int] = {}
        self._answers: dict[int, dict] = {}
        self._next_id = 0
        self._server_code: int | None = None

    # -- liveness
    def alive(self) -> bool:
        if self._server_code is not None:
            return False
        if self._popen is not None:
            self._server_code = self._popen.poll()
            return self._server_code is None
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            self._server_code = -1
            return False
        if pid == 0:
            return True
        self._server_code = os.waitstatus_to_exitcode(status)
        return False

    # -- messages
    def pump(self, wait_s: float = 0.0) -> None:
        """Read every message the server has written (waiting up to ``wait_s`` for one)."""
        if self._statuses < 0:
            if wait_s:
                time.sleep(wait_s)
            return
        ready, _, _ = select.select([self._statuses], [], [], wait_s)
        while ready:
            try:
                chunk = os.read(self._statuses, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:  # the server has ended
                os.close(self._statuses)
                self._statuses = -1
                break
            self._buffer += chunk
            ready, _, _ = select.select([self._statuses], [], [], 0)
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            msg = json.loads(line)
            if msg["op"] == "exit":
                self._exits[int(msg["pid"])] = int(msg["code"])
            else:
                if msg["op"] == "started":  # a PID reused after an earlier rank's exit
                    self._exits.pop(int(msg["pid"]), None)
                self._answers[int(msg["id"])] = msg

    def exit_code(self, pid: int) -> int | None:
        """The exit status of rank ``pid`` once it has ended (None while it runs)."""
        self.pump()
        if pid in self._exits:
            return self._exits[pid]
        if not self.alive() and self._statuses < 0 and not pid_alive(pid):
            # the server died (its ranks got SIGTERM from the kernel): the status is lost
            log.error("rank pid %d ended after the fork server; its exit status is unknown", pid)
            self._exits[pid] = 1
            return 1
        return None

    def start(self, argv: list[str], env: dict[str, str], cwd: str, preload: list[str],
              entry: str = WORKER_ENTRY, stdout: str | None = None, stderr: str | None = None) -> RankProcess:
        """Fork one rank running ``entry(argv[1:])`` (bounded wait for its PID); its output
        goes to the files ``stdout`` / ``stderr`` when given, else to the launcher's.

        Raises:
            RuntimeError: the server is gone or did not answer in time.
        """
        if not self.alive() or self._requests < 0:
            raise RuntimeError("the fork server is not running")
        rid = self._next_id
        self._next_id += 1
        msg = {"op": "start", "id": rid, "argv": argv, "env": env, "cwd": cwd, "preload": preload, "entry": entry,
               "stdout": stdout, "stderr": stderr}
        _write_all(self._requests, json.dumps(msg).encode() + b"\n")
        deadline = time.monotonic() + _START_TIMEOUT_S
        while rid not in self._answers:
            if time.monotonic() >= deadline or not self.alive():
                raise RuntimeError("the fork server did not start a rank")
            self.pump(_POLL_S)
        answer = self._answers.pop(rid)
        if answer["op"] != "started":
            raise RuntimeError(f"the fork server could not start a rank: {answer.get('error')}")
        return RankProcess(self, int(answer["pid"]), argv)

    def close(self) -> None:
        """End the server (it ends by itself when the launcher's end of the pipe closes)."""
        if self._requests >= 0:
            os.close(self._requests)
            self._requests = -1
        deadline = time.monotonic() + 5.0
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
                if self._popen is not None:
                    self._popen.wait(timeout=10)
                else:
                    os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError, subprocess.TimeoutExpired):
                pass
        if self._statuses >= 0:
            os.close(self._statuses)
            self._statuses = -1


def _write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` (a write to a full pipe interrupted by a signal handler returns
    early; a request carrying the preload list can be larger than the pipe's buffer)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def start_server(modules: tuple[str, ...] = WORKER_MODULES) -> ForkServer | None:
    """Fork this process's fork server (once), if it is safe now; None when it is not. The
    server imports ``modules`` first (what every rank needs).

    Call it while this process has only imported modules: before any thread, torch
    operation, rendezvous store or lock of its own.
    """
    global _server
    if _server is not None and _server.owner == os.getpid():
        return _server
    reason = _fork_safe()
    if reason is not None:
        log.debug("no fork server: %s", reason)
        return None
    req_r, req_w = os.pipe()
    st_r, st_w = os.pipe()
    launcher = os.getpid()
    baseline = frozenset(sys.modules)
    for stream in (sys.stdout, sys.stderr):  # nothing buffered is written twice
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    pid = os.fork()
    if pid == 0:  # the server: never returns
        code = 1
        try:
            os.close(req_w)
            os.close(st_r)
            code = _serve(req_r, st_w, launcher, modules)
        except BaseException:  # noqa: BLE001 - the server must never run the launcher's code
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(req_r)
    os.close(st_w)
    os.set_blocking(st_r, False)
    os.set_inheritable(req_w, False)
    os.set_inheritable(st_r, False)
    _server = ForkServer(pid, req_w, st_r, baseline)
    atexit.register(stop_server)
    return _server


def spawn_server(modules: tuple[str, ...] = WORKER_MODULES, env: dict[str, str] | None = None) -> ForkServer:
    """A fork server started as a fresh interpreter (``python -m easgd_lightning.cli.forkserver``),
    for a process that cannot fork one of its own (it has threads or has run torch, e.g. a
    test session). Its ranks are the children of that server, as with :func:`start_server`."""
    req_r, req_w = os.pipe()
    st_r, st_w = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "easgd_lightning.cli.forkserver", str(req_r), str(st_w), str(os.getpid()), *modules],
        pass_fds=(req_r, st_w), env=env, stdin=subprocess.DEVNULL,
    )
    os.close(req_r)
    os.close(st_w)
    os.set_blocking(st_r, False)
    return ForkServer(proc.pid, req_w, st_r, frozenset(), popen=proc)


def imported_since_start() -> list[str]:
    """The modules this process imported after it forked its fork server, in the order they
    were imported (the server imports them the same way before forking ranks, so a rank
    does not import again what validating its config imported here: its data set, its model).
    Empty without a server."""
    if _server is None or _server.owner != os.getpid():
        return []
    return [name for name in list(sys.modules) if name not in _server.baseline]


def current_server() -> ForkServer | None:
    """This process's running fork server, or None (never started here, or gone)."""
    if _server is None or _server.owner != os.getpid() or not _server.alive():
        return None
    return _server


def stop_server() -> None:
    global _server
    if _server is not None and _server.owner == os.getpid():
        _server.close()
    _server = None


# ---------------------------------------------------------------------------- server side
def _serve(requests: int, statuses: int, launcher: int, modules: tuple[str, ...]) -> int:
    """The server's loop: fork ranks on request, report their exits; ends with the launcher."""
    os.setsid()  # a terminal's Ctrl-C reaches the launcher only, which forwards it to the ranks
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != launcher:  # the launcher died before the line above
        return 1
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    for name in modules:
        importlib.import_module(name)
    children: set[int] = set()
    buffer = b""
    open_ = True

    def say(msg: dict) -> None:
        _write_all(statuses, json.dumps(msg).encode() + b"\n")

    while open_ or children:
        ready, _, _ = select.select([requests] if open_ else [], [], [], _POLL_S)
        if ready:
            chunk = os.read(requests, 1 << 20)
            if not chunk:
                open_ = False  # the launcher is done: end once the ranks have (they end with it)
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                msg = json.loads(line)
                _preload(msg.get("preload") or ())
                try:
                    pid = _fork_rank(msg, requests, statuses)
                except Exception as err:  # noqa: BLE001 - told to the launcher, which fails the run
                    say({"op": "error", "id": msg["id"], "error": f"{type(err).__name__}: {err}"})
                    continue
                children.add(pid)
                say({"op": "started", "id": msg["id"], "pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            try:
                say({"op": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})
            except BrokenPipeError:  # the launcher is gone
                pass
    return 0


def _preload(names) -> None:
    """Import ``names`` in order; one that cannot be imported by name (a module some code
    created itself) is left to the rank, which imports what it needs as usual."""
    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001, S112 - an optimisation only
            continue


def _fork_rank(msg: dict, requests: int, statuses: int) -> int:
    server = os.getpid()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the rank: never returns
        os.close(requests)
        os.close(statuses)
        code = _run_rank(msg, server)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        _exit(code)
    return 0  # pragma: no cover


def _run_rank(msg: dict, server: int) -> int:
    """In the forked rank: become what ``python -m easgd_lightning.cli.worker`` would be."""
    os.setsid()
    _set_parent_death_signal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's handlers
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    opened: dict[str, int] = {}  # stdout and stderr to one file share one descriptor (2>&1)
    for fd, key in ((1, "stdout"), (2, "stderr")):  # default: the launcher's
        if msg.get(key):
            if msg[key] not in opened:
                opened[msg[key]] = os.open(msg[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(opened[msg[key]], fd)
    for out in opened.values():
        os.close(out)
    os.chdir(msg["cwd"])
    os.environ.clear()
    os.environ.update(msg["env"])
    os.environ["EASGD_PARENT_PID"] = str(server)  # worker_main: exit if the server is gone already
    sys.argv = list(msg["argv"])
    module, _, function = msg.get("entry", WORKER_ENTRY).partition(":")
    entry = getattr(importlib.import_module(module), function)
    try:
        entry(sys.argv[1:])
    except SystemExit as done:
        return _exit_status(done.code)
    return 0


def _exit_status(code) -> int:
    """What the interpreter would exit with for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """End the rank as the interpreter would: join its threads, run the exit handlers
    (DataLoader workers, loggers), flush, then leave without running the launcher's code."""
    exit_now(code)


if __name__ == "__main__":  # spawn_server: REQUESTS_FD STATUS_FD PARENT_PID MODULE...
    os._exit(_serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), tuple(sys.argv[4:])))
