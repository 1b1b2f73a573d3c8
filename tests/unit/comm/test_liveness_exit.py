"""The heartbeat thread is never inside a store call when Python finalizes (issue 31 section 8).

A daemon thread that is inside a C++ call with the GIL released when the interpreter
finalizes returns into a finalizing interpreter, which ends the thread from inside the C++
frame: the process aborts ("terminate called without an active exception", exit 134; seen
after every rank of an ``async_sgd`` run had finished). :class:`Liveness` joins its thread at
exit (``atexit``, before finalization). Here the heartbeat's store call blocks in C++ for
1.5 s (``HashStore.wait`` on a key that never comes) and the main thread ends 0.3 s into it:
the call must have returned (``out`` written) before the process ended.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import base_env

PROBE = r'''
import sys, time
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist
from easgd_lightning.comm.liveness import Liveness

log = Path(sys.argv[1])
reader = dist.HashStore()
made = []


class SlowStore:
    def __init__(self):
        self.hs = dist.HashStore()

    def add(self, key, value):
        with log.open("a") as f:
            f.write("in\n")
        try:
            self.hs.wait(["never"], timedelta(seconds=1.5))  # C++, the GIL released
        except Exception:
            pass
        with log.open("a") as f:
            f.write("out\n")
        return 0


def factory():
    made.append(1)
    return reader if len(made) == 1 else SlowStore()


lv = Liveness("probe", 0, interval_s=0.05, store_factory=factory).start()
while not log.exists():
    time.sleep(0.01)
time.sleep(0.3)  # the heartbeat thread is inside the store call now
lv.stop()
'''


def test_the_heartbeat_thread_has_left_its_store_call_before_the_process_ends(tmp_path: Path) -> None:
    script, log = tmp_path / "probe.py", tmp_path / "calls.log"
    script.write_text(PROBE)
    proc = subprocess.run([sys.executable, str(script), str(log)], env=base_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr
    calls = log.read_text().split()
    assert calls[:2] == ["in", "out"], calls  # the call in flight at exit returned first
    assert calls.count("in") == calls.count("out"), calls
