"""``redsync``: RedSync's residual gradient compression (Fang et al., JPDC 2019).

Rule: with m = mean |x|, M = max |x| and thr(r) = m + r (M - m):
  trimmed top-k: r = 0.8, 0.6, ... until at least k = ceil(ratio n) entries pass, then exact
  top-k among the survivors (a small set);
  threshold binary search: bisect r in [0, 1] until k <= nnz <= 2k (at most
  ``max_iters`` halvings) and send every survivor; the threshold may be reused for
  ``reuse_steps`` steps.
Residuals (memory) keep the rest; payloads are all-gathered (allgatherv). Defaults:
ratio = 0.001, method = auto (bisect for tensors of at least ``bisect_min_numel`` =
1048576 elements, trimmed otherwise), max_iters = 20, reuse_steps = 1, memory = true.
Fused exchange (:mod:`easgd_lightning.hooks._fused`): one compensation, payload, message and
decode per exchange; each tensor's search stays its own (a loop over the tensors), and a
reused threshold with its age is kept per tensor in the exchange's ``segment_states``.

Cost: m and M come from one fused pass. A strided sample of ``GUIDE_SAMPLE`` entries
picks the first threshold to try (the bisection, or the trimming ratio, run on the
sample's counts); one pass on the whole tensor then counts and gathers its survivors. The
rule is checked on the whole tensor, never on the sample: trimmed top-k keeps the exact
top-k of the survivors once at least k pass (so the same set as lowering r one step at a
time); the bisection accepts only k <= nnz <= 2k counted on the whole tensor and otherwise
runs the plain bisection with one counting pass per probe.
"""

from __future__ import annotations

import ctypes

import torch

from easgd_lightning.hooks.compressors import _native
from easgd_lightning.hooks.compressors.base import (
    check_choice,
    check_int,
    check_ratio,
    num_selected,
    scratch_of,
)
from easgd_lightning.hooks.compressors.sparse import (
    SparseCompressor,
    count_above,
    select_above,
    strided_sample,
)

__all__ = [
    "RedSyncCompressor",
    "trimmed_topk",
    "trimmed_select",
    "threshold_bisect",
    "threshold_bisect_select",
    "abs_mean_max",
]

METHODS = ("auto", "trimmed", "bisect")
#: entries of the strided sample that guides the first probe (does not change the rule)
GUIDE_SAMPLE = 100_000


def abs_mean_max(x: torch.Tensor) -> tuple[float, float]:
    """(mean |x|, max |x|) in one pass (native), or two eager reductions."""
    lib = _native.use(x)
    if lib is not None and x.numel() > 0:
        total, top = ctypes.c_double(), (ctypes.c_float if x.dtype == torch.float32 else ctypes.c_double)()
        _native.fn(lib, "abs_sum_max", x.dtype)(x.data_ptr(), x.numel(), ctypes.addressof(total),
                                                ctypes.addressof(top))
        return total.value / x.numel(), float(top.value)
    mag = x.abs()
    return float(mag.mean()), float(mag.max())


def _sampled_count(sample: torch.Tensor, thr: float, scale: float) -> float:
    """Survivors of ``thr`` in the whole tensor, estimated from the (contiguous) sample."""
    return count_above(sample, thr) * scale


def trimmed_select(
    x: torch.Tensor, k: int, step: float = 0.2, start: float = 0.8, scratch: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of RedSync's trimmed top-k of |x| (see the module docstring)."""
    n = x.numel()
    if k >= n:
        return torch.arange(n, device=x.device), x
    mean, top = abs_mean_max(x)
    ratios = []
    r = start
    while r > -1e-9:
        ratios.append(r)
        r -= step
    sample = strided_sample(x, GUIDE_SAMPLE).abs()
    scale = n / sample.numel()
    first = len(ratios) - 1
    for j, r in enumerate(ratios):  # the sample's guess: the first r with ~1.5 k survivors
        if _sampled_count(sample, mean + r * (top - mean), scale) >= 1.5 * k:
            first = j
            break
    for r in ratios[first:]:
        expect = int(_sampled_count(sample, mean + r * (top - mean), scale))
        cand, val = select_above(x, mean + r * (top - mean), expect=expect, scratch=scratch)
        if cand.numel() >= k:
            sel = torch.topk(val.abs(), k, sorted=False).indices
            return cand[sel], val[sel]
    idx = torch.topk(x.abs(), k, sorted=False).indices
    return idx, x[idx]


def trimmed_topk(mag: torch.Tensor, k: int, step: float = 0.2, start: float = 0.8) -> torch.Tensor:
    """RedSync trimmed top-k: lower r from ``start`` by ``step`` until >= k pass, then top-k."""
    return trimmed_select(mag, k, step, start)[0]


def _bisect_full(x: torch.Tensor, k: int, max_iters: int, mean: float, top: float) -> float:
    """The plain bisection on the whole tensor (one counting pass per probe); the threshold."""
    lo, hi = 0.0, 1.0
    thr_lo = mean
    if count_above(x, mean) < k:  # too few above the mean: exact top-k
        top_k1 = torch.topk(x.abs(), k + 1, sorted=False)
        return float(top_k1.values.min())  # the (k+1)-th largest: |x| > thr keeps the top k
    for _ in range(max_iters):
        mid = (lo + hi) / 2
        thr = mean + mid * (top - mean)
        nnz = count_above(x, thr)
        if nnz < k:
            hi = mid
        elif nnz > 2 * k:
            lo, thr_lo = mid, thr
        else:
            return thr
    return thr_lo


def threshold_bisect_select(
    x: torch.Tensor, k: int, max_iters: int = 20, scratch: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """RedSync threshold binary search on |x|; returns (indices, values, threshold).

    Bisects r in [0, 1] for thr = m + r (M - m) until k <= nnz <= 2k; if the interval
    closes first, the lower threshold (at least k survivors when possible) is used.
    """
    n = x.numel()
    if k >= n:
        return torch.arange(n, device=x.device), x, -1.0
    mean, top = abs_mean_max(x)
    sample = strided_sample(x, GUIDE_SAMPLE).abs()
    scale = n / sample.numel()
    lo, hi = 0.0, 1.0
    for _ in range(max_iters):  # the same bisection on the sample's counts: a first probe
        mid = (lo + hi) / 2
        thr = mean + mid * (top - mean)
        est = _sampled_count(sample, thr, scale)
        if est < k:
            hi = mid
        elif est > 2 * k:
            lo = mid
        else:
            idx, val = select_above(x, thr, expect=int(est), scratch=scratch)
            if k <= idx.numel() <= 2 * k:  # the rule holds on the whole tensor
                return idx, val, thr
            break
    thr = _bisect_full(x, k, max_iters, mean, top)
    idx, val = select_above(x, thr, expect=2 * k, scratch=scratch)
    return idx, val, thr


def threshold_bisect(
    mag: torch.Tensor, k: int, max_iters: int = 20
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`threshold_bisect_select` on magnitudes; returns (indices, threshold tensor)."""
    idx, _, thr = threshold_bisect_select(mag, k, max_iters)
    return idx, mag.new_tensor(thr)


class RedSyncCompressor(SparseCompressor):
    """RedSync: trimmed top-k or threshold binary search, with residuals.

    Args:
        ratio: target density k / n, in (0, 1].
        method: ``trimmed``, ``bisect`` or ``auto`` (bisect for large tensors).
        bisect_min_numel: ``auto`` uses bisect from this many elements.
        max_iters: bisection steps.
        reuse_steps: steps a bisected threshold is reused before searching again.
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "redsync"
    search_knob = "ratio"
    fused_segments = True

    def __init__(
        self,
        ratio: float = 0.001,
        *,
        method: str = "auto",
        bisect_min_numel: int = 1 << 20,
        max_iters: int = 20,
        reuse_steps: int = 1,
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.ratio = check_ratio("compression.ratio", ratio)
        self.method = check_choice("compression.method", method, METHODS)
        self.bisect_min_numel = check_int("compression.bisect_min_numel", bisect_min_numel, 0)
        self.max_iters = check_int("compression.max_iters", max_iters, 1)
        self.reuse_steps = check_int("compression.reuse_steps", reuse_steps, 1)

    @property
    def segment_state(self) -> bool:  # type: ignore[override]
        """A reused threshold (``reuse_steps`` > 1) is a tensor's own state across steps: the
        fused exchange keeps it per segment (``segment_states``); afresh, nothing is kept."""
        return self.reuse_steps > 1

    def method_for(self, numel: int) -> str:
        """The variant used for a tensor of ``numel`` elements."""
        if self.method != "auto":
            return self.method
        return "bisect" if numel >= self.bisect_min_numel else "trimmed"

    def select(self, flat: torch.Tensor, state: dict) -> torch.Tensor:
        return self.select_values(flat, state)[0]

    def select_values(self, flat: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        k = num_selected(flat.numel(), self.ratio)
        scratch = scratch_of(state)
        if self.method_for(flat.numel()) == "trimmed":
            return trimmed_select(flat, k, scratch=scratch)
        age = int(state.get("thr_age", self.reuse_steps))
        if age < self.reuse_steps and "thr" in state:
            state["thr_age"] = age + 1
            return select_above(flat, float(state["thr"]), expect=k, scratch=scratch)
        idx, val, thr = threshold_bisect_select(flat, k, self.max_iters, scratch)
        state["thr"], state["thr_age"] = flat.new_tensor(thr), 1
        return idx, val
