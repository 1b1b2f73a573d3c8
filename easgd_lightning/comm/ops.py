"""The one wrapper around ``torch.distributed``: every call is metered.

Strategies and hooks never call ``torch.distributed`` communication functions directly;
they call these. Each function takes a ``kind`` (traffic class for the meter) and, where
a compressor is involved, ``dense_bytes`` (what the uncompressed exchange would cost).

``group`` may also be a :class:`~easgd_lightning.comm.managed.ManagedGroup` (``ft=torchft``:
this step's quorum of a torchft Manager) for the collectives a compressed DDP hook uses
(:func:`all_reduce`, :func:`all_reduce_async`, :func:`all_gather_varlen_async`,
:func:`all_to_all`, :func:`group_size`, :func:`group_rank`): the same messages, run on the
quorum, and a failed one completes with a stand-in while the step is marked not to commit.
"""

from __future__ import annotations

import atexit
import time

import torch
import torch.distributed as dist

from easgd_lightning.comm.managed import ManagedGroup
from easgd_lightning.comm.meter import get_meter
from easgd_lightning.utils.procs import freeze_at_exit

__all__ = [
    "nbytes",
    "group_size",
    "group_rank",
    "group_backend",
    "all_reduce",
    "all_reduce_async",
    "comm_time",
    "wait_launched",
    "wait",
    "all_gather",
    "all_gather_varlen",
    "all_gather_varlen_async",
    "all_to_all",
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
    "new_group",
    "pair_group",
]


def nbytes(*tensors: torch.Tensor) -> int:
    """Payload size of tensors in bytes."""
    return sum(t.numel() * t.element_size() for t in tensors)


def group_size(group=None) -> int:
    """Members of ``group`` (None: the default group; a managed group: this step's quorum)."""
    return group.size() if isinstance(group, ManagedGroup) else dist.get_world_size(group)


def group_rank(group=None) -> int:
    """This process's rank in ``group`` (as :func:`group_size`)."""
    return group.rank() if isinstance(group, ManagedGroup) else dist.get_rank(group)


def group_backend(group=None) -> str:
    """``group``'s backend (``gloo``, ``nccl``; a managed group: its torchft group's)."""
    return group.backend() if isinstance(group, ManagedGroup) else dist.get_backend(group)


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
    if isinstance(group, ManagedGroup):
        group.all_reduce(tensor, op).wait()
    else:
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
    if isinstance(group, ManagedGroup):
        fut = group.all_reduce(tensor, op)
    else:
        fut = dist.all_reduce(tensor, op=op, group=group, async_op=True).get_future()

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


def comm_time(kind: str) -> float:
    """The meter's communication time of ``kind`` so far (:func:`wait_launched`'s mark)."""
    return get_meter().by_kind[kind].time_s


def wait_launched(handles, *, kind: str, since: float) -> None:
    """Wait for non-blocking calls of ``kind`` launched after the meter's :func:`comm_time`
    read ``since``, charging the wait as exposed time -- but never more than the
    communication they took (``comm_time(kind) - since`` once they completed): what the
    wait lasts beyond their completion is the waiting thread's wake-up on a loaded machine,
    not communication (the meter's contract, ``exposed_s <= time_s``)."""
    start = time.perf_counter()
    try:
        for handle in handles:
            handle.wait()
    finally:
        waited = time.perf_counter() - start
        get_meter().add_exposed(kind, min(waited, max(0.0, comm_time(kind) - since)))


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


#: bytes of each part's length in the header of an all-gathered variable-length message
VARLEN_HEADER = 8


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def next_capacity(capacity: int, largest: int) -> int:
    """The message capacity (bytes) after an all-gather whose largest message was
    ``largest``: 1.25x it (a multiple of 64) when it outgrew the capacity or fell under half
    of it, else unchanged. Every rank sees the same lengths, so every rank agrees on it."""
    if largest > capacity or 2 * largest < capacity:
        return _round_up(largest + largest // 4, 64)
    return capacity


def _slot_buffer(slot: dict, name: str, nbytes: int) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` kept in ``slot`` (reallocated when the size changes)."""
    buf = slot.get(name)
    if buf is None or buf.numel() != nbytes:
        buf = slot[name] = torch.empty(nbytes, dtype=torch.uint8)
    return buf


def _split_body(body: torch.Tensor, lengths: list[int], dtypes: list) -> list[torch.Tensor]:
    """The parts of one rank's message body (each starts on an 8-byte boundary)."""
    parts, offset = [], 0
    for n, dtype in zip(lengths, dtypes):
        parts.append(body[offset : offset + n].view(dtype))
        offset += _round_up(n, 8)
    return parts


class VarlenGather:
    """A variable-length all-gather in flight (:func:`all_gather_varlen_async`);
    :meth:`wait` returns, per rank, the list of its parts."""

    def __init__(self, fut, tail: torch.Tensor, dtypes: list, slot: dict, kind: str, group) -> None:
        self._fut, self._tail, self._dtypes = fut, tail, dtypes
        self._slot, self._kind, self._group = slot, kind, group

    def wait(self) -> list[list[torch.Tensor]]:
        rows, lengths = self._fut.wait()
        head = VARLEN_HEADER * len(self._dtypes)
        bodies = [sum(_round_up(n, 8) for n in per_rank) for per_rank in lengths]
        cap = int(self._slot.get("cap", 0))
        largest = max(bodies)
        received = [row[head : head + min(b, cap)] for row, b in zip(rows, bodies)]
        if largest > cap:  # a message outgrew the capacity: its tail follows in a second round
            tail = torch.zeros(largest - cap, dtype=torch.uint8)
            tail[: self._tail.numel()] = self._tail
            tails = [torch.empty_like(tail) for _ in rows]
            start = time.perf_counter()
            if isinstance(self._group, ManagedGroup):
                self._group.all_gather(tails, tail).wait()
            else:
                dist.all_gather(tails, tail, group=self._group)
            # bytes were counted with the first round; the wait is charged by ops.wait
            _finish(self._kind, start, 0, 0, 0, exposed=0.0)
            received = [
                torch.cat([r, t[: b - cap]]) if b > cap else r
                for r, t, b in zip(received, tails, bodies)
            ]
        self._slot["cap"] = next_capacity(cap, largest)
        return [_split_body(r, n, self._dtypes) for r, n in zip(received, lengths)]


def all_gather_varlen_async(
    tensors: list[torch.Tensor],
    *,
    kind: str,
    group: dist.ProcessGroup | None = None,
    dense_bytes: int | None = None,
    slot: dict | None = None,
) -> VarlenGather:
    """Non-blocking all-gather of tensors whose lengths differ per rank (flattened; the
    same number and dtypes on every rank), all in one message per rank.

    Every rank sends a message of the same size: a header with each part's length in bytes
    (8 bytes each), then the parts (each padded to 8 bytes), padded to the capacity
    ``slot["cap"]`` (0 at first). A message longer than the capacity sends the rest in a
    second all-gather at :meth:`VarlenGather.wait`; the capacity then becomes
    :func:`next_capacity` of the longest message, the same on every rank. So a caller that
    keeps ``slot`` (a dict per exchanged tensor) between calls pays one round trip per
    call once the capacity fits, not a gather of the lengths before the data. The send and
    receive buffers live in ``slot`` too: one call per slot in flight at a time, and the
    returned tensors are valid until the slot's next call.

    Metered when the first round completes (the caller waits with :func:`wait`): bytes
    sent = header + data, received = the other ranks' headers + data (padding is not
    payload), ``dense_bytes`` as given, no exposed time.
    """
    world = group_size(group)
    slot = {} if slot is None else slot
    flats = [t.reshape(-1).contiguous() for t in tensors]
    datas = [f.view(torch.uint8) for f in flats]
    head = VARLEN_HEADER * len(datas)
    cap = int(slot.get("cap", 0))
    size = head + cap
    send = _slot_buffer(slot, "send", size)
    send[:head].view(torch.int64).copy_(torch.tensor([d.numel() for d in datas], dtype=torch.int64))
    body_len = sum(_round_up(d.numel(), 8) for d in datas)
    # what does not fit goes to the tail (a buffer of its own: the inputs may change after
    # the launch), sent at wait() in a second round
    tail = _slot_buffer(slot, "tail", max(0, body_len - cap))
    offset = 0
    for d in datas:
        fit = max(0, min(d.numel(), cap - offset))
        send[head + offset : head + offset + fit] = d[:fit]
        start_in_tail = max(0, offset - cap)
        tail[start_in_tail : start_in_tail + d.numel() - fit] = d[fit:]
        offset += _round_up(d.numel(), 8)
    rows = list(_slot_buffer(slot, "recv", world * size).view(world, size))
    start = time.perf_counter()
    if isinstance(group, ManagedGroup):
        fut = group.all_gather(rows, send)
    else:
        fut = dist.all_gather(rows, send, group=group, async_op=True).get_future()
    sent = head + sum(d.numel() for d in datas)

    def _done(f: torch.futures.Future) -> tuple[list[torch.Tensor], list[list[int]]]:
        f.wait()
        lengths = torch.stack([r[:head] for r in rows]).view(torch.int64).tolist()
        recv = sum(map(sum, lengths)) + head * world - sent
        _finish(kind, start, sent, recv, dense_bytes, exposed=0.0)
        return rows, lengths

    dtypes = [f.dtype for f in flats]
    return VarlenGather(fut.then(_done), tail, dtypes, slot, kind, group)


def all_gather_varlen(tensors: list[torch.Tensor], *, kind: str, **options) -> list[list[torch.Tensor]]:
    """Blocking :func:`all_gather_varlen_async` (same options): per rank, its parts."""
    return wait(all_gather_varlen_async(tensors, kind=kind, **options), kind=kind)


def all_to_all(
    sends: list[torch.Tensor],
    *,
    kind: str,
    group: dist.ProcessGroup | None = None,
    dense_bytes: int | None = None,
) -> list[torch.Tensor]:
    """Personalized exchange: ``sends[j]`` (1-D, one dtype for all, lengths free) goes to
    rank j; returns, per source rank i, what i sent here (this rank's own piece is its
    input, which never leaves the rank).

    Two rounds: the lengths (one int64 per pair, a small ``all_to_all_single``), then the
    data (``all_to_all_single`` with uneven splits). Metered as one message per round:
    bytes sent = the pieces for the other ranks, received = the pieces from them,
    ``dense_bytes`` on the data round; the lengths round counts no bytes (as the second
    round of :func:`all_gather_varlen_async`). A world of one moves nothing.
    """
    world = group_size(group)
    rank = group_rank(group)
    flats = [t.reshape(-1).contiguous() for t in sends]
    if len(flats) != world:
        raise ValueError(f"all_to_all needs one tensor per rank ({world}), got {len(flats)}")
    if world == 1:
        _finish(kind, time.perf_counter(), 0, 0, dense_bytes)
        return flats
    start = time.perf_counter()
    device = flats[0].device
    lengths = torch.tensor([f.numel() for f in flats], dtype=torch.int64, device=device)
    incoming = torch.empty(world, dtype=torch.int64, device=device)
    _all_to_all_single(incoming, lengths, None, None, group)
    _finish(kind, start, 0, 0, 0)
    counts_in, counts_out = incoming.tolist(), lengths.tolist()
    out = torch.empty(sum(counts_in), dtype=flats[0].dtype, device=device)
    start = time.perf_counter()
    _all_to_all_single(out, torch.cat(flats), counts_in, counts_out, group)
    size = flats[0].element_size()
    sent = size * (sum(counts_out) - counts_out[rank])
    recv = size * (sum(counts_in) - counts_in[rank])
    _finish(kind, start, sent, recv, dense_bytes)
    return list(torch.split(out, counts_in))


def _all_to_all_single(out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits, group) -> None:
    if isinstance(group, ManagedGroup):
        group.all_to_all_single(out, inp, out_splits, in_splits).wait()
    else:
        dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)


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


# Point-to-point: ``dst`` / ``src`` are global ranks; ``group`` (default: the default
# group) must hold both ends. A timeout or a lost peer closes every connection of the group
# it happened in (gloo), so a channel that must survive a peer's death gets a group of its
# own (the parameter server's per-worker channels). ``group_peer``: the peer's rank *within*
# ``group`` instead (required for a group made outside torch.distributed's bookkeeping,
# :func:`pair_group`, whose ranks are not global ranks).
def _peer(key: str, rank: int | None, group_peer: int | None) -> dict:
    return {key: rank} if group_peer is None else {f"group_{key}": group_peer}


def send(tensor: torch.Tensor, dst: int, *, kind: str, dense_bytes: int | None = None, tag: int = 0,
         group: dist.ProcessGroup | None = None, group_peer: int | None = None) -> None:
    """Blocking point-to-point send."""
    start = time.perf_counter()
    dist.send(tensor, tag=tag, group=group, **_peer("dst", dst, group_peer))
    _finish(kind, start, nbytes(tensor), 0, dense_bytes)


def recv(tensor: torch.Tensor, src: int | None = None, *, kind: str, tag: int = 0,
         group: dist.ProcessGroup | None = None, group_peer: int | None = None) -> int:
    """Blocking receive into ``tensor``; ``src=None`` receives from any source (gloo).

    Returns the sender's rank (``group_peer`` when given).
    """
    start = time.perf_counter()
    if group_peer is None:
        sender = dist.recv(tensor, src=src, tag=tag, group=group)
    else:  # dist.recv would look the sender's global rank up: a pair group has none
        dist.irecv(tensor, tag=tag, group=group, group_src=group_peer).wait()
        sender = group_peer
    _finish(kind, start, 0, nbytes(tensor), 0)
    return int(sender)


def isend(tensor: torch.Tensor, dst: int, *, kind: str, dense_bytes: int | None = None, tag: int = 0,
          group: dist.ProcessGroup | None = None, group_peer: int | None = None):
    """Non-blocking send; bytes are recorded at launch, wait time by the caller."""
    get_meter().record(kind, sent=nbytes(tensor), dense=dense_bytes)
    return dist.isend(tensor, tag=tag, group=group, **_peer("dst", dst, group_peer))


def irecv(tensor: torch.Tensor, src: int | None = None, *, kind: str, tag: int = 0,
          group: dist.ProcessGroup | None = None, group_peer: int | None = None):
    """Non-blocking receive; bytes are recorded at launch, wait time by the caller."""
    get_meter().record(kind, recv=nbytes(tensor), dense=0)
    return dist.irecv(tensor, tag=tag, group=group, **_peer("src", src, group_peer))


def pair_group(store, prefix: str, index: int, timeout) -> dist.ProcessGroup:
    """A two-process gloo group of its own, rendezvoused under ``prefix`` in ``store``
    (``index``: 0 or 1, this process's rank in it; ``timeout``: a ``timedelta`` for its
    operations and for the other end to arrive). Unlike :func:`new_group` it is not
    collective over the default group: the two processes alone make it, and a process that
    joined no default group may make one (a restarted parameter-server worker, README
    "Losing a worker"). Address the peer with ``group_peer=1 - index``. Blocks until the
    other end makes its side (RuntimeError after ``timeout``)."""
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), index, 2, timeout)


def barrier(group: dist.ProcessGroup | None = None, *, kind: str = "control") -> None:
    start = time.perf_counter()
    dist.barrier(group=group)
    _finish(kind, start, 0, 0, 0)


def all_gather_object(obj, group: dist.ProcessGroup | None = None) -> list:
    """Gather a picklable object from every rank (control traffic, not metered as payload)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def new_group(ranks: list[int], timeout=None) -> dist.ProcessGroup:
    """A process group of ``ranks`` (``timeout``: a ``timedelta`` for its operations; None:
    torch's default). Collective over the default group: every rank creates every group, in
    the same order (a rank outside ``ranks`` gets a handle it never uses)."""
    return dist.new_group(ranks=ranks, timeout=timeout)


def close_process_group() -> None:
    """Destroy the default process group once this rank's last collective is done, then
    hand the GIL to gloo's worker threads for :data:`GLOO_DRAIN_S`.

    A gloo worker thread drops its reference to a finished work object after the caller's
    ``wait()`` returned; when that is the last reference to a tensor Python no longer holds
    (``all_gather_object``'s buffers), the thread must take the GIL to free its Python
    object. Once the interpreter finalizes, a thread taking the GIL exits mid-destructor and
    the rank aborts ("terminate called without an active exception", exit -6: a core dump
    shows ``~AsyncAllgatherWork`` -> ``take_gil`` -> ``pthread_exit`` in
    ``ProcessGroupGloo::runLoop`` while the main thread is in ``Py_FinalizeEx``). Destroying
    the group does not join those threads while other objects (DeepSpeed's grid, a
    strategy) still hold it, so this call lets a waiting thread finish first. Seen in 3 of
    28 four-rank runs on 10 Mbit/s links (issue 14) and in two-host ``pipeline_3d``
    launches; a process that dies that way resets its sockets, dropping data its peers
    have not read yet. The ranks the CLI runs also skip finalization (``exit_now``).
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(GLOO_DRAIN_S)  # releases the GIL: a worker waiting for it frees its tensors


#: how long :func:`close_process_group` leaves the GIL to gloo's worker threads (a waiting
#: thread needs microseconds; the margin covers a loaded machine's scheduling delay)
GLOO_DRAIN_S = 0.02


_close_registered = False


def close_process_group_at_exit() -> None:
    """Make :func:`close_process_group` run at interpreter exit (once per process), then
    the quick exit of :func:`~easgd_lightning.utils.procs.freeze_at_exit`.

    Our strategies call this when they set up the environment, so a user's own script that
    never destroys the process group does not abort at exit the way
    :func:`close_process_group` describes (seen in 2- and 3-rank ``sync_easgd`` runs), and
    its interpreter does not spend seconds collecting torch's and Lightning's objects."""
    global _close_registered
    freeze_at_exit()  # registered first: runs after the close (exit handlers run last-in, first-out)
    if not _close_registered:
        atexit.register(close_process_group)
        _close_registered = True
