"""A :class:`~easgd_lightning.hooks.compressors.base.Collective` over the metered comm layer.

Two ways of sending fewer, larger messages: :meth:`ProcessGroupCollective.batched` puts
the all-gathers of an exchange in one message per rank, and
:meth:`ProcessGroupCollective.fused` puts its all-reduce sums in lazy all-reduce buffers
of at least ``fusion_bytes`` (GradientFlow; :mod:`easgd_lightning.comm.fusion`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from easgd_lightning.comm import ops

__all__ = ["ProcessGroupCollective", "PendingCollective"]


class PendingCollective:
    """Collectives in flight: ``wait()`` waits for all of them (charging the wait to the
    meter's exposed time) and returns their result."""

    def __init__(self, handles: list, kind: str, result) -> None:
        self._handles, self._kind, self._result = handles, kind, result

    def wait(self):
        values = [ops.wait(h, kind=self._kind) for h in self._handles]
        return self._result(values)


class _GatherBatch:
    """All-gathers queued by :meth:`ProcessGroupCollective.batched`, sent as one message."""

    def __init__(self, collective: ProcessGroupCollective, key, index: int = 0) -> None:
        self._collective, self._key, self._index = collective, key, index
        self._tensors: list[torch.Tensor] = []
        self._dense = 0
        self._pending = None
        self._result: list[list[torch.Tensor]] | None = None

    def add(self, tensors: list[torch.Tensor]) -> _BatchPart:
        first = len(self._tensors)
        self._tensors += [t.reshape(-1).clone() for t in tensors]  # they may change before launch
        self._dense += self._collective._take_dense()
        return _BatchPart(self, first, len(self._tensors))

    @property
    def launched(self) -> bool:
        return self._pending is not None

    def next(self) -> _GatherBatch:
        """The batch that collects the all-gathers asked for after this one launched."""
        return _GatherBatch(self._collective, self._key, self._index + 1)

    def launch(self) -> None:
        if self._pending is None and self._tensors:
            coll = self._collective
            self._pending = ops.all_gather_varlen_async(
                self._tensors, kind=coll.kind, group=coll.group, dense_bytes=self._dense,
                slot=coll._slots.setdefault(("batch", self._key, self._index), {}),
            )
            self._tensors = []

    def wait(self) -> list[list[torch.Tensor]]:
        if self._result is None:
            self.launch()
            self._result = self._pending.wait()
        return self._result


class _BatchPart:
    """One all-gather's share of a batch: ``wait()`` gives, per rank, its tensors."""

    def __init__(self, batch: _GatherBatch, first: int, end: int) -> None:
        self._batch, self._first, self._end = batch, first, end

    def wait(self) -> list[list[torch.Tensor]]:
        return [parts[self._first : self._end] for parts in self._batch.wait()]


class _ReduceBucket:
    """One lazy all-reduce buffer: tensors of one dtype, reduced by one ``op`` (a sum, or
    the bitwise OR of packed bitmaps) as one message."""

    def __init__(self, collective: ProcessGroupCollective, dtype, op=dist.ReduceOp.SUM) -> None:
        self._collective, self.dtype, self.op = collective, dtype, op
        self._tensors: list[torch.Tensor] = []
        self.nbytes = 0
        self._dense = 0
        self._fut = None
        self._result: torch.Tensor | None = None

    def add(self, tensor: torch.Tensor, dense: int) -> tuple[_ReduceBucket, int, int]:
        flat = tensor.reshape(-1).clone()  # it may change before the launch
        offset = sum(t.numel() for t in self._tensors)
        self._tensors.append(flat)
        self.nbytes += flat.numel() * flat.element_size()
        self._dense += dense
        return self, offset, flat.numel()

    def launch(self) -> None:
        if self._fut is None:
            coll = self._collective
            buf = torch.cat(self._tensors) if len(self._tensors) > 1 else self._tensors[0]
            self._tensors = []
            self._fut = ops.all_reduce_async(buf, kind=coll.kind, op=self.op, group=coll.group, dense_bytes=self._dense)

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self.launch()
            self._result = self._fut.wait()[0]
        return self._result


class _FusedPart:
    """One ``all_reduce_sum_async`` call's share of the lazy all-reduce buffers."""

    def __init__(self, slices: list, shapes: list) -> None:
        self._slices, self._shapes = slices, shapes

    def wait(self) -> list[torch.Tensor]:
        return [b.wait()[o : o + n].view(shape) for (b, o, n), shape in zip(self._slices, self._shapes)]


class ProcessGroupCollective:
    """Runs a compressor's exchanges on a process group, metering them under ``kind``.

    ``dense_bytes_per_call`` is charged as the uncompressed cost of the first collective of
    each exchange (callers set it with :meth:`charge_dense` before ``aggregate``). The
    blocking calls are the non-blocking ones waited for at once. ``fusion_bytes``: the
    lazy all-reduce buffer size of :meth:`fused` (None: no fusion).
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, kind: str = "data_parallel", fusion_bytes: int | None = None
    ):
        self.group = group
        self.kind = kind
        self.fusion_bytes = fusion_bytes
        self._open: dict | None = None  # (op, dtype) -> the open lazy all-reduce buffer
        self._pending_dense: int | None = None
        self._key = None
        self._gathers = 0
        self._slots: dict = {}
        self._batch: _GatherBatch | None = None

    @property
    def world_size(self) -> int:
        """The group's size now (a managed group's is this step's quorum: it may change
        from one exchange to the next)."""
        return ops.group_size(self.group)

    @property
    def rank(self) -> int:
        """This process's rank in the group now."""
        return ops.group_rank(self.group)

    def capacities(self) -> dict:
        """Each variable-length all-gather slot's message capacity (bytes): the same on every
        rank (:func:`easgd_lightning.comm.ops.next_capacity`), so a rank that joins running
        peers must hold theirs to send messages of the same size."""
        return {key: int(slot.get("cap", 0)) for key, slot in self._slots.items()}

    def load_capacities(self, caps: dict) -> None:
        """Take :meth:`capacities` (a peer's, or this rank's own before a step that is undone);
        the slots' buffers are reallocated at their next use."""
        self._slots = {key: {"cap": int(cap)} for key, cap in caps.items()}

    def charge_dense(self, nbytes: int, key=None) -> None:
        """Record ``nbytes`` as the dense cost of the next exchange. ``key`` names the tensor
        it exchanges: its variable-length all-gathers then keep their message capacity and
        buffers from one exchange of that tensor to the next
        (:func:`easgd_lightning.comm.ops.all_gather_varlen_async`: one round trip, not two)."""
        self._pending_dense = int(nbytes)
        self._key, self._gathers = key, 0

    @contextmanager
    def batched(self, key) -> Iterator[None]:
        """All-gathers asked for inside travel as one message per rank, launched on leaving
        (or when one of them is waited for first): one round trip for the payloads of every
        tensor of an exchange. ``key`` names the batch (its capacity persists, as a tensor's)."""
        self._batch = _GatherBatch(self, key)
        try:
            yield
        finally:
            batch, self._batch = self._batch, None
            batch.launch()

    @contextmanager
    def fused(self) -> Iterator[None]:
        """All-reduce sums asked for inside join lazy all-reduce buffers (one per dtype,
        tensors in call order): a buffer is sent once it holds ``fusion_bytes``
        (:func:`easgd_lightning.comm.fusion.fusion_buckets`), when one of its tensors is
        waited for (a multi-round codec), or on leaving. Without ``fusion_bytes`` (None)
        every call is its own message, as outside."""
        if self.fusion_bytes is None or self._open is not None:
            yield
            return
        self._open = {}
        try:
            yield
        finally:
            open_buckets, self._open = self._open, None
            for bucket in open_buckets.values():
                bucket.launch()

    def _fused_sum(self, tensors: list[torch.Tensor], op=dist.ReduceOp.SUM) -> PendingCollective:
        dense = self._take_dense()
        slices = []
        for t in tensors:
            slot = (str(op), t.dtype)
            bucket = self._open.get(slot)
            if bucket is None or bucket._fut is not None:  # none open, or waited for already
                bucket = self._open[slot] = _ReduceBucket(self, t.dtype, op)
            slices.append(bucket.add(t, dense))
            dense = 0
            if bucket.nbytes >= self.fusion_bytes:
                bucket.launch()
                del self._open[slot]
        return PendingCollective([_FusedPart(slices, [t.shape for t in tensors])], self.kind, lambda v: v[0])

    def _take_dense(self) -> int:
        dense, self._pending_dense = (self._pending_dense or 0), None
        return dense

    def _gather_slot(self) -> dict | None:
        """The persistent slot of the next all-gather of the named tensor's exchange."""
        if self._key is None:
            return None
        slot = self._slots.setdefault((self._key, self._gathers), {})
        self._gathers += 1
        return slot

    def _all_reduce_async(self, tensors: list[torch.Tensor], op) -> PendingCollective:
        bufs = [t.clone() for t in tensors]
        handles = [
            ops.all_reduce_async(
                b, kind=self.kind, op=op, group=self.group, dense_bytes=self._take_dense()
            )
            for b in bufs
        ]
        return PendingCollective(handles, self.kind, lambda _: bufs)

    def all_reduce_sum_async(self, tensors: list[torch.Tensor]) -> PendingCollective:
        """Non-blocking :meth:`all_reduce_sum`; ``.wait()`` returns the summed tensors.
        Inside :meth:`fused`, the tensors join the lazy all-reduce buffers instead."""
        if self._open is not None and tensors:
            return self._fused_sum(tensors)
        return self._all_reduce_async(tensors, dist.ReduceOp.SUM)

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.all_reduce_sum_async(tensors).wait()

    def all_reduce_max(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._all_reduce_async(tensors, dist.ReduceOp.MAX).wait()

    def all_gather_async(self, tensors: list[torch.Tensor]):
        """Non-blocking :meth:`all_gather`; ``.wait()`` returns what it returns. Inside
        :meth:`batched`, the tensors join the batch's one message instead."""
        if self._batch is not None:
            if self._batch.launched:  # one of the batch was waited for already
                self._batch = self._batch.next()
            handle = self._batch.add(tensors)
        else:
            handle = ops.all_gather_varlen_async(
                tensors, kind=self.kind, group=self.group, dense_bytes=self._take_dense(),
                slot=self._gather_slot(),
            )
        return PendingCollective([handle], self.kind, lambda values: values[0])

    def all_gather(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's tensors, [rank][i] (1-D, lengths may differ per rank); they may be
        views of buffers reused by this tensor's next exchange."""
        return self.all_gather_async(tensors).wait()

    def all_to_all(self, sends: list[torch.Tensor]) -> list[torch.Tensor]:
        """``sends[j]`` to rank j; returns per source rank what it sent here (1-D, one dtype,
        lengths free; :func:`easgd_lightning.comm.ops.all_to_all`). Blocking, outside any
        batch: it is the first collective of an exchange (two-way's reduce-scatter), so it
        takes the exchange's dense charge."""
        return ops.all_to_all(sends, kind=self.kind, group=self.group, dense_bytes=self._take_dense())

    def all_reduce_bor_async(self, tensors: list[torch.Tensor]):
        """Non-blocking :meth:`all_reduce_bor`; ``.wait()`` returns the OR-ed tensors.
        Inside :meth:`fused`, the tensors join a lazy all-reduce buffer of ORs (one per
        dtype, apart from the sums'). NCCL's unpack-and-max fallback runs at once."""
        if ops.group_backend(self.group) == "nccl":
            done = self.all_reduce_bor(tensors)
            return PendingCollective([], self.kind, lambda _: done)
        if self._open is not None and tensors:
            return self._fused_sum(tensors, dist.ReduceOp.BOR)
        return self._all_reduce_async(tensors, dist.ReduceOp.BOR)

    def all_reduce_bor(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Bitwise OR over ranks of integer tensors (bit-packed bitmaps, S2 Reducer).

        NCCL has no bitwise-OR reduction: there the bits are unpacked to one byte each and
        max-reduced (honestly metered at 8x the bytes), then packed again.
        """
        if ops.group_backend(self.group) != "nccl":
            return self._all_reduce_async(tensors, dist.ReduceOp.BOR).wait()
        out = []
        for t in tensors:
            bits = ((t.view(-1, 1) >> torch.arange(8, device=t.device, dtype=t.dtype)) & 1)
            (buf,) = self._all_reduce_async([bits.to(torch.uint8).reshape(-1)], dist.ReduceOp.MAX).wait()
            weights = (2 ** torch.arange(8, device=t.device)).to(t.dtype)
            out.append((buf.view(-1, 8).to(t.dtype) * weights).sum(dim=1).to(t.dtype))
        return out
