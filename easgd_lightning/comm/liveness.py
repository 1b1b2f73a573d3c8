"""Liveness without hangs: heartbeats, waits that can be given up, and signals that end a
blocked process.

Gloo cannot cancel a receive, and a receive that times out closes every connection of the
process group. So a rank that must wait for a peer that may die never lets the receive time
out: :class:`CancellableWait` waits on a helper thread while the caller checks
:class:`Liveness` (heartbeats every rank posts to the rendezvous store) and gives up when the
peer's heartbeat stops. A rank blocked in such a C++ wait never runs Python's signal
handlers: :class:`SignalWatch` ends it ``grace_s`` after SIGTERM / SIGINT.

A rank the run goes on without (the parameter server drops a dead or frozen worker) is
*declared lost* in the same store (:meth:`Liveness.declare_lost`, key :data:`LOST_KEY`):
the local launcher reads it (:func:`read_lost`), so that rank's death does not fail the run.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from easgd_lightning.utils.atomic import atomic_write_json

log = logging.getLogger(__name__)

__all__ = ["Liveness", "CancellableWait", "SignalWatch", "SIGNAL_GRACE_S", "interruption", "LOST_KEY", "read_lost",
           "RUN_STORE_ENV", "run_store_address", "GONE_KEY", "write_join_record"]

#: a receive must never time out: that closes the process group
LONG_WAIT = timedelta(days=7)
#: the heartbeat thread's store calls give up after this (then retry at the next beat)
HEARTBEAT_STORE_TIMEOUT_S = 3.0
#: how long the exit waits for a heartbeat thread inside a store call (a call never outlasts
#: HEARTBEAT_STORE_TIMEOUT_S with the default store)
HEARTBEAT_JOIN_S = HEARTBEAT_STORE_TIMEOUT_S + 2.0
#: store key of a rank declared lost (one run per store: no run prefix), value JSON
LOST_KEY = "easgd/lost/{rank}"
#: store key of a rank the launcher will not start again (``ft=torchft``: no restart left, or
#: the run is ending), so nobody waits for it to rejoin
GONE_KEY = "easgd/gone/{rank}"


def read_lost(store, ranks) -> dict[int, dict]:
    """The ranks of ``ranks`` declared lost in ``store``: rank -> what the declarer wrote."""
    lost = {}
    for rank in ranks:
        key = LOST_KEY.format(rank=rank)
        try:
            if store.check([key]):
                lost[rank] = json.loads(store.get(key).decode() or "{}")
        except (RuntimeError, ValueError):  # withdrawn in between, or unreadable: not lost
            continue
    return lost


def interruption(signum: int, who: str) -> BaseException:
    """The exception a rank stops with after SIGTERM / SIGINT (Lightning's own for SIGTERM)."""
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
        return KeyboardInterrupt(f"{who}: interrupted by {name}")
    return SIGTERMException(f"{who}: interrupted by {name}")


class Liveness:
    """Heartbeats through the rendezvous store: who is still alive.

    Every rank bumps a counter ``<prefix>/hb/<rank>`` every ``interval_s`` from a daemon
    thread (its own store connection). :meth:`alive` reads another rank's counter and calls
    it dead once the counter has not moved for ``dead_after_s``.

    Args:
        prefix: key prefix shared by the ranks of one run.
        rank: this process's global rank.
        interval_s: heartbeat period.
        dead_after_s: silence after which a rank is declared dead.
        store_factory: returns a new store client (default: a TCPStore client of
            ``MASTER_ADDR:MASTER_PORT``, else the default process group's store).
    """

    def __init__(
        self,
        prefix: str,
        rank: int,
        *,
        interval_s: float = 0.5,
        dead_after_s: float = 30.0,
        store_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.prefix, self.rank = prefix, rank
        self.interval_s, self.dead_after_s = float(interval_s), float(dead_after_s)
        self._factory = store_factory or _default_store
        self._beat_factory = store_factory or _heartbeat_store
        self._reader = self._factory()
        self._seen: dict[int, tuple[int, float, float]] = {}  # rank -> (value, changed_at, read_at)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _key(self, rank: int, what: str = "hb") -> str:
        return f"{self.prefix}/{what}/{rank}"

    def start(self) -> Liveness:
        self._reader.add(self._key(self.rank), 1)
        self._thread = threading.Thread(target=self._beat, name="easgd-heartbeat", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        return self

    def _beat(self) -> None:
        """Bump this rank's counter every ``interval_s`` until :meth:`stop`. A failed call
        (a slow or unreachable store: the default client gives up after
        :data:`HEARTBEAT_STORE_TIMEOUT_S`) is retried on a new connection at the next beat,
        so no store call outlasts that bound and :meth:`close` can wait for the thread."""
        store = None
        while not self._stop.wait(self.interval_s):
            try:
                if store is None:
                    store = self._beat_factory()
                store.add(self._key(self.rank), 1)
            except Exception:  # the store is slow or gone (rank 0 exited): try again next beat
                store = None
                log.debug("heartbeat failed", exc_info=True)

    def stop(self) -> None:
        """Stop beating (the thread ends at its next wake-up; :meth:`close` waits for it)."""
        self._stop.set()

    def close(self, timeout_s: float = HEARTBEAT_JOIN_S) -> None:
        """Stop and wait (up to ``timeout_s``) until the heartbeat thread has ended.

        Runs at interpreter exit (``atexit``, registered by :meth:`start`): a daemon thread
        that is still inside a store call (C++, the GIL released) when Python finalizes
        returns into a finalizing interpreter, which ends the thread from inside the C++
        frame, and the process aborts ("terminate called without an active exception",
        exit 134; issue 31 section 8, ``async_sgd`` 1 run in 3). ``atexit`` runs before
        finalization, so the thread ends while Python can still take it back."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout_s)

    def alive(self, rank: int) -> bool:
        """Whether ``rank`` posted a heartbeat within the last ``dead_after_s`` seconds.

        Raises:
            RuntimeError: the store is unreachable (it lives in rank 0's process).
        """
        now = time.monotonic()
        value, changed, read = self._seen.get(rank, (-1, now, 0.0))
        if now - read >= min(self.interval_s, 0.25):
            try:
                current = int(self._reader.add(self._key(rank), 0))
            except Exception as err:
                raise RuntimeError(
                    f"lost the rendezvous store (it lives in rank 0; did rank 0 die?): {err}"
                ) from err
            if current != value:
                value, changed = current, now
            read = now
        self._seen[rank] = (value, changed, read)
        return now - changed < self.dead_after_s

    def store_client(self):
        """A new client of the store the heartbeats go through (for another thread's use)."""
        return self._factory()

    def mark_done(self) -> None:
        self._reader.set(self._key(self.rank, "done"), "1")

    def is_done(self, rank: int) -> bool:
        return bool(self._reader.check([self._key(rank, "done")]))

    def declare_lost(self, rank: int, info: dict) -> None:
        """Say in the store that the run goes on without ``rank`` (``info``: why, when)."""
        try:
            self._reader.set(LOST_KEY.format(rank=rank), json.dumps(info))
        except Exception as err:  # the store went away: nobody is left to read it
            log.debug("could not declare rank %d lost: %s", rank, err)

    def withdraw_lost(self, rank: int) -> None:
        """``rank`` answered again after :meth:`declare_lost`."""
        try:
            self._reader.delete_key(LOST_KEY.format(rank=rank))
        except Exception as err:
            log.debug("could not withdraw rank %d: %s", rank, err)

    def is_gone(self, rank: int) -> bool:
        """Whether the launcher said it will not start ``rank`` again (:data:`GONE_KEY`)."""
        try:
            return bool(self._reader.check([GONE_KEY.format(rank=rank)]))
        except Exception:  # the store went away: the run is ending, nobody comes back
            return True

    def mark_left(self) -> None:
        """This rank will not read the store again (rank 0, its host, may now exit)."""
        self._reader.set(self._key(self.rank, "left"), "1")

    def has_left(self, rank: int) -> bool:
        return bool(self._reader.check([self._key(rank, "left")]))


#: ``host:port`` of the run's rendezvous store when it is not ``MASTER_ADDR:MASTER_PORT``
#: (a restarted parameter-server worker, whose Lightning world is a private one-process
#: world: :mod:`easgd_lightning.strategies.ps.rejoin`)
RUN_STORE_ENV = "EASGD_RUN_STORE"


def run_store_address() -> tuple[str, int] | None:
    """(host, port) of the run's rendezvous store: ``EASGD_RUN_STORE``, else
    ``MASTER_ADDR``/``MASTER_PORT``; None when neither is set."""
    value = os.environ.get(RUN_STORE_ENV)
    if value:
        host, _, port = value.rpartition(":")
        return host, int(port)
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return (addr, int(port)) if addr and port else None


def _heartbeat_store():
    """The heartbeat thread's own store client: as :func:`_default_store`, with calls that
    give up after :data:`HEARTBEAT_STORE_TIMEOUT_S` (the thread then retries)."""
    address = run_store_address()
    if address:
        return dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=HEARTBEAT_STORE_TIMEOUT_S))
    return _group_store()


def _default_store():
    address = run_store_address()
    if address:
        return dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=30))
    return _group_store()


def _group_store():
    """The default process group's store (imported here: the compat module imports Lightning,
    which a fault-tolerant worker's join record must not wait for)."""
    from easgd_lightning.compat import lightning as compat

    return compat.default_store()


class CancellableWait:
    """Waits for gloo work on a daemon thread, so the caller can check liveness meanwhile."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, threading.Event, dict]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="easgd-wait", daemon=True)
        self._thread.start()
        self.abandoned: list = []  # buffers of receives that may still complete: keep them alive

    def _run(self) -> None:
        while True:
            work, done, box = self._jobs.get()
            try:
                work.wait(LONG_WAIT)
            except BaseException as err:  # handed to the caller
                box["error"] = err
            finally:
                done.set()

    def wait(self, work, keep_waiting: Callable[[], bool], poll_s: float, keep: Any = None) -> bool:
        """True when ``work`` completed; False when ``keep_waiting()`` said to give up.

        A given-up wait leaves this waiter's thread blocked forever (gloo cannot cancel a
        receive): a new thread takes over, and ``keep`` (the receive buffers) is kept alive.
        """
        done, box = threading.Event(), {}
        self._jobs.put((work, done, box))
        while not done.wait(poll_s):
            if not keep_waiting():
                self.abandoned.append((work, keep))
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, name="easgd-wait", daemon=True)
                self._thread.start()
                return False
        if "error" in box:
            raise box["error"]
        return True


#: seconds a rank may take to end by itself after SIGTERM / SIGINT before it is ended
SIGNAL_GRACE_S = 5.0


class SignalWatch:
    """Ends this process when it does not end by itself within ``grace_s`` of SIGTERM/SIGINT.

    Python runs signal handlers on the main thread between bytecodes only, so a rank blocked
    in a gloo wait (C++, the GIL released) never runs them. The C-level handler also writes
    the signal number to the wakeup file descriptor (``signal.set_wakeup_fd``): a daemon
    thread reads it there, calls ``on_signal(signum)`` at once (e.g. to pass the signal on
    to the processes this rank started), waits ``grace_s`` (a rank that is not stuck stops
    at its next batch or request) and then exits the process with ``128 + signum``.
    """

    def __init__(self, who: str, grace_s: float = SIGNAL_GRACE_S,
                 on_signal: Callable[[int], None] | None = None) -> None:
        self.who, self.grace_s, self.on_signal = who, float(grace_s), on_signal
        self._old_fd = -1
        self._fds: tuple[int, int] | None = None

    def start(self) -> bool:
        """Install (main thread only); False when it cannot be installed here."""
        if self._fds is not None:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r)
            os.close(w)
            return False
        self._fds = (r, w)
        threading.Thread(target=self._watch, args=(r,), name="easgd-signal-watch", daemon=True).start()
        return True

    def _watch(self, r: int) -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                return
            if self._old_fd != -1:  # whoever installed a wakeup fd before still hears of it
                try:
                    os.write(self._old_fd, data)
                except OSError:
                    pass
            caught = [b for b in data if b in (signal.SIGTERM, signal.SIGINT)]
            if caught:
                if self.on_signal is not None:
                    try:
                        self.on_signal(caught[0])
                    except Exception:  # passing it on is best effort; ending this rank is not
                        log.debug("on_signal failed", exc_info=True)
                time.sleep(self.grace_s)  # a rank that ends by itself never wakes up here
                name = signal.Signals(caught[0]).name
                print(f"{self.who}: still running {self.grace_s:g} s after {name} (blocked in a wait "
                      f"that Python cannot interrupt); exiting", file=sys.stderr, flush=True)
                os._exit(128 + caught[0])

    def stop(self) -> None:
        """Uninstall (no signal came); the thread ends when the pipe closes."""
        if self._fds is None or threading.current_thread() is not threading.main_thread():
            return
        r, w = self._fds
        try:
            current = signal.set_wakeup_fd(self._old_fd)
            if current != w:  # someone replaced ours meanwhile: keep theirs
                signal.set_wakeup_fd(current)
                return
        except ValueError:
            return
        self._fds = None
        os.close(w)


def write_join_record(run_dir: str, rank: int, attempt: int, info: dict) -> None:
    """A start's join (its first committed or served exchange), for the launcher: one file per
    start (``ranks/ft/rank<R>.attempt<A>.json``: every rejoin reaches the summary, also one of a
    start killed again later) and the rank's latest (``ranks/ft/rank<R>.json``)."""
    record = {"rank": rank, "attempt": attempt, "pid": os.getpid(), **info}
    folder = os.path.join(run_dir, "ranks", "ft")
    atomic_write_json(os.path.join(folder, f"rank{rank}.attempt{attempt}.json"), record)
    atomic_write_json(os.path.join(folder, f"rank{rank}.json"), record)
