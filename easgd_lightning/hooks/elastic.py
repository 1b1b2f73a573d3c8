"""Exchange of elastic differences (EASGD, local SGD), optionally compressed.

``exchange_sum(diff, ...)`` returns sum_i diff_i over ranks. Uncompressed it is one
all-reduce of the flat buffer ("single-layer communication", You et al. SC17). With a
compressor, every rank compresses its (error-compensated) difference and the aggregated,
decompressed sum is returned; the residual stays in ``memory``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from easgd_lightning.comm import ops

__all__ = ["exchange_sum"]


def exchange_sum(
    diff: torch.Tensor,
    *,
    compressor=None,
    memory=None,
    state: dict | None = None,
    group: dist.ProcessGroup | None = None,
    kind: str = "elastic",
    key: str = "flat",
) -> torch.Tensor:
    """Sum ``diff`` over the ranks of ``group`` (in place when uncompressed)."""
    if compressor is None:
        return ops.all_reduce(diff, kind=kind, group=group)
    raise NotImplementedError("compressed elastic exchange lands with the compression issue")
