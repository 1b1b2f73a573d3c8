"""torchft runs here: a real lighthouse, two replica groups (one process each) with a
torchft ``Manager`` and ``ProcessGroupGloo`` on CPU, a quorum and an all-reduce per step;
one replica is SIGKILLed and the other goes on alone, committing its steps.

This is the measurement issue 27 asks for before anything is built on torchft (the engine
of ``ft=torchft``, easgd_lightning/ft/): if torchft cannot run on this torch / gloo, this
test says so first.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, base_env, wait_until

torchft = pytest.importorskip("torchft")

SCRIPT = REPO / "tests" / "distributed" / "scripts" / "torchft_replica.py"


def _lines(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def test_quorum_allreduce_and_one_replica_killed(tmp_path):
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=2000,
                                  heartbeat_timeout_ms=1000)
    address = lighthouse.address().replace(socket.gethostname(), "127.0.0.1")  # it is bound there
    procs = []
    try:
        outs = [tmp_path / f"r{i}.jsonl" for i in range(2)]
        for i in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, str(SCRIPT), address, str(i), "400", str(outs[i])],
                env=base_env(), stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"r{i}.err", "w"),
                start_new_session=True))
        # both in one quorum: 1 + 2 = 3, committed
        wait_until(lambda: sum(1 for r in _lines(outs[0]) if r["participants"] == 2 and r["committed"]) >= 3,
                  90, "three committed two-replica steps")
        together = [r for r in _lines(outs[0]) if r["participants"] == 2 and r["committed"]]
        assert all(r["sum"] == 3.0 for r in together), together
        assert any(r["participants"] == 2 and r["sum"] == 3.0 for r in _lines(outs[1]))
        os.killpg(procs[1].pid, signal.SIGKILL)
        procs[1].wait(timeout=10)
        killed_at = time.time()
        # replica 0 goes on alone: quorum of one, its own value, committed
        wait_until(lambda: sum(1 for r in _lines(outs[0]) if r["t"] > killed_at and r["participants"] == 1
                              and r["committed"]) >= 3, 60, "three committed one-replica steps after the kill")
        after = [r for r in _lines(outs[0]) if r["t"] > killed_at]
        alone = [r for r in after if r["participants"] == 1 and r["committed"]]
        assert all(r["sum"] == 1.0 for r in alone), alone
        # the manager's step counts commits only: +1 per committed step, +0 otherwise (a
        # replica that started late may first heal, its step jumping to its peer's)
        rows = _lines(outs[0])
        for prev, row in zip(rows, rows[1:]):
            assert row["manager_step"] - prev["manager_step"] == int(row["committed"]), (prev, row)
        assert procs[0].poll() is None, "the surviving replica died"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        lighthouse.shutdown()
