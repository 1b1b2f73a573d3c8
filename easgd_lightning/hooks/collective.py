"""A :class:`~easgd_lightning.hooks.compressors.base.Collective` over the metered comm layer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from easgd_lightning.comm import ops

__all__ = ["ProcessGroupCollective"]


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

    def all_gather(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        per_tensor = []
        for t in tensors:
            flat = t.reshape(-1)
            parts = ops.all_gather_varlen(
                flat, kind=self.kind, group=self.group, dense_bytes=self._take_dense()
            )
            per_tensor.append(parts)
        return [list(rank_parts) for rank_parts in zip(*per_tensor)] if per_tensor else []
