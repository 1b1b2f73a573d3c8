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
Fused exchange (:mod:`easgd_lightning.hooks._fused`): :func:`topk_segments` runs the rule on
every compressed tensor of the exchange's flat buffer in one native call, each tensor with
its own sample and threshold (the same numbers as :func:`topk_select` on it alone); the
exact variant loops over the tensors.
"""

from __future__ import annotations

import math

import torch

from easgd_lightning.hooks.compressors import _native
from easgd_lightning.hooks.compressors.base import (
    check_bool,
    check_int,
    check_ratio,
    num_selected,
    scratch_buffer,
    scratch_of,
)
from easgd_lightning.hooks.compressors.segments import Segments
from easgd_lightning.hooks.compressors.sparse import (
    SparseCompressor,
    sample_threshold,
    select_above,
    strided_sample,
)

__all__ = ["TopKCompressor", "topk_indices", "topk_select", "topk_segments"]


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


def _segment_rule(n: int, ratio: float, sample_size: int) -> tuple[int, int, int, int]:
    """(stride, sample entries m, ks, poison) of :func:`topk_select` on a tensor of ``n``
    entries, as the kernel reads them: ks = -2 keeps every entry (k >= n), -1 keeps all
    above -1 (the sample keeps everything), else the threshold is the (ks + 1)-th largest
    |x| of x[::stride] (m entries), NaN when ``poison`` (topk's regime) and it holds one."""
    if num_selected(n, ratio) >= n:
        return 1, n, -2, 0
    s1 = max(1, n // max(1, sample_size))  # strided_sample, then sample_threshold's stride
    m1 = math.ceil(n / s1)
    s2 = max(1, m1 // max(1, sample_size))
    m = math.ceil(m1 / s2)
    ks = num_selected(m, ratio)
    if ks >= m:
        return s1 * s2, m, -1, 0
    return s1 * s2, m, ks, int(4 * (ks + 1) <= m)


def topk_segments(
    flat: torch.Tensor,
    segments: Segments,
    ratio: float,
    sample_size: int,
    *,
    zero_sent: bool = False,
    scratch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_select` (sampled) on every segment of the 1-D ``flat`` alone, at once:
    (indices relative to ``flat``, ascending per segment, segments in order; values). With
    ``zero_sent`` the sent entries of ``flat`` are set to 0. One native call where the
    kernels apply, else a loop over the segments (the same numbers)."""
    lib = _native.use(flat)
    if lib is None:
        picks = []
        for off, n in segments:
            i, v = topk_select(flat[off : off + n], ratio, sample_size=sample_size)
            picks.append((i + off, v.clone()))
        idx = torch.cat([i for i, _ in picks]) if picks else flat.new_zeros(0, dtype=torch.long)
        val = torch.cat([v for _, v in picks]) if picks else flat[:0]
        if zero_sent:
            flat.index_fill_(0, idx, 0)
        return idx, val

    def plan():
        rules = [_segment_rule(n, ratio, sample_size) for n in segments.lengths]
        k = sum(num_selected(n, ratio) for n in segments.lengths)
        cols = [torch.tensor(c, dtype=torch.int64) for c in zip(*rules)]
        return (*segments.arrays(), *cols, max(r[1] for r in rules), 2 * k + 1024)

    off, lens, stride, m, ks, poison, work_n, expect = segments.cached(("topk", ratio, sample_size), plan)
    wdt = torch.int32 if flat.element_size() == 4 else torch.int64
    work = scratch_buffer(scratch, "seg_work", work_n, wdt, "cpu")
    cap = min(flat.numel(), max(expect, scratch["sel_idx"].numel() if scratch and "sel_idx" in scratch else 0))
    while True:
        idx = scratch_buffer(scratch, "sel_idx", cap, torch.int64, flat.device)
        val = scratch_buffer(scratch, "sel_val", cap, flat.dtype, flat.device)
        c = int(_native.fn(lib, "topk_segments", flat.dtype)(
            flat.data_ptr(), len(segments), off.data_ptr(), lens.data_ptr(), stride.data_ptr(),
            m.data_ptr(), ks.data_ptr(), poison.data_ptr(), int(zero_sent), cap, idx.data_ptr(),
            val.data_ptr(), work.data_ptr(),
        ))
        if c <= cap:
            return idx[:c], val[:c]
        cap = c


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
    fused_segments = True

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

    def select_segments(self, flat: torch.Tensor, segments: Segments, state: dict, zero_sent: bool):
        """(indices relative to ``flat``, values) of every segment's own selection; the
        exact variant loops over the segments."""
        if self.exact:
            return super().select_segments(flat, segments, state, zero_sent)
        return topk_segments(
            flat, segments, self.ratio, self.sample_size, zero_sent=zero_sent, scratch=scratch_of(state)
        )
