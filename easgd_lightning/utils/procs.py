"""Process helpers shared by the launcher's fork server, the emulated cluster and the local
SLURM script: whether a PID is alive, and a block during which stop signals wait."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

__all__ = ["pid_alive", "stop_signals_held"]


def pid_alive(pid: int) -> bool:
    """True while a process with this PID exists (also one owned by another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP are blocked inside the block and delivered after it, so a
    second Ctrl-C cannot cut a clean-up short."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
