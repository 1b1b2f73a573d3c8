"""A :class:`~easgd_lightning.hooks.compressors.base.Collective` over the metered comm layer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from easgd_lightning.comm import ops

__all__ = ["ProcessGroupCollective", "PendingCollective"]


class PendingCollective:
    """Collectives in flight: ``wait()`` waits for all of them (charging the wait to the
    meter's exposed time) and returns their result."""

    def __init__(self, futures: list, kind: str, result) -> None:
        self._futures, self._kind, self._result = futures, kind, result

    def wait(self):
        for fut in self._futures:
            ops.wait(fut, kind=self._kind)
        return self._result()


class ProcessGroupCollective:
    """Runs a compressor's exchanges on a process group, metering them under ``kind``.

    ``dense_bytes_per_call`` is charged as the uncompressed cost of the first collective of
    each exchange (callers set it with :meth:`charge_dense` before ``aggregate``).
    """

    def __init__(self, group: dist.ProcessGroup | None = None, kind: str = "data_parallel"):
        self.group = group
        self.kind = kind
        self.world_size = dist.get_world_size(group)
        self._pending_dense: int | None = None

    def charge_dense(self, nbytes: int) -> None:
        """Record ``nbytes`` as the dense cost of the next exchange."""
        self._pending_dense = int(nbytes)

    def _take_dense(self) -> int:
        dense, self._pending_dense = (self._pending_dense or 0), None
        return dense

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for t in tensors:
            buf = t.clone()
            ops.all_reduce(buf, kind=self.kind, group=self.group, dense_bytes=self._take_dense())
            out.append(buf)
        return out

    def all_reduce_sum_async(self, tensors: list[torch.Tensor]) -> PendingCollective:
        """Non-blocking :meth:`all_reduce_sum`; ``.wait()`` returns the summed tensors."""
        bufs = [t.clone() for t in tensors]
        futs = [
            ops.all_reduce_async(b, kind=self.kind, group=self.group, dense_bytes=self._take_dense())
            for b in bufs
        ]
        return PendingCollective(futs, self.kind, lambda: bufs)

    def all_gather_async(self, tensors: list[torch.Tensor]) -> PendingCollective:
        """Non-blocking :meth:`all_gather` (varlen); ``.wait()`` returns what it returns."""
        futs = [
            ops.all_gather_varlen_async(
                t.reshape(-1), kind=self.kind, group=self.group, dense_bytes=self._take_dense()
            )
            for t in tensors
        ]

        def result() -> list[list[torch.Tensor]]:
            per_tensor = [f.value() for f in futs]
            return [list(rank_parts) for rank_parts in zip(*per_tensor)] if per_tensor else []

        return PendingCollective(futs, self.kind, result)

    def all_reduce_max(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for t in tensors:
            buf = t.clone()
            ops.all_reduce(
                buf, kind=self.kind, op=dist.ReduceOp.MAX, group=self.group,
                dense_bytes=self._take_dense(),
            )
            out.append(buf)
        return out

    def all_reduce_bor(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Bitwise OR over ranks of integer tensors (bit-packed bitmaps, S2 Reducer).

        NCCL has no bitwise-OR reduction: there the bits are unpacked to one byte each and
        max-reduced (honestly metered at 8x the bytes), then packed again.
        """
        out = []
        nccl = dist.get_backend(self.group) == "nccl"
        for t in tensors:
            if nccl:
                bits = ((t.view(-1, 1) >> torch.arange(8, device=t.device, dtype=t.dtype)) & 1)
                buf = bits.to(torch.uint8).reshape(-1).clone()
                ops.all_reduce(
                    buf, kind=self.kind, op=dist.ReduceOp.MAX, group=self.group,
                    dense_bytes=self._take_dense(),
                )
                weights = (2 ** torch.arange(8, device=t.device)).to(t.dtype)
                out.append((buf.view(-1, 8).to(t.dtype) * weights).sum(dim=1).to(t.dtype))
            else:
                buf = t.clone()
                ops.all_reduce(
                    buf, kind=self.kind, op=dist.ReduceOp.BOR, group=self.group,
                    dense_bytes=self._take_dense(),
                )
                out.append(buf)
        return out

    def all_gather(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        per_tensor = []
        for t in tensors:
            flat = t.reshape(-1)
            parts = ops.all_gather_varlen(
                flat, kind=self.kind, group=self.group, dense_bytes=self._take_dense()
            )
            per_tensor.append(parts)
        return [list(rank_parts) for rank_parts in zip(*per_tensor)] if per_tensor else []
