"""A launcher of probes through the fork server (tests/distributed/test_forkserver.py).

    python tests/distributed/scripts/forkserver_probe.py OUT_DIR

starts a fork server, has it fork four probes (exit 7, SIGKILL, an exception, one that
sleeps until SIGTERM), waits for the first three, prints their exit codes and the PIDs as
one JSON line, and sleeps: the test then kills this process with SIGKILL.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

ENTRY = "tests.distributed.scripts.forkserver_probe:probe"


def _write(name: str, data: dict) -> None:
    path = Path(os.environ["PROBE_OUT"]) / name
    path.with_suffix(".tmp").write_text(json.dumps(data))
    path.with_suffix(".tmp").rename(path)


def probe(args: list[str]) -> None:
    """A forked 'rank': reports what it was given, then ends as ``args`` says."""
    kind = args[0]
    _write(f"probe-{kind}.json", {
        "pid": os.getpid(), "sid": os.getsid(0), "pgid": os.getpgid(0), "ppid": os.getppid(),
        "stdin": os.readlink("/proc/self/fd/0"), "argv": sys.argv, "cwd": os.getcwd(),
        "mark": os.environ.get("PROBE_MARK"), "parent_env": os.environ.get("EASGD_PARENT_PID"),
        "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    })
    if kind == "exit":  # as an interpreter exit: non-daemon threads joined, atexit handlers run
        atexit.register(_write, "probe-exit-atexit.json", {"ran": True})
        threading.Thread(target=lambda: (time.sleep(0.3), _write("probe-exit-thread.json", {"ran": True}))).start()
        sys.exit(int(args[1]))
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "raise":
        raise RuntimeError("probe failure")
    if kind == "sleep":
        def on_term(signum, _frame):
            _write("probe-sleep-term.json", {"signal": signum, "ppid": os.getppid()})
            os._exit(143)

        signal.signal(signal.SIGTERM, on_term)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.05)


def main() -> None:
    from easgd_lightning.cli import forkserver

    out = sys.argv[1]
    server = forkserver.start_server(modules=())
    assert server is not None
    env = dict(os.environ, PROBE_OUT=out, PROBE_MARK="from-the-launcher")
    procs = {kind: server.start([__file__, kind, *extra], env, out, [], entry=ENTRY)
             for kind, extra in (("exit", ["7"]), ("kill", []), ("raise", []), ("sleep", []))}
    codes = {kind: procs[kind].wait(60) for kind in ("exit", "kill", "raise")}
    print(json.dumps({"codes": codes, "server": server.pid, "launcher": os.getpid(),
                      "pids": {k: p.pid for k, p in procs.items()}}), flush=True)
    time.sleep(120)


if __name__ == "__main__":
    main()
