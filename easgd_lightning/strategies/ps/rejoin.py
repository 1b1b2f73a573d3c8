"""Re-admission of a restarted worker by the parameter server (``ft=torchft`` for the
parameter-server family; README "Losing a worker").

Rule. A worker process the launcher restarted (its start count, ``attempt``, > 0) joins no
world-wide process group -- the running ranks never make one again. Lightning sees a private
world of one process (:func:`prepare_late_start`), and the worker reaches the server over a
two-process gloo group of its own (:func:`easgd_lightning.comm.ops.pair_group`), made over
the run's rendezvous store:

1. at set-up the server publishes the session in the store (:data:`SESSION_KEY`: the
   heartbeat prefix, its rank, the number of processes);
2. the restarted worker starts its heartbeat under that prefix, writes its join request
   (:func:`join_key`: its attempt), bumps :data:`JOINS_KEY` and makes its end (index 0) of
   the pair group under :func:`channel_prefix` (:func:`request_admission`);
3. the server's :class:`Admissions` thread sees the counter move, makes the server's end
   (index 1) of every new request's group and hands it to the serving loop, which drops the
   worker's old process if it still held it, serves the new one from then on and withdraws
   the "lost" declaration (:class:`~easgd_lightning.strategies.ps.server.ParameterServer`);
4. the worker's first request is ``OP_STATE``: the centre and the server's state (update
   counts, the step of this worker's last served request). It starts from the centre (a
   fresh explorer) with a fresh optimizer state; compression replicas are reset at both
   ends in that same request.

Every wait is bounded: the session by ``timeout_s``, a pair group's rendezvous by the run's
process-group timeout.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from easgd_lightning.comm import ops
from easgd_lightning.comm.liveness import RUN_STORE_ENV, run_store_address

log = logging.getLogger(__name__)

__all__ = [
    "SESSION_KEY", "JOINS_KEY", "join_key", "channel_prefix", "run_store", "publish_session", "read_session",
    "request_admission", "Join", "Admissions", "LateStart", "prepare_late_start",
]

#: the server's session (JSON: ``prefix``, ``server``, ``world``); one run per store
SESSION_KEY = "easgd/ps/session"
#: a counter bumped after every join request (the server polls this one key)
JOINS_KEY = "easgd/ps/joins"


def join_key(rank: int) -> str:
    """Store key of worker ``rank``'s join request (value: its attempt)."""
    return f"easgd/ps/join/{rank}"


def channel_prefix(rank: int, attempt: int) -> str:
    """Store prefix of the pair group of worker ``rank``'s start ``attempt``."""
    return f"easgd/ps/channel/{rank}/{attempt}/"


def run_store(timeout_s: float):
    """A client of the run's rendezvous store (``EASGD_RUN_STORE`` for a restarted worker)."""
    from torch.distributed import TCPStore

    host, port = run_store_address()
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def publish_session(store, prefix: str, server: int, world: int) -> None:
    """Server, at set-up: say where restarted workers find the run."""
    store.set(SESSION_KEY, json.dumps({"prefix": prefix, "server": server, "world": world}))


def read_session(store, timeout_s: float) -> dict:
    """A restarted worker: the session the server published (waits up to ``timeout_s``).

    Raises:
        RuntimeError: nothing published in time (the server never reached its set-up).
    """
    try:
        store.wait([SESSION_KEY], timedelta(seconds=timeout_s))
    except Exception as err:  # the store's own timeout error
        raise RuntimeError(f"no parameter-server session in the run's store after {timeout_s:g}s: {err}") from err
    return json.loads(store.get(SESSION_KEY).decode())


def request_admission(store, rank: int, attempt: int, timeout: timedelta):
    """A restarted worker: ask to be admitted and make its end of the pair group (blocks
    until the server makes its end; RuntimeError after ``timeout``)."""
    store.set(join_key(rank), str(attempt))
    store.add(JOINS_KEY, 1)
    return ops.pair_group(store, channel_prefix(rank, attempt), 0, timeout)


@dataclass
class Join:
    """A restarted worker's new channel, ready to serve."""

    rank: int
    attempt: int
    group: Any
    at: float = field(default_factory=time.time)


class Admissions:
    """The server's admission thread: polls :data:`JOINS_KEY` every ``poll_s``; for each
    request newer than the last one admitted for that worker, makes the server's end of
    its pair group (on a thread of its own: a joiner that died meanwhile costs only that
    thread its ``timeout``) and calls ``on_join(Join)``.

    Args:
        store_factory: returns a new client of the run's store (one per thread).
        workers: the worker ranks that may rejoin.
        timeout: the pair groups' timeout (a ``timedelta``).
        on_join: called (from a helper thread) with each new channel.
    """

    def __init__(self, store_factory: Callable[[], Any], workers: list[int], timeout: timedelta,
                 on_join: Callable[[Join], None], poll_s: float = 0.1) -> None:
        self._factory, self.workers, self.timeout = store_factory, list(workers), timeout
        self.on_join, self.poll_s = on_join, float(poll_s)
        self._admitted: dict[int, int] = {}  # rank -> the newest attempt seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="easgd-ps-admissions", daemon=True)

    def start(self) -> Admissions:
        self._thread.start()
        return self

    def stop(self) -> None:
        """No more admissions (a channel being made is not handed over any more)."""
        self._stop.set()

    def _run(self) -> None:
        store, seen = None, 0
        while not self._stop.wait(self.poll_s):
            try:
                store = store or self._factory()
                count = int(store.add(JOINS_KEY, 0))
                if count == seen:
                    continue
                seen = count
                for rank, attempt in self._new_requests(store):
                    threading.Thread(target=self._connect, args=(rank, attempt), daemon=True,
                                     name=f"easgd-ps-admit-{rank}").start()
            except Exception:  # the store is slow or gone (the run ends): try again
                store = None
                log.debug("admission poll failed", exc_info=True)

    def _new_requests(self, store) -> list[tuple[int, int]]:
        new = []
        for rank in self.workers:
            key = join_key(rank)
            if not store.check([key]):
                continue
            attempt = int(store.get(key).decode())
            if attempt > self._admitted.get(rank, 0):
                self._admitted[rank] = attempt
                new.append((rank, attempt))
        return new

    def _connect(self, rank: int, attempt: int) -> None:
        try:
            group = ops.pair_group(self._factory(), channel_prefix(rank, attempt), 1, self.timeout)
        except Exception as err:  # the joiner died before it made its end
            log.warning("parameter server: worker %d (start %d) asked to rejoin but never connected: %s",
                        rank, attempt, err)
            return
        if not self._stop.is_set():
            self.on_join(Join(rank, attempt, group))


@dataclass
class LateStart:
    """A restarted worker's identity: its rank and the run's number of processes (Lightning
    sees a world of one), which start it is, where the run lives."""

    rank: int
    world: int
    attempt: int
    run_dir: str
    store: Any = None  # the private one-process world's store (kept alive with this object)
    started: float = field(default_factory=time.time)

    def mark_joined(self, info: dict) -> None:
        """Tell the launcher this start has been served (the file ``ft/launch.py`` reads)."""
        from easgd_lightning.comm.liveness import write_join_record

        write_join_record(self.run_dir, self.rank, self.attempt, {"started_at": self.started, "healed": True, **info})


def prepare_late_start(cfg: Any, run_dir: str, attempt: int) -> LateStart | None:
    """A restarted worker (``attempt`` > 0): give Lightning a private world of one process
    (a store of its own, ``RANK=0``, ``WORLD_SIZE=1``), keep the run's store reachable for
    heartbeats and admission (``EASGD_RUN_STORE``), no logger (its first start's log is
    kept). None on a first start (nothing changes)."""
    if attempt <= 0:
        return None
    from torch.distributed import TCPStore

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ[RUN_STORE_ENV] = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    timeout = timedelta(seconds=float(cfg.get("timeout_s", 300)))
    store = TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
    cfg.trainer.devices = 1
    cfg.logger.name = "none"
    return LateStart(rank=rank, world=world, attempt=attempt, run_dir=str(run_dir), store=store)
