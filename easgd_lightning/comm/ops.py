"""The one wrapper around ``torch.distributed``: every call is metered.

Strategies and hooks never call ``torch.distributed`` communication functions directly;
they call these. Each function takes a ``kind`` (traffic class for the meter) and, where
a compressor is involved, ``dense_bytes`` (what the uncompressed exchange would cost).
"""

from __future__ import annotations

import atexit
import time

import torch
import torch.distributed as dist

from easgd_lightning.comm.meter import get_meter

__all__ = [
    "nbytes",
    "all_reduce",
    "all_reduce_async",
    "wait",
    "all_gather",
    "all_gather_varlen",
    "all_gather_varlen_async",
    "broadcast",
    "broadcast_control",
    "close_process_group",
    "close_process_group_at_exit",
    "send",
    "recv",
    "isend",
    "irecv",
    "barrier",
    "all_gather_object",
]


def nbytes(*tensors: torch.Tensor) -> int:
    """Payload size of tensors in bytes."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _finish(
    kind: str, start: float, sent: int, recv: int, dense: int | None, exposed: float | None = None
) -> None:
    get_meter().record(
        kind, sent=sent, recv=recv, dense=dense, seconds=time.perf_counter() - start, exposed=exposed
    )


def all_reduce(
    tensor: torch.Tensor,
    *,
    kind: str,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    dense_bytes: int | None = None,
) -> torch.Tensor:
    """In-place all-reduce of ``tensor``; returns it."""
    start = time.perf_counter()
    dist.all_reduce(tensor, op=op, group=group)
    size = nbytes(tensor)
    _finish(kind, start, size, size, dense_bytes)
    return tensor


def all_reduce_async(
    tensor: torch.Tensor,
    *,
    kind: str,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    dense_bytes: int | None = None,
) -> torch.futures.Future:
    """Non-blocking all-reduce. The returned future resolves to ``[tensor]``.

    Bytes and the time from launch to completion are recorded when the future
    completes, with no exposed time: the caller records the time it waits on the future
    (:func:`wait`), so communication hidden behind compute counts in ``time_s`` but not in
    ``exposed_s``.
    """
    start = time.perf_counter()
    size = nbytes(tensor)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    fut = work.get_future()

    def _done(f: torch.futures.Future):
        _finish(kind, start, size, size, dense_bytes, exposed=0.0)
        return f.value()

    return fut.then(_done)


def wait(handle, *, kind: str):
    """Wait for a non-blocking call (a future or a ``Work``), charging the wait to
    ``kind``'s exposed time; returns what the handle's ``wait()`` returns."""
    start = time.perf_counter()
    try:
        return handle.wait()
    finally:
        get_meter().add_exposed(kind, time.perf_counter() - start)


def all_gather(
    tensor: torch.Tensor,
    *,
    kind: str,
    group: dist.ProcessGroup | None = None,
    dense_bytes: int | None = None,
) -> list[torch.Tensor]:
    """All-gather equally shaped tensors; returns one tensor per rank."""
    world = dist.get_world_size(group)
    out = [torch.empty_like(tensor) for _ in range(world)]
    start = time.perf_counter()
    dist.all_gather(out, tensor.contiguous(), group=group)
    size = nbytes(tensor)
    _finish(kind, start, size, size * (world - 1), dense_bytes)
    return out


def all_gather_varlen(
    tensor: torch.Tensor,
    *,
    kind: str,
    group: dist.ProcessGroup | None = None,
    dense_bytes: int | None = None,
) -> list[torch.Tensor]:
    """All-gather 1-D tensors whose lengths differ per rank (sizes first, then padded data).

    Empty tensors are handled (gloo cannot gather zero-length buffers, so the padded length
    is at least one element).
    """
    world = dist.get_world_size(group)
    flat = tensor.reshape(-1)
    length = torch.tensor([flat.numel()], dtype=torch.int64, device=flat.device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    start = time.perf_counter()
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n.item()) for n in lengths]
    padded_len = max(1, max(sizes))
    padded = torch.zeros(padded_len, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded, group=group)
    sent = nbytes(flat) + nbytes(length)
    recv = sum(sizes) * flat.element_size() - nbytes(flat) + nbytes(length) * (world - 1)
    _finish(kind, start, sent, recv, dense_bytes)
    return [o[:n] for o, n in zip(out, sizes)]


def all_gather_varlen_async(
    tensor: torch.Tensor,
    *,
    kind: str,
    group: dist.ProcessGroup | None = None,
    dense_bytes: int | None = None,
) -> torch.futures.Future:
    """Non-blocking :func:`all_gather_varlen`; the future resolves to one tensor per rank.

    The lengths (one integer per rank) are gathered first, blocking: the padded size of
    the data depends on them. The data all-gather then runs in the background; its bytes
    and launch-to-completion time are recorded when it completes, with no exposed time
    (the caller waits with :func:`wait`). Bytes in total equal the blocking call's.
    """
    world = dist.get_world_size(group)
    flat = tensor.reshape(-1)
    length = torch.tensor([flat.numel()], dtype=torch.int64, device=flat.device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    start = time.perf_counter()
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n.item()) for n in lengths]
    header = nbytes(length)
    _finish(kind, start, header, header * (world - 1), dense_bytes)
    padded_len = max(1, max(sizes))
    padded = torch.zeros(padded_len, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    out = [torch.empty_like(padded) for _ in range(world)]
    start = time.perf_counter()
    work = dist.all_gather(out, padded, group=group, async_op=True)
    sent = nbytes(flat)
    recv = sum(sizes) * flat.element_size() - nbytes(flat)

    def _done(f: torch.futures.Future) -> list[torch.Tensor]:
        f.wait()
        _finish(kind, start, sent, recv, 0 if dense_bytes is not None else None, exposed=0.0)
        return [o[:n] for o, n in zip(out, sizes)]

    return work.get_future().then(_done)


def broadcast(
    tensor: torch.Tensor,
    src: int,
    *,
    kind: str,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """In-place broadcast from global rank ``src``."""
    start = time.perf_counter()
    dist.broadcast(tensor, src=src, group=group)
    size = nbytes(tensor)
    is_src = dist.get_rank() == src
    _finish(kind, start, size if is_src else 0, 0 if is_src else size, None if is_src else 0)
    return tensor


def broadcast_control(tensor: torch.Tensor, src: int = 0, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place broadcast of a few control words (e.g. the per-step stop flags); not metered
    as payload, like :func:`all_gather_object`. Errors propagate (a lost peer fails the run)."""
    dist.broadcast(tensor, src=src, group=group)
    return tensor


def send(tensor: torch.Tensor, dst: int, *, kind: str, dense_bytes: int | None = None, tag: int = 0) -> None:
    """Blocking point-to-point send."""
    start = time.perf_counter()
    dist.send(tensor, dst=dst, tag=tag)
    _finish(kind, start, nbytes(tensor), 0, dense_bytes)


def recv(tensor: torch.Tensor, src: int | None = None, *, kind: str, tag: int = 0) -> int:
    """Blocking receive into ``tensor``; ``src=None`` receives from any source (gloo).

    Returns the sender's rank.
    """
    start = time.perf_counter()
    sender = dist.recv(tensor, src=src, tag=tag)
    _finish(kind, start, 0, nbytes(tensor), 0)
    return int(sender)


def isend(tensor: torch.Tensor, dst: int, *, kind: str, dense_bytes: int | None = None, tag: int = 0):
    """Non-blocking send; bytes are recorded at launch, wait time by the caller."""
    get_meter().record(kind, sent=nbytes(tensor), dense=dense_bytes)
    return dist.isend(tensor, dst=dst, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, *, kind: str, tag: int = 0):
    """Non-blocking receive; bytes are recorded at launch, wait time by the caller."""
    get_meter().record(kind, recv=nbytes(tensor), dense=0)
    return dist.irecv(tensor, src=src, tag=tag)


def barrier(group: dist.ProcessGroup | None = None, *, kind: str = "control") -> None:
    start = time.perf_counter()
    dist.barrier(group=group)
    _finish(kind, start, 0, 0, 0)


def all_gather_object(obj, group: dist.ProcessGroup | None = None) -> list:
    """Gather a picklable object from every rank (control traffic, not metered as payload)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def close_process_group() -> None:
    """Destroy the default process group once this rank's last collective is done.

    Left to interpreter shutdown, gloo's worker threads still hold finished work objects
    whose tensors are freed after Python is gone: the rank aborts at exit ("terminate called
    without an active exception", exit -6; 3 of 28 four-rank runs on 10 Mbit/s links,
    issue 14), and a process that dies that way resets its sockets, dropping data its
    peers have not read yet.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


_close_registered = False


def close_process_group_at_exit() -> None:
    """Make :func:`close_process_group` run at interpreter exit (once per process).

    Our strategies call this when they set up the environment, so a user's own script that
    never destroys the process group does not abort at exit the way
    :func:`close_process_group` describes (seen in 2- and 3-rank ``sync_easgd`` runs)."""
    global _close_registered
    if not _close_registered:
        atexit.register(close_process_group)
        _close_registered = True
