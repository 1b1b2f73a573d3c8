"""bench/_netem.py's ``comm_first``: a live process's main thread at ``compute_nice``, its
other threads (those started before and after) at 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench._netem import EmulatedCluster, LinkSpec

#: a process whose main thread starts a thread, says so, and starts another when told
CHILD = """
import sys, threading, time
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()
print("one", flush=True)
sys.stdin.readline()
threading.Thread(target=stop.wait, daemon=True).start()
print("two", flush=True)
time.sleep(60)
"""


def _nices(pid: int) -> dict[int, int]:
    return {int(t): os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def test_main_thread_yields_to_every_other_thread():
    if os.geteuid() != 0:
        pytest.skip("raising a thread's priority back to nice 0 needs root (CAP_SYS_NICE)")
    net = EmulatedCluster(1, LinkSpec(10.0, 0.0), compute_nice=7)  # never brought up: no namespaces
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "one"
        net.comm_first([child])
        nices = _nices(child.pid)
        assert len(nices) == 2 and nices[child.pid] == 7 and set(nices.values()) == {7, 0}
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "two"
        assert sorted(_nices(child.pid).values()) == [0, 7, 7]  # the new thread inherited the main's nice
        net.comm_first([child])  # the harness's next poll
        assert sorted(_nices(child.pid).values()) == [0, 0, 7]
        assert _nices(child.pid)[child.pid] == 7
    finally:
        child.kill()
        child.wait()
    net.comm_first([child])  # a process gone meanwhile is skipped


def test_off_leaves_every_thread_alone_and_the_value_is_checked():
    net = EmulatedCluster(1, LinkSpec(10.0, 0.0))
    assert net.compute_nice == 0
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child.stdout.readline()
        net.comm_first([child])
        assert set(_nices(child.pid).values()) == {os.getpriority(os.PRIO_PROCESS, 0)}
    finally:
        child.kill()
        child.wait()
    with pytest.raises(ValueError, match="--compute-nice"):
        EmulatedCluster(1, LinkSpec(10.0, 0.0), compute_nice=20)
