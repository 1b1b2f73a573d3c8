"""A worker's stop request: SIGTERM / SIGINT / SIGHUP only set a flag.

A signal handler that runs collectives (as Lightning's own SIGTERM handler does) can
deadlock against ranks that never join, so here a signal is just recorded; the training
loop acts on it at the next step boundary (``easgd_lightning.callbacks.SignalStop``).
A hard deadline bounds the graceful stop: ``grace_s`` seconds after the first signal
the process ends itself with ``os._exit(128 + signal)``, whatever it was doing.

A wait that may never end when the peers stop (a fault-tolerant worker's quorum, whose
peers got the same signal and left) runs inside :func:`interruptible`: there a stop
signal also raises at once, ending the wait (a lock wait in the main thread is
interrupted by a signal), instead of waiting out the grace.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["install_stop_handlers", "stop_signal", "request_stop", "exit_code_for", "grace_s", "interruptible",
           "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_state: dict = {"signal": None, "grace_s": 30.0, "timer": None, "raise": None}


def grace_s() -> float:
    """Seconds a graceful stop may take: ``EASGD_STOP_GRACE_S`` (set by the launcher), default 30."""
    try:
        return float(os.environ.get("EASGD_STOP_GRACE_S", "30"))
    except ValueError:
        return 30.0


def stop_signal() -> int | None:
    """The first stop signal this process received (a number), or None."""
    return _state["signal"]


def exit_code_for(signum: int) -> int:
    """The shell convention for "ended by signal N": 128 + N (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


def request_stop(signum: int) -> None:
    """Record ``signum`` (the first one wins) and arm the hard deadline."""
    if _state["signal"] is not None:
        return
    _state["signal"] = int(signum)
    timer = threading.Timer(_state["grace_s"], os._exit, args=(exit_code_for(signum),))
    timer.daemon = True
    timer.start()
    _state["timer"] = timer


def _handler(signum, _frame) -> None:
    request_stop(signum)
    if _state["raise"] is not None:  # inside interruptible(): end the wait now
        raise _state["raise"]()


@contextmanager
def interruptible(error: Callable[[], BaseException]) -> Iterator[None]:
    """Inside the block a stop signal raises ``error()`` in the main thread (besides setting
    the flag); a stop requested before the block raises on entry. Not reentrant."""
    if _state["signal"] is not None:
        raise error()
    _state["raise"] = error
    try:
        yield
    finally:
        _state["raise"] = None


def install_stop_handlers(grace_s: float = 30.0) -> None:
    """Route SIGTERM, SIGINT and SIGHUP to the stop flag (main thread only)."""
    _state["grace_s"] = float(grace_s)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handler)
