"""``topk``: gradient dropping with residuals (Aji & Heafield, EMNLP 2017).

Rule: g <- g + e (residual, :mod:`easgd_lightning.hooks.memory`); thr = the (1 - R)
quantile of |g| estimated on a strided sample of min(sample_size, n) entries; send
{(i, g_i) : |g_i| > thr}; e <- g - sent. Payload: nnz * (4-byte index + value), all-gathered.
Defaults: ratio = 0.01 (R = 99% dropped), sample_size = 100000, exact = false (true: exact
``torch.topk`` of k = ceil(ratio * n)), memory = true. The threshold is per tensor
(per layer), which the paper finds necessary without layer normalization.
Cost: the threshold comes from the sample alone, so the sampled path is one pass over the
tensor that gathers the survivors (:func:`select_above`); with residual memory the sent
entries are zeroed in the compensated buffer during the same call.
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors.base import (
    check_bool,
    check_int,
    check_ratio,
    num_selected,
    scratch_of,
)
from easgd_lightning.hooks.compressors.sparse import (
    SparseCompressor,
    sample_threshold,
    select_above,
    strided_sample,
)

__all__ = ["TopKCompressor", "topk_indices", "topk_select"]


def topk_select(
    flat: torch.Tensor,
    ratio: float,
    *,
    exact: bool = False,
    sample_size: int = 100_000,
    scratch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of the ~ratio * n largest |flat| (sampled threshold, or exact top-k)."""
    n = flat.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=flat.device), flat[:0]
    k = num_selected(n, ratio)
    if k >= n:
        return torch.arange(n, device=flat.device), flat
    if exact:
        idx = torch.topk(flat.abs(), k, sorted=False).indices
        return idx, flat[idx]
    thr = sample_threshold(strided_sample(flat, sample_size).abs(), ratio, sample_size)
    return select_above(flat, thr, expect=k, scratch=scratch)


def topk_indices(
    flat: torch.Tensor, ratio: float, *, exact: bool = False, sample_size: int = 100_000
) -> torch.Tensor:
    """Indices of the ~ratio * n largest |flat| (sampled threshold, or exact top-k)."""
    return topk_select(flat, ratio, exact=exact, sample_size=sample_size)[0]


class TopKCompressor(SparseCompressor):
    """Gradient dropping: send the entries above a sampled magnitude quantile.

    Args:
        ratio: fraction of entries sent, in (0, 1] (R = 1 - ratio is dropped).
        sample_size: entries in the strided sample that estimates the threshold.
        exact: use an exact ``torch.topk`` of k = ceil(ratio * n) instead of the sample.
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "topk"
    search_knob = "ratio"

    def __init__(
        self,
        ratio: float = 0.01,
        *,
        sample_size: int = 100_000,
        exact: bool = False,
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.ratio = check_ratio("compression.ratio", ratio)
        self.sample_size = check_int("compression.sample_size", sample_size, 1)
        self.exact = check_bool("compression.exact", exact)

    def select(self, flat: torch.Tensor, state: dict) -> torch.Tensor:
        return topk_indices(flat, self.ratio, exact=self.exact, sample_size=self.sample_size)

    def select_values(self, flat: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_select(
            flat, self.ratio, exact=self.exact, sample_size=self.sample_size,
            scratch=scratch_of(state),
        )
