"""A stop signal ends a wait inside :func:`easgd_lightning.utils.stop.interruptible` at once
(a fault-tolerant worker's quorum wait, whose peers got the same signal and left), also a
stop requested before the block; the flag alone leaves a wait running to its end.

Each case runs in a fresh interpreter (the handlers and the stop flag are process-wide).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import base_env

PROBE = r'''
import os, signal, sys, threading
from easgd_lightning.utils import stop

class Stopped(Exception):
    pass

stop.install_stop_handlers(60.0)
mode = sys.argv[1]
if mode == "before":
    stop.request_stop(signal.SIGTERM)
else:
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
try:
    if mode == "flag":
        threading.Event().wait(1.0)  # the flag only: the wait runs to its end
    else:
        with stop.interruptible(Stopped):
            threading.Event().wait()  # never ends by itself: only the signal can end it
    print("waited", stop.stop_signal())
except Stopped:
    print("stopped", stop.stop_signal())
os._exit(0)  # not the 60 s stop deadline
'''


def _probe(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=base_env(), capture_output=True, text=True,
                         timeout=60)  # a wait that was not interrupted never ends: TimeoutExpired
    assert out.returncode == 0, out.stderr[-2000:]
    what, signum = out.stdout.split()
    return what, int(signum)


@pytest.mark.parametrize("mode", ["signal", "before", "flag"])
def test_interruptible_wait_ends_on_a_stop_signal(mode: str) -> None:
    what, signum = _probe(mode)
    assert signum == 15  # the flag is set in every case
    assert what == ("waited" if mode == "flag" else "stopped")
