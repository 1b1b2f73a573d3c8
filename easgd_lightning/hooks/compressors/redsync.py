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
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors.base import (
    check_choice,
    check_int,
    check_ratio,
    num_selected,
)
from easgd_lightning.hooks.compressors.sparse import SparseCompressor

__all__ = ["RedSyncCompressor", "trimmed_topk", "threshold_bisect"]

METHODS = ("auto", "trimmed", "bisect")


def trimmed_topk(mag: torch.Tensor, k: int, step: float = 0.2, start: float = 0.8) -> torch.Tensor:
    """RedSync trimmed top-k: lower r from ``start`` by ``step`` until >= k pass, then top-k."""
    n = mag.numel()
    if k >= n:
        return torch.arange(n, device=mag.device)
    mean, top = mag.mean(), mag.max()
    r = start
    while r > -1e-9:
        cand = torch.nonzero(mag > mean + r * (top - mean)).squeeze(1)
        if cand.numel() >= k:
            sel = torch.topk(mag[cand], k, sorted=False).indices
            return cand[sel]
        r -= step
    return torch.topk(mag, k, sorted=False).indices


def threshold_bisect(
    mag: torch.Tensor, k: int, max_iters: int = 20
) -> tuple[torch.Tensor, torch.Tensor]:
    """RedSync threshold binary search; returns (indices, threshold).

    Bisects r in [0, 1] for thr = m + r (M - m) until k <= nnz <= 2k; if the interval
    closes first, the lower threshold (at least k survivors when possible) is used.
    """
    n = mag.numel()
    if k >= n:
        return torch.arange(n, device=mag.device), mag.new_tensor(-1.0)
    mean, top = mag.mean(), mag.max()
    lo, hi = 0.0, 1.0
    thr_lo = mean
    if int((mag > thr_lo).sum()) < k:  # too few above the mean: exact top-k
        top_k1 = torch.topk(mag, k + 1, sorted=False)
        thr = top_k1.values.min()  # the (k+1)-th largest: mag > thr keeps the top k
        return torch.nonzero(mag > thr).squeeze(1), thr
    for _ in range(max_iters):
        mid = (lo + hi) / 2
        thr = mean + mid * (top - mean)
        nnz = int((mag > thr).sum())
        if nnz < k:
            hi = mid
        elif nnz > 2 * k:
            lo, thr_lo = mid, thr
        else:
            return torch.nonzero(mag > thr).squeeze(1), thr
    return torch.nonzero(mag > thr_lo).squeeze(1), thr_lo


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
        self.ratio = check_ratio("ratio", ratio)
        self.method = check_choice("method", method, METHODS)
        self.bisect_min_numel = check_int("bisect_min_numel", bisect_min_numel, 0)
        self.max_iters = check_int("max_iters", max_iters, 1)
        self.reuse_steps = check_int("reuse_steps", reuse_steps, 1)

    def method_for(self, numel: int) -> str:
        """The variant used for a tensor of ``numel`` elements."""
        if self.method != "auto":
            return self.method
        return "bisect" if numel >= self.bisect_min_numel else "trimmed"

    def select(self, flat: torch.Tensor, state: dict) -> torch.Tensor:
        mag = flat.abs()
        k = num_selected(flat.numel(), self.ratio)
        if self.method_for(flat.numel()) == "trimmed":
            return trimmed_topk(mag, k)
        age = int(state.get("thr_age", self.reuse_steps))
        if age < self.reuse_steps and "thr" in state:
            state["thr_age"] = age + 1
            return torch.nonzero(mag > state["thr"].to(mag.device)).squeeze(1)
        idx, thr = threshold_bisect(mag, k, self.max_iters)
        state["thr"], state["thr_age"] = thr, 1
        return idx
