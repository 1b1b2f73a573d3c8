"""A :class:`~easgd_lightning.hooks.compressors.base.Collective` over the metered comm layer."""

from __future__ import annotations

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


class ProcessGroupCollective:
    """Runs a compressor's exchanges on a process group, metering them under ``kind``.

    ``dense_bytes_per_call`` is charged as the uncompressed cost of the first collective of
    each exchange (callers set it with :meth:`charge_dense` before ``aggregate``). The
    blocking calls are the non-blocking ones waited for at once.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, kind: str = "data_parallel"):
        self.group = group
        self.kind = kind
        self.world_size = dist.get_world_size(group)
        self._pending_dense: int | None = None
        self._key = None
        self._gathers = 0
        self._slots: dict = {}

    def charge_dense(self, nbytes: int, key=None) -> None:
        """Record ``nbytes`` as the dense cost of the next exchange. ``key`` names the tensor
        it exchanges: its variable-length all-gathers then keep their message capacity and
        buffers from one exchange of that tensor to the next
        (:func:`easgd_lightning.comm.ops.all_gather_varlen_async`: one round trip, not two)."""
        self._pending_dense = int(nbytes)
        self._key, self._gathers = key, 0

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
        """Non-blocking :meth:`all_reduce_sum`; ``.wait()`` returns the summed tensors."""
        return self._all_reduce_async(tensors, dist.ReduceOp.SUM)

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.all_reduce_sum_async(tensors).wait()

    def all_reduce_max(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._all_reduce_async(tensors, dist.ReduceOp.MAX).wait()

    def all_gather_async(self, tensors: list[torch.Tensor]) -> PendingCollective:
        """Non-blocking :meth:`all_gather`; ``.wait()`` returns what it returns."""
        handles = [
            ops.all_gather_varlen_async(
                t.reshape(-1), kind=self.kind, group=self.group,
                dense_bytes=self._take_dense(), slot=self._gather_slot(),
            )
            for t in tensors
        ]

        def result(per_tensor: list) -> list[list[torch.Tensor]]:
            return [list(rank_parts) for rank_parts in zip(*per_tensor)] if per_tensor else []

        return PendingCollective(handles, self.kind, result)

    def all_gather(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's tensors, [rank][i] (1-D, lengths may differ per rank); they may be
        views of buffers reused by this tensor's next exchange."""
        return self.all_gather_async(tensors).wait()

    def all_reduce_bor(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Bitwise OR over ranks of integer tensors (bit-packed bitmaps, S2 Reducer).

        NCCL has no bitwise-OR reduction: there the bits are unpacked to one byte each and
        max-reduced (honestly metered at 8x the bytes), then packed again.
        """
        if dist.get_backend(self.group) != "nccl":
            return self._all_reduce_async(tensors, dist.ReduceOp.BOR).wait()
        out = []
        for t in tensors:
            bits = ((t.view(-1, 1) >> torch.arange(8, device=t.device, dtype=t.dtype)) & 1)
            (buf,) = self._all_reduce_async([bits.to(torch.uint8).reshape(-1)], dist.ReduceOp.MAX).wait()
            weights = (2 ** torch.arange(8, device=t.device)).to(t.dtype)
            out.append((buf.view(-1, 8).to(t.dtype) * weights).sum(dim=1).to(t.dtype))
        return out
