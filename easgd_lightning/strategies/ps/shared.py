"""Hogwild's shared-memory center: one flat tensor mapped into every worker of a node.

A ``torch`` tensor mapped from one file (``torch.from_file`` with ``shared=True``, in
``/dev/shm`` unless ``shm_dir``), so every worker process of the node reads and writes the
same memory. The CLI starts workers with the ``spawn`` method, each building its own model,
so ``Tensor.share_memory_()`` (which only reaches children of one process) cannot be used:
the strategy has rank 0 create the file, every rank map it after a barrier, and rank 0
unlink it after a second barrier. :class:`SharedMemoryTransport` is the
:class:`CenterTransport` over it: every worker applies its own updates, without a lock.
Traffic is metered as ``kind="shared_memory"`` (bytes read from and written to the center).

Losing a worker: workers never wait for each other while training, so the others go on
untouched (an update the lost worker was writing is at worst half applied, a race Hogwild
accepts by design). Each worker checks the others' heartbeats at its exchanges, at most every
heartbeat interval, and declares one whose heartbeat stopped before it was done lost in the
rendezvous store (:meth:`~easgd_lightning.comm.liveness.Liveness.declare_lost`), as the
parameter server does: the local launcher then ends the run ``ok`` without it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from easgd_lightning.comm import get_meter, ops
from easgd_lightning.comm.liveness import Liveness, interruption
from easgd_lightning.strategies.ps.transport import CenterTransport

log = logging.getLogger(__name__)

__all__ = ["SharedCenter", "SharedMemoryTransport", "default_shm_dir"]


class SharedCenter:
    """A flat tensor backed by one memory-mapped file that several processes map.

    The block holds the ``numel`` entries of the center plus one control entry (the stop
    flag). Reads and writes are plain tensor operations without any lock.

    Args:
        path: the backing file (created by the first opener).
        numel: entries of the center.
        dtype: element type.
    """

    def __init__(self, path: str | Path, numel: int, dtype: torch.dtype) -> None:
        self.path = Path(path)
        self.numel = numel
        self.block = torch.from_file(str(self.path), shared=True, size=numel + 1, dtype=dtype)
        self.center = self.block[:numel]
        self.flag = self.block[numel:]

    def unlink(self) -> None:
        """Remove the file name; existing mappings stay valid."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def default_shm_dir() -> str:
    """``/dev/shm`` when it exists and is writable, else the temporary directory."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


class SharedMemoryTransport(CenterTransport):
    """Worker-side lock-free exchange with the shared center."""

    kind = "shared_memory"

    def __init__(
        self,
        shared: SharedCenter,
        *,
        rank: int,
        world: int,
        alpha: float,
        n_params: int,
        liveness: Liveness,
        stop_policy: str,
        interrupted=None,
    ) -> None:
        self.shared, self.rank, self.world, self.alpha = shared, rank, world, alpha
        self.n_params, self.liveness = n_params, liveness
        self.stop_policy, self.interrupted = stop_policy, interrupted
        self.dead: list[int] = []
        self._watched = time.monotonic()

    def _watch(self) -> None:
        """At most every heartbeat interval: declare lost the others whose heartbeat stopped
        before they were done (module docstring)."""
        if time.monotonic() - self._watched < self.liveness.interval_s:
            return
        self._watched = time.monotonic()
        for r in range(self.world):
            if r != self.rank and r not in self.dead and not self.liveness.alive(r) and not self.liveness.is_done(r):
                self._declare_dead(r)

    def _declare_dead(self, r: int) -> None:
        log.warning("hogwild rank %d: rank %d stopped sending heartbeats; going on without it", self.rank, r)
        self.dead.append(r)
        self.liveness.declare_lost(r, {"rank": r, "at": time.time(), "cause": "heartbeat stopped", "by": self.rank})

    #: the worker's own optimizer steps; its displacement is added to the shared weights
    steps_locally = True

    @property
    def stop(self) -> bool:
        return bool(self.shared.flag[0] > 0)

    def _meter(self, wrote: torch.Tensor | None, read: torch.Tensor | None, start: float) -> None:
        get_meter().record(
            self.kind,
            sent=0 if wrote is None else ops.nbytes(wrote),
            recv=0 if read is None else ops.nbytes(read),
            seconds=time.perf_counter() - start,
        )

    @torch.no_grad()
    def begin_elastic(self, x: torch.Tensor, step: int, lr: float) -> torch.Tensor:
        self._watch()
        start = time.perf_counter()
        center = self.shared.center
        diff = (x - center).mul_(self.alpha)  # racy read of c
        center.add_(diff)  # lock-free write
        self._meter(diff, center, start)
        return diff

    def end_elastic(self, handle: torch.Tensor) -> torch.Tensor:
        return handle

    @torch.no_grad()
    def push_displacement(self, moves: list[torch.Tensor | None], sizes: list[int],
                          buffers: list[torch.Tensor], step: int) -> torch.Tensor:
        """Add each parameter's optimizer displacement to the shared weights (no lock; None:
        not moved, left exactly as it is), overwrite the buffers, read w back."""
        self._watch()
        start = time.perf_counter()
        w = self.shared.center
        offset, sent = 0, 0
        for move, size in zip(moves, sizes):
            if move is not None:
                w[offset : offset + size].add_(move)  # lock-free write
                sent += ops.nbytes(move)
            offset += size
        if buffers:
            flat = torch.cat(buffers)
            w[self.n_params : self.n_params + flat.numel()].copy_(flat)
            sent += ops.nbytes(flat)
        fresh = w.clone()
        get_meter().record(self.kind, sent=sent, recv=ops.nbytes(fresh), seconds=time.perf_counter() - start)
        return fresh

    def pull(self, step: int) -> torch.Tensor:
        start = time.perf_counter()
        center = self.shared.center.clone()
        self._meter(None, center, start)
        return center

    def pull_state(self, step: int) -> dict:
        return {"center": self.pull(step).cpu(), "updates": None, "momentum": None}

    def finish(self, step: int) -> torch.Tensor:
        """Mark this rank done; wait until every other rank is done or dead; read c.

        Rank 0 hosts the rendezvous store, so it leaves last: the others mark that they no
        longer read the store, and rank 0 waits for that (or their death) before it returns.
        """
        self.liveness.mark_done()
        if self.stop_policy == "first":
            self.shared.flag.fill_(1)
        self._wait_until(self.liveness.is_done, "waiting for the other workers")
        if self.rank == 0:
            self._wait_until(self.liveness.has_left, "waiting for the other workers to leave")
        else:
            self.liveness.mark_left()
        return self.pull(step)

    def _wait_until(self, reached: Callable[[int], bool], doing: str) -> None:
        """Poll every other rank until ``reached(rank)`` or its heartbeat stops (then it is
        recorded dead); a signal to this process ends the wait."""
        pending = [r for r in range(self.world) if r != self.rank and r not in self.dead]
        while pending:
            signum = self.interrupted() if self.interrupted is not None else None
            if signum:
                raise interruption(signum, f"rank {self.rank} {doing}")
            still = []
            for r in pending:
                if reached(r):
                    continue
                if not self.liveness.alive(r):
                    self._declare_dead(r)
                    continue
                still.append(r)
            pending = still
            if pending:
                time.sleep(0.05)

