"""The fork server's contract (cli/forkserver.py), with probes instead of ranks: each forked
process is in its own session, reads /dev/null, has the launcher's environment, working
directory and argv, a fresh interpreter's signal handlers, and ends as an interpreter does
(threads joined, atexit handlers run); exit codes and signals reach the launcher as
``Popen.returncode`` would; when the launcher is killed, the server dies and every forked
process gets SIGTERM (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.helpers import PY, REPO, base_env
from tests.helpers import pid_alive as _alive

SCRIPT = Path(__file__).parent / "scripts" / "forkserver_probe.py"
PROBE_ENTRY = "tests.distributed.scripts.forkserver_probe:probe"


def _wait_for(path: Path, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} did not appear"
        time.sleep(0.05)
    return json.loads(path.read_text())


def test_forked_ranks_keep_the_contract_of_spawned_ones(tmp_path: Path) -> None:
    launcher = subprocess.Popen([PY, str(SCRIPT), str(tmp_path)], env=base_env(), cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = launcher.stdout.readline()
        assert line, launcher.stderr.read()[-3000:] if launcher.poll() is not None else "no output"
        seen = json.loads(line)
        assert seen["codes"] == {"exit": 7, "kill": -signal.SIGKILL, "raise": 1}
        server = seen["server"]
        for kind in ("exit", "kill", "raise", "sleep"):
            info = _wait_for(tmp_path / f"probe-{kind}.json")
            assert info["pid"] == seen["pids"][kind]
            assert info["sid"] == info["pgid"] == info["pid"]  # its own session
            assert info["ppid"] == server and info["parent_env"] == str(server)
            assert info["stdin"] == "/dev/null"
            assert info["argv"] == [str(SCRIPT), kind, *(["7"] if kind == "exit" else [])]
            assert info["cwd"] == str(tmp_path) and info["mark"] == "from-the-launcher"
            assert info["sigint_default"] and info["sigterm_default"]
        assert _wait_for(tmp_path / "probe-exit-thread.json")["ran"]
        assert _wait_for(tmp_path / "probe-exit-atexit.json")["ran"]
        assert os.getsid(server) == server != os.getsid(launcher.pid)  # not in the launcher's session
        sleeper = seen["pids"]["sleep"]
        assert _alive(sleeper)
        launcher.kill()  # SIGKILL: no cleanup of its own
        launcher.wait(timeout=30)
        term = _wait_for(tmp_path / "probe-sleep-term.json")
        assert term["signal"] == signal.SIGTERM
        deadline = time.monotonic() + 30
        while (_alive(server) or _alive(sleeper)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server) and not _alive(sleeper)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)


def test_a_spawned_server_forks_ranks_for_a_process_that_cannot_fork_one(tmp_path: Path) -> None:
    """``spawn_server`` (the test session's servers, tests/helpers.py): a fresh interpreter
    whose forked processes keep the same contract, write to the files they are given, get
    signals through ``send_signal``, and report their exit codes; ``close`` ends it."""
    from easgd_lightning.cli import forkserver

    server = forkserver.spawn_server(modules=(), env=base_env())
    try:
        env = base_env(PROBE_OUT=str(tmp_path), PROBE_MARK="from-the-launcher")
        out, err = tmp_path / "raise.out", tmp_path / "raise.err"
        failing = server.start([str(SCRIPT), "raise"], env, str(tmp_path), [], entry=PROBE_ENTRY,
                               stdout=str(out), stderr=str(err))
        sleeper = server.start([str(SCRIPT), "sleep"], env, str(tmp_path), [], entry=PROBE_ENTRY)
        assert failing.wait(60) == 1
        assert "RuntimeError: probe failure" in err.read_text() and out.read_text() == ""
        info = _wait_for(tmp_path / "probe-raise.json")
        assert info["ppid"] == server.pid and info["sid"] == info["pid"] == failing.pid
        assert info["cwd"] == str(tmp_path) and info["mark"] == "from-the-launcher"
        assert os.getsid(server.pid) == server.pid != os.getsid(0)
        _wait_for(tmp_path / "probe-sleep.json")  # its SIGTERM handler is installed right after
        time.sleep(1.0)
        sleeper.send_signal(signal.SIGTERM)
        assert sleeper.wait(60) == 143
        assert _wait_for(tmp_path / "probe-sleep-term.json")["signal"] == signal.SIGTERM
        sleeper.kill()  # already ended: nothing to do
    finally:
        server.close()
    assert not server.alive() and not _alive(server.pid)
