"""``sidco``: statistical threshold estimation (Abdelmoniem et al., MLSys 2021).

Rule: u = |g| / ||g||_2 (zeros included) is modelled by a sparsity-inducing law; the
threshold with tail mass delta is closed-form:
  exponential: thr = -mean(u) ln(delta)
  gamma: s = ln mean(u) - mean(ln(u + eps)), a = (3 - s + sqrt((s - 3)^2 + 24 s)) / (12 s),
         b = mean(u) / a, thr = b Q^{-1}(a, delta)   (Q: regularized upper gamma)
  generalized Pareto (moments m, v): k = (m^2/v - 1)/2, sigma = m (m^2/v + 1)/2,
         thr = sigma (1 - delta^k) / k
Multi-stage (S stages): stage 1 fits the law above for 0.25; each later stage takes the
survivors, shifts them by their minimum and refits the exceedances -- a generalized Pareto
(Pickands-Balkema-de Haan), which for the exponential is the exponential itself -- with
per-stage ratio (delta / 0.25)^(1/(S-1)) (as the authors' code does).
Adaptation every ``adapt_every`` = 5 steps, from the mean achieved/target count r: within
1 +- ``tolerance`` (0.2) nothing changes; otherwise S moves by one (up when r > 1, down when
r < 1; 1 <= S <= ceil(log delta / log 0.5)) until S hits a bound or a move makes |ln r|
worse (undone); from then on the fitted target is corrected, delta_fit = delta * c with
ln c <- ln c - 0.3 clamp(r - 1, -1, 3) per off-target window, c kept in [1e-4, 1e4] (the
authors' code tunes the first-stage ratio for the same purpose; the stage count alone is
too coarse to land within the tolerance on real layers).
Send {(i, g_i) : u_i > thr} with residuals; payloads are all-gathered.
Defaults: ratio (delta) = 0.001, distribution = exponential, stages = 1 (initial),
first_stage_ratio = 0.25, sample_size = 100000, memory = true.

Cost: every fit is scale-equivariant (the exponential, gamma and generalized-Pareto
thresholds scale with the data), so the threshold on u = |g| / ||g|| times ||g|| is the
same rule fitted on |g| directly and no norm pass is needed (the gamma fit divides what it
is given by that data's own norm, so its eps sits at the paper's scale). The fits (all stages) run on a
strided sample of ``sample_size`` entries of |g| (0: the whole tensor, as in the paper);
then one pass on the whole tensor counts and gathers {i : |g_i| > thr}. The stage
adaptation still compares the count achieved on the whole tensor with the target.
"""

from __future__ import annotations

import math

import torch

from easgd_lightning.hooks.compressors.base import (
    check_choice,
    check_int,
    check_positive,
    check_ratio,
    num_selected,
    scratch_of,
)
from easgd_lightning.hooks.compressors.sparse import SparseCompressor, select_above, strided_sample

__all__ = [
    "SIDCoCompressor",
    "DISTRIBUTIONS",
    "exponential_threshold",
    "gamma_fit",
    "gamma_threshold",
    "gpareto_fit",
    "gpareto_threshold",
    "gammainccinv",
    "multistage_threshold",
    "later_stage_fit",
    "max_stages",
    "adapt",
]

DISTRIBUTIONS = ("exponential", "gamma", "gpareto")
#: keeps ln(u) finite at exact zeros in the gamma fit (double precision's epsilon)
GAMMA_EPS = 2.0**-52


def exponential_threshold(x: torch.Tensor, delta: float) -> float:
    """Exponential MLE (rate 1/mean): P(X > t) = exp(-t / mean) = delta."""
    return -float(x.double().mean()) * math.log(delta)


def gamma_fit(x: torch.Tensor) -> tuple[float, float]:
    """Gamma (shape a, scale b) by the closed-form MLE approximation (Minka / Thom) on
    u = x / ||x||_2 as the paper fits it, zeros included (ln(u + eps), eps = 2^-52, keeps
    them finite); b is returned on the scale of ``x``."""
    xd = x.double()
    norm = float(torch.linalg.vector_norm(xd))
    if norm == 0:
        return float("inf"), 0.0
    u = xd / norm
    mean = float(u.mean())
    s = math.log(mean) - float(torch.log(u + GAMMA_EPS).mean())
    if s <= 1e-12:
        return float("inf"), 0.0
    a = (3.0 - s + math.sqrt((s - 3.0) ** 2 + 24.0 * s)) / (12.0 * s)
    return a, mean / a * norm


def gammainccinv(a: float, q: float, iters: int = 100) -> float:
    """x with Q(a, x) = q (regularized upper incomplete gamma), safeguarded Newton."""
    if not 0.0 < q < 1.0:
        return 0.0 if q >= 1.0 else math.inf
    ta = torch.tensor(a, dtype=torch.float64)

    def qfun(x: float) -> float:
        return float(torch.special.gammaincc(ta, torch.tensor(x, dtype=torch.float64)))

    lga = math.lgamma(a)
    lo, hi = 0.0, max(1.0, a)
    while qfun(hi) > q:
        lo, hi = hi, hi * 2.0
        if hi > 1e300:
            return math.inf
    x = 0.5 * (lo + hi)
    for _ in range(iters):
        f = qfun(x) - q
        if f > 0:
            lo = x
        else:
            hi = x
        # dQ/dx = -x^(a-1) e^(-x) / Gamma(a)
        dens = math.exp((a - 1.0) * math.log(x) - x - lga) if x > 0 else 0.0
        nxt = x + f / dens if dens > 0 else 0.5 * (lo + hi)
        if not lo < nxt < hi:
            nxt = 0.5 * (lo + hi)
        if abs(nxt - x) <= 1e-14 * max(1.0, abs(x)):
            return nxt
        x = nxt
    return x


def gamma_threshold(x: torch.Tensor, delta: float) -> float:
    """Gamma fit, then thr = b Q^{-1}(a, delta)."""
    a, b = gamma_fit(x)
    if not math.isfinite(a):
        return float(x.double().mean())
    return b * gammainccinv(a, delta)


def gpareto_fit(x: torch.Tensor) -> tuple[float, float]:
    """Generalized Pareto by moments (Hosking & Wallis 1987): returns (k, sigma).

    With mean m and population variance v: k = (m^2/v - 1)/2, sigma = m (m^2/v + 1)/2;
    tail P(X > t) = (1 - k t / sigma)^(1/k) (k = -xi in the usual shape convention).
    """
    xd = x.double()
    m = float(xd.mean())
    v = float(xd.var(correction=0)) if xd.numel() > 1 else 0.0
    if v <= 0:
        return math.inf, m
    r = m * m / v
    return (r - 1.0) / 2.0, m * (r + 1.0) / 2.0


def gpareto_threshold(x: torch.Tensor, delta: float) -> float:
    """thr = sigma (1 - delta^k) / k (the -sigma ln(delta) limit at k = 0)."""
    k, sigma = gpareto_fit(x)
    if not math.isfinite(k):
        return sigma
    if abs(k) < 1e-9:
        return -sigma * math.log(delta)
    return sigma * (1.0 - delta**k) / k


_FITS = {
    "exponential": exponential_threshold,
    "gamma": gamma_threshold,
    "gpareto": gpareto_threshold,
}


def _fit_threshold(x: torch.Tensor, delta: float, distribution: str) -> float:
    """The ``distribution``'s threshold with tail mass ``delta`` on all of ``x`` (zeros
    included, as the paper fits |g|); inf when ``x`` has nothing above zero."""
    if x.numel() == 0 or not bool((x > 0).any()):
        return math.inf
    if delta >= 1.0:
        return 0.0
    return _FITS[distribution](x, delta)


def max_stages(delta: float) -> int:
    """Upper bound on the stage count: ceil(log delta / log 0.5)."""
    return max(1, math.ceil(math.log(delta) / math.log(0.5)))


def later_stage_fit(distribution: str) -> str:
    """The law the stages after the first refit on the shifted survivors: the exceedances
    over a high threshold are generalized Pareto (Pickands-Balkema-de Haan); the
    exponential is the GP of shape 0 and stays exponential (memoryless), the others
    refit a GP."""
    return "exponential" if distribution == "exponential" else "gpareto"


def multistage_threshold(
    u: torch.Tensor,
    delta: float,
    stages: int,
    distribution: str = "exponential",
    first_stage_ratio: float = 0.25,
) -> float:
    """SIDCo's S-stage threshold on u (see the module docstring).

    Stage 1 fits ``distribution`` on all of u for ``first_stage_ratio``; each later stage
    takes the survivors, shifts them by their minimum m, fits :func:`later_stage_fit` for
    the per-stage ratio (delta / first_stage_ratio)^(1 / (S - 1)) and sets thr = m + fit.
    """
    if stages <= 1 or delta >= first_stage_ratio:
        return _fit_threshold(u, delta, distribution)
    per_stage = (delta / first_stage_ratio) ** (1.0 / (stages - 1))
    later = later_stage_fit(distribution)
    thr = _fit_threshold(u, first_stage_ratio, distribution)
    survivors = u[u > thr]
    for _ in range(stages - 1):
        if survivors.numel() < 2:
            break
        low = survivors.min()
        step = _fit_threshold(survivors - low, per_stage, later)
        if not math.isfinite(step):
            break
        thr = float(low) + step
        survivors = survivors[survivors > thr]
    return thr


#: the target correction's gain and the upper clamp of (ratio - 1): ln c moves by at most
#: 0.3 * 3 = 0.9 per window when the density is too high (c / 2.46) and 0.3 when too low (c * 1.35)
CORRECTION_GAIN = 0.3
CORRECTION_CLAMP = 3.0


def adapt(state: dict, mean_ratio: float, tolerance: float, max_stage: int) -> None:
    """One adaptation after a window whose achieved / target count averaged ``mean_ratio``.

    Within 1 +- ``tolerance`` nothing changes. Otherwise, while the stage search is on, the
    stage count S moves by one (first up, or down from the maximum) and keeps moving that
    way while |ln ratio| shrinks; a move that makes it worse is undone and ends the search
    (so does a bound). After the search the fitted target is corrected instead:
    ln c <- ln c - ``CORRECTION_GAIN`` clamp(ratio - 1, -1, ``CORRECTION_CLAMP``) =
    ln c - 0.3 clamp(ratio - 1, -1, 3), c kept in [1e-4, 1e4], the fits using delta * c (an
    integral controller on the log density: the stage count alone is too coarse, and the
    response of a fitted threshold to delta is steep on light tails). State keys: stages,
    scale (c), searching, moved, prev_ratio.
    """
    stages = int(state["stages"])
    moved, prev = int(state.get("moved", 0)), state.get("prev_ratio")
    state["moved"], state["prev_ratio"] = 0, mean_ratio
    if abs(mean_ratio - 1.0) <= tolerance:
        return
    err = math.log(max(mean_ratio, 1e-9))
    if state.get("searching", True):
        if moved and prev is not None and abs(err) > abs(math.log(max(prev, 1e-9))):
            state["stages"], state["searching"] = stages - moved, False  # undo; measure again
            return
        step = moved or (1 if stages < max_stage else -1)
        nxt = min(max_stage, max(1, stages + step))
        if nxt != stages:
            state["stages"], state["moved"] = nxt, step
            return
        state["searching"] = False
    log_c = math.log(float(state.get("scale", 1.0)))
    log_c -= CORRECTION_GAIN * min(CORRECTION_CLAMP, max(-1.0, mean_ratio - 1.0))
    state["scale"] = math.exp(min(math.log(1e4), max(math.log(1e-4), log_c)))


class SIDCoCompressor(SparseCompressor):
    """SIDCo: closed-form sparsity thresholds from a fitted distribution.

    Args:
        ratio: target density delta, in (0, 1].
        distribution: ``exponential``, ``gamma`` or ``gpareto``.
        stages: initial number of stages (adapted every ``adapt_every`` steps).
        first_stage_ratio: density kept by the first of several stages (0.25).
        adapt_every: steps between stage-count adaptations (0: never adapt).
        tolerance: accepted relative error of the achieved count (0.2).
        sample_size: entries of the strided sample the fits run on (0: the whole tensor).
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "sidco"
    search_knob = "ratio"

    def __init__(
        self,
        ratio: float = 0.001,
        *,
        distribution: str = "exponential",
        stages: int = 1,
        first_stage_ratio: float = 0.25,
        adapt_every: int = 5,
        tolerance: float = 0.2,
        sample_size: int = 100_000,
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.ratio = check_ratio("compression.ratio", ratio)
        self.distribution = check_choice("compression.distribution", distribution, DISTRIBUTIONS)
        self.stages = check_int("compression.stages", stages, 1)
        self.first_stage_ratio = check_ratio("compression.first_stage_ratio", first_stage_ratio, allow_one=False)
        self.adapt_every = check_int("compression.adapt_every", adapt_every, 0)
        self.tolerance = check_positive("compression.tolerance", tolerance)
        self.sample_size = check_int("compression.sample_size", sample_size, 0)
        self.max_stages = max_stages(self.ratio)

    #: the fused exchange: one payload, one message and one decode per exchange, each
    #: tensor's threshold fitted on it alone with its own stage count and target correction
    fused_segments = True
    segment_state = True

    def select(self, flat: torch.Tensor, state: dict) -> torch.Tensor:
        return self.select_values(flat, state)[0]

    def fit_sample(self, flat: torch.Tensor) -> torch.Tensor:
        """|g| (float64) at the entries the fits use: a strided sample, or all of them."""
        if self.sample_size and flat.numel() > self.sample_size:
            sample = strided_sample(flat, self.sample_size).abs().double()
            if bool((sample > 0).any()):
                return sample
        return flat.abs().double()  # whole tensor (also when the sample saw only zeros)

    def select_values(self, flat: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        n = flat.numel()
        k = num_selected(n, self.ratio)
        if k >= n:
            return torch.arange(n, device=flat.device), flat
        mag = self.fit_sample(flat)
        state.setdefault("stages", min(self.stages, self.max_stages))
        delta = min(1.0, self.ratio * float(state.get("scale", 1.0)))
        thr = multistage_threshold(
            mag, delta, int(state["stages"]), self.distribution, self.first_stage_ratio
        )
        if not math.isfinite(thr):  # nothing but zeros
            return torch.empty(0, dtype=torch.long, device=flat.device), flat[:0]
        idx, val = select_above(flat, thr, expect=k, scratch=scratch_of(state))
        # adaptation from the achieved / target count
        hist = state.setdefault("achieved", [])
        hist.append(idx.numel() / k)
        if self.adapt_every and len(hist) >= self.adapt_every:
            adapt(state, sum(hist) / len(hist), self.tolerance, self.max_stages)
            hist.clear()
        state["last_threshold"] = thr
        return idx, val
