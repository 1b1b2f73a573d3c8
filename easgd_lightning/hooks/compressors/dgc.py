"""``dgc``: Deep Gradient Compression (Lin, Han, Mao, Wang, Dally, ICLR 2018).

Rule, per worker and tensor at step t (p workers, momentum m, density d_t):
  clip: g <- g * min(1, (C / sqrt(p)) / ||g||)                      (local clipping)
  u <- m u + g;  v <- v + u          (Nesterov: u <- m (u + g); v <- v + u + g)
  send {(i, v_i) : |v_i| >= thr_t} ~ d_t n entries; then v, u <- 0 at the sent entries
  (momentum factor masking). v is DGC's own residual, so ``memory`` must stay off.
Threshold: top-k of a strided ``sample_ratio`` (1%) sample; if more than 1.3 k pass, exact
top-k among the survivors; if fewer than 0.8 k, thr <- 0.8 thr, at most 10 rounds.
Warm-up: densities 0.25, 0.0625, 0.0156, 0.004 (equal shares of ``warmup_ratio_steps`` = 200,
or of ``warmup_ratio_epochs`` * steps per epoch once :meth:`DGCCompressor.set_steps_per_epoch`
is called; the paper warms up over 4 epochs), then ``ratio`` = 0.001 (99.9% sparsity). Defaults: momentum 0.9, nesterov false,
clip_norm null (off), min_numel 16384 (smaller tensors go dense), memory false.
With ``momentum > 0`` the momentum lives here: :meth:`DGCCompressor.bind_training` sets the
optimizer's to 0 (with a warning). Tensors under ``min_numel`` travel dense but keep the
momentum (:meth:`DGCCompressor.dense_part`: u <- m u + g, u sent; no accumulation, no masking).
Where the rule applies: clipping and the momentum correction act on gradients (``ddp``, and
any caller that does not bind the compressor). Under ``sync_easgd`` and ``local_sgd``
(:meth:`DGCCompressor.bind_exchange`) the exchanged quantity is an elastic or parameter
difference d, which the worker applies exactly while the center adds what arrives; a
momentum on d would hand the center sum_t d / (1 - m), ten times the pull at m = 0.9, so
there DGC is its sparsifier alone for every tensor: v <- v + d, the sampled threshold and
the warm-up, the sent entries zeroed in v (the residual); small tensors send d itself. The
warm-up there counts optimizer steps (the strategy's step counter), not exchanges, so
``warmup_ratio_steps`` and ``warmup_ratio_epochs`` mean the same as under ``ddp`` for any
``tau`` or period.
Cost: the threshold comes from the sample of the corrected v, computed from u, v, g at the
sampled entries alone; the momentum correction and the first round's count-and-gather are
then one pass over (u, v, g) (native kernel on CPU); a further round (rare) is one pass
that counts and gathers, and the masking writes only the sent entries of u and v.
Fused exchange (:mod:`easgd_lightning.hooks._fused`): :func:`dgc_segments` runs the rule on
every compressed tensor of the flat buffer in one native call, each tensor with its own
k = ceil(density * n), sample, threshold and rounds (the same numbers as on each tensor
alone); u and v are one flat buffer each. Where more than 1.3 k survive, both paths keep
the k largest with ties at the k-th magnitude going to the lowest indices
(:func:`k_largest`; ``torch.topk`` leaves that choice open, and a tie in a real gradient
once made the two paths part after 102 steps). With
``clip_norm`` each tensor's norm is still its own (:func:`clip_parts`), the small tensors'
too (the dense message's members).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from easgd_lightning.hooks.compressors import _native
from easgd_lightning.hooks.compressors.base import (
    Collective,
    check_bool,
    check_int,
    check_momentum,
    check_positive,
    check_ratio,
    num_selected,
    scratch_buffer,
    scratch_of,
)
from easgd_lightning.hooks.compressors.segments import Segments
from easgd_lightning.hooks.compressors.sparse import (
    SparseCompressor,
    select_above,
    sparse_payload,
)

__all__ = [
    "DGCCompressor",
    "DEFAULT_WARMUP_RATIOS",
    "dgc_density",
    "SelectRule",
    "dgc_select_values",
    "momentum_select_values",
    "dgc_segments",
    "clip_local",
    "momentum_correction",
    "momentum_dense",
    "release_optimizer_momentum",
]

#: DGC's warm-up densities (sparsity 75%, 93.75%, 98.4375%, 99.6%), then ``ratio``.
DEFAULT_WARMUP_RATIOS = (0.25, 0.0625, 0.0156, 0.004)


def dgc_density(step: int, ratio: float, warmup_ratios, warmup_ratio_steps: int) -> float:
    """Density at 0-based ``step``: equal shares of ``warmup_ratio_steps`` per warm-up stage."""
    stages = len(warmup_ratios)
    if stages == 0 or warmup_ratio_steps <= 0 or step >= warmup_ratio_steps:
        return ratio
    stage = min(stages - 1, step * stages // warmup_ratio_steps)
    return max(ratio, float(warmup_ratios[stage]))


def clip_local(g: torch.Tensor, clip_norm: float | None, world_size: int) -> torch.Tensor:
    """Local gradient clipping: scale g to norm <= clip_norm * p^(-1/2) (DGC section 3.3)."""
    if clip_norm is None:
        return g
    limit = clip_norm / math.sqrt(max(1, world_size))
    norm = torch.linalg.vector_norm(g)
    return g * torch.clamp(limit / (norm + 1e-12), max=1.0)


def clip_parts(flat: torch.Tensor, parts, clip_norm: float | None, world_size: int, out: torch.Tensor) -> torch.Tensor:
    """:func:`clip_local` of each (offset, length) part of the 1-D ``flat`` alone, into
    ``out`` (its other entries left as they are): the norms one reduction per part (the
    numbers of each tensor alone), the scales and the products one call each."""
    if clip_norm is None:
        return flat
    offsets, lengths = [int(o) for o, _ in parts], [int(n) for _, n in parts]
    if not offsets:
        return flat
    limit = clip_norm / math.sqrt(max(1, world_size))
    norms = torch.stack([torch.linalg.vector_norm(flat[o : o + n]) for o, n in zip(offsets, lengths)])
    scales = torch.clamp(limit / (norms + 1e-12), max=1.0)
    index = parts.index(flat.device) if isinstance(parts, Segments) else torch.cat(
        [torch.arange(o, o + n, device=flat.device) for o, n in zip(offsets, lengths)])
    out.index_copy_(0, index, flat[index] * scales.repeat_interleave(torch.tensor(lengths, device=flat.device)))
    return out


def momentum_correction(
    g: torch.Tensor, u: torch.Tensor, v: torch.Tensor, momentum: float, nesterov: bool
) -> None:
    """In place: u <- m u + g; v <- v + u (Nesterov: u <- m (u + g); v <- v + u + g)."""
    lib = _native.use(u, v, g)
    if lib is not None and u.shape == v.shape == g.shape:
        _native.fn(lib, "momentum", u.dtype)(
            u.data_ptr(), v.data_ptr(), g.data_ptr(), u.numel(), momentum, int(nesterov)
        )
        return
    if nesterov:
        u.add_(g).mul_(momentum)
        v.add_(u).add_(g)
    else:
        u.mul_(momentum).add_(g)
        v.add_(u)


def momentum_dense(
    g: torch.Tensor, u: torch.Tensor, momentum: float, nesterov: bool
) -> torch.Tensor:
    """A tensor that travels dense keeps DGC's momentum, without accumulation or masking
    (as the authors' code does for the layers it does not sparsify): in place
    u <- m u + g and send u (Nesterov: u <- m (u + g) and send u + g); returns a new tensor."""
    if nesterov:
        u.add_(g).mul_(momentum)
        return u + g
    u.mul_(momentum).add_(g)
    return u.clone()


def release_optimizer_momentum(optimizers) -> bool:
    """Set every param group's ``momentum`` (and ``nesterov``) to 0 / False, in place;
    True when some group had momentum (DGC applies its own, once)."""
    changed = False
    for opt in optimizers:
        for group in opt.param_groups:
            if group.get("momentum", 0):
                group["momentum"] = 0.0
                changed = True
            if group.get("nesterov"):
                group["nesterov"] = False
    return changed


def _sample_stride(n: int, sample_ratio: float) -> int:
    return max(1, n // min(n, max(1000, int(sample_ratio * n))))


def _sample_threshold(sample: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """The ceil(k s / n)-th largest of the |v| sample."""
    ks = max(1, min(sample.numel(), math.ceil(k * sample.numel() / n)))
    return torch.topk(sample, ks, sorted=False).values.min()


class SelectRule(NamedTuple):
    """DGC's threshold rule: the strided sample's share of the entries (1%), the rounds
    allowed (10), and the 1.3 k / 0.8 k bounds on the survivors."""

    sample_ratio: float = 0.01
    max_rounds: int = 10
    upper: float = 1.3
    lower: float = 0.8


#: the rule with DGC's own settings
DGC_RULE = SelectRule()


def k_largest(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest entries of ``mag``, ascending, ties at the k-th value
    going to the lowest positions: the segmented kernel's rule, so every path keeps the same
    set (``torch.topk`` leaves the choice among ties open)."""
    return torch.sort(torch.sort(mag, descending=True, stable=True).indices[:k]).values


def _rounds(v, k, thr, rule: SelectRule, scratch, first=None):
    """DGC's refinement: (indices, values, rounds); ``first`` = round 1's survivors if known."""
    idx, val = v[:0].long(), v[:0]
    rounds = 0
    for rounds in range(1, rule.max_rounds + 1):
        if rounds == 1 and first is not None:
            idx, val = first
        else:
            idx, val = select_above(v, thr, inclusive=True, expect=k, scratch=scratch)
        nnz = idx.numel()
        if nnz > rule.upper * k:
            top = k_largest(val.abs(), k)  # survivors are in index order: the lowest indices
            return idx[top], val[top], rounds
        if nnz >= rule.lower * k or rounds == rule.max_rounds:
            break
        thr = thr * rule.lower
    return idx, val, rounds


def dgc_select_values(
    v: torch.Tensor, k: int, rule: SelectRule = DGC_RULE, scratch: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """DGC's sampled threshold on the signed 1-D ``v``: (indices, values, rounds).

    thr = the ceil(k s / n)-th largest |v| of a strided sample of s = sample_ratio n entries
    (at least min(n, 1000)); if more than ``upper`` k entries pass, exact top-k among them;
    if fewer than ``lower`` k pass, thr <- ``lower`` * thr and recount (at most
    ``max_rounds``). Each round is one pass that counts and gathers the entries with
    |v| >= thr."""
    n = v.numel()
    if k >= n:
        return torch.arange(n, device=v.device), v.clone(), 0
    thr = _sample_threshold(v[:: _sample_stride(n, rule.sample_ratio)].abs(), k, n)
    return _rounds(v, k, thr, rule, scratch)


def momentum_select_values(
    g: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    momentum: float,
    nesterov: bool,
    k: int,
    rule: SelectRule = DGC_RULE,
    scratch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The momentum correction and :func:`dgc_select_values` with round 1 in the same pass.

    The sample of the corrected v is computed first from u, v, g at the sampled entries
    (the same arithmetic), so the threshold is known before the fused pass; the later
    rounds, when needed, are single passes over v as in :func:`dgc_select_values`.
    """
    n = v.numel()
    lib = _native.use(u, v, g)
    if lib is None or k >= n or not u.shape == v.shape == g.shape:
        momentum_correction(g, u, v, momentum, nesterov)
        return dgc_select_values(v, k, rule, scratch)
    stride = _sample_stride(n, rule.sample_ratio)
    sample = scratch_buffer(scratch, "sample", (n + stride - 1) // stride, v.dtype, v.device)
    _native.fn(lib, "momentum_sample", v.dtype)(
        u.data_ptr(), v.data_ptr(), g.data_ptr(), n, stride, momentum, int(nesterov),
        sample.data_ptr(),
    )
    thr = _sample_threshold(sample, k, n)
    cap = min(n, 2 * k + 1024)
    if scratch is not None and "sel_idx" in scratch:
        cap = min(n, max(cap, scratch["sel_idx"].numel()))
    idx = scratch_buffer(scratch, "sel_idx", cap, torch.int64, v.device)
    val = scratch_buffer(scratch, "sel_val", cap, v.dtype, v.device)
    c = int(_native.fn(lib, "momentum_select", v.dtype)(
        u.data_ptr(), v.data_ptr(), g.data_ptr(), n, momentum, int(nesterov), float(thr), cap,
        idx.data_ptr(), val.data_ptr(),
    ))
    first = (idx[:c], val[:c]) if c <= cap else None  # None: recount in round 1
    return _rounds(v, k, thr, rule, scratch, first)


def _segment_plan(segments: Segments, density: float, rule: SelectRule):
    """The per-segment inputs of ``dgc_segments`` at ``density``: (k, sample stride, ks)
    as int64 tensors, the output capacity, the largest sample."""
    ks_, strides, kss, cap, most = [], [], [], 0, 1
    for n in segments.lengths:
        k = num_selected(n, density)
        st = _sample_stride(n, rule.sample_ratio)
        s = (n + st - 1) // st
        ks_.append(k)
        strides.append(st)
        kss.append(max(1, min(s, math.ceil(k * s / n))))
        cap += n if k >= n else min(n, int(rule.upper * k) + 1)
        most = max(most, s)
    cols = [torch.tensor(c, dtype=torch.int64) for c in (ks_, strides, kss)]
    return (*segments.arrays(), *cols, max(cap, 1), most)


def _dgc_segments_eager(g, u, v, segments, density, momentum, nesterov, rule, scratch):
    """:func:`dgc_segments` as a loop of the per-tensor rule over the segments."""
    idx, val, rounds = [], [], 0
    for j, (off, n) in enumerate(segments):
        gs, us, vs = g[off : off + n], u[off : off + n], v[off : off + n]
        k = num_selected(n, density)
        sc = scratch.setdefault(("segment", j), {})
        if momentum > 0:
            i, x, r = momentum_select_values(gs, us, vs, momentum, nesterov, k, rule, sc)
        else:
            vs.add_(gs)
            i, x, r = dgc_select_values(vs, k, rule, sc)
        i, x = i.long(), x.clone()
        _native.zero_at(vs, i)
        _native.zero_at(us, i)
        idx.append(i + off)
        val.append(x)
        rounds = max(rounds, r)
    return torch.cat(idx), torch.cat(val), rounds


def dgc_segments(
    g: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    segments: Segments,
    density: float,
    momentum: float,
    nesterov: bool,
    rule: SelectRule = DGC_RULE,
    scratch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """DGC's selection on every segment of the flat g, u, v alone, at once (momentum > 0:
    :func:`momentum_select_values`, else v <- v + g and :func:`dgc_select_values`, with
    k = ceil(density * n) of each segment), then u, v <- 0 at the sent entries.

    Returns (indices relative to the buffer, values, the most rounds a segment took).
    One native call where the kernels apply, else a loop over the segments."""
    scratch = {} if scratch is None else scratch
    lib = _native.use(u, v, g)
    if lib is None:
        return _dgc_segments_eager(g, u, v, segments, density, momentum, nesterov, rule, scratch)
    off, lens, k, stride, ks, cap, most = segments.cached(("dgc", density, rule), lambda: _segment_plan(segments, density, rule))
    idx = scratch_buffer(scratch, "seg_idx", cap, torch.int64, "cpu")
    val = scratch_buffer(scratch, "seg_val", cap, v.dtype, "cpu")
    rounds = scratch_buffer(scratch, "seg_rounds", len(segments), torch.int64, "cpu")
    sample = scratch_buffer(scratch, "seg_sample", most, v.dtype, "cpu")
    work = scratch_buffer(scratch, "seg_work", most, torch.int32 if v.element_size() == 4 else torch.int64, "cpu")
    c = int(_native.fn(lib, "dgc_segments", v.dtype)(
        u.data_ptr(), v.data_ptr(), g.data_ptr(), len(segments), off.data_ptr(), lens.data_ptr(),
        k.data_ptr(), stride.data_ptr(), ks.data_ptr(), momentum, int(nesterov), int(momentum == 0),
        rule.max_rounds, rule.upper, rule.lower, cap, idx.data_ptr(), val.data_ptr(),
        rounds.data_ptr(), sample.data_ptr(), work.data_ptr(),
    ))
    if c < 0:
        raise MemoryError("dgc_segments: the native selection ran out of memory")
    return idx[:c], val[:c], int(rounds.max())


class DGCCompressor(SparseCompressor):
    """Deep Gradient Compression (momentum correction, clipping, masking, warm-up).

    Args:
        ratio: final density (fraction of entries sent), in (0, 1]; 0.001 = 99.9% sparsity.
        momentum: momentum m of the corrected accumulation (0 disables it).
        nesterov: Nesterov form of the momentum correction.
        clip_norm: local clipping threshold C before the p^(-1/2) scaling (null: off).
        warmup_ratios: warm-up densities, one stage each.
        warmup_ratio_steps: total steps of the warm-up (equal shares per stage).
        warmup_ratio_epochs: warm-up length in epochs; used instead of ``warmup_ratio_steps`` once
            :meth:`set_steps_per_epoch` is called.
        sample_ratio: fraction of entries in the threshold sample (DGC: 1%).
        max_rounds: threshold refinement rounds (DGC: 10).
        min_numel, memory: attach-point policies; ``memory`` must be false (v is the
            residual).
    """

    name = "dgc"
    search_knob = "ratio"
    default_memory = False
    allows_memory = False  # v, the accumulated velocity, is DGC's residual
    worker_state = ("u", "v")  # momentum correction and accumulation: this worker's own

    def __init__(
        self,
        ratio: float = 0.001,
        *,
        momentum: float = 0.9,
        nesterov: bool = False,
        clip_norm: float | None = None,
        warmup_ratios=DEFAULT_WARMUP_RATIOS,
        warmup_ratio_steps: int = 200,
        warmup_ratio_epochs: float | None = None,
        sample_ratio: float = 0.01,
        max_rounds: int = 10,
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.ratio = check_ratio("compression.ratio", ratio)
        self.momentum = check_momentum("compression.momentum", momentum)
        self.nesterov = check_bool("compression.nesterov", nesterov)
        self.clip_norm = None if clip_norm is None else check_positive("compression.clip_norm", clip_norm)
        self.warmup_ratios = tuple(
            check_ratio("compression.warmup_ratios[]", r) for r in (warmup_ratios or ())
        )
        self.warmup_ratio_steps = check_int("compression.warmup_ratio_steps", warmup_ratio_steps, 0)
        self.warmup_ratio_epochs = (
            None if warmup_ratio_epochs is None
            else check_positive("compression.warmup_ratio_epochs", warmup_ratio_epochs, allow_zero=True)
        )
        self.sample_ratio = check_ratio("compression.sample_ratio", sample_ratio)
        self.max_rounds = check_int("compression.max_rounds", max_rounds, 1)
        self._rule = SelectRule(self.sample_ratio, self.max_rounds)
        self._steps_per_epoch: int | None = None
        #: clipping and momentum correction apply (gradients); False under the elastic
        #: strategies (:meth:`bind_exchange`)
        self.gradient_mode = True
        #: 0-based optimizer step for the warm-up, when a strategy gives one
        self._step_of = None

    @property
    def _momentum(self) -> float:
        """The momentum the rule applies now: 0 outside gradient mode."""
        return self.momentum if self.gradient_mode else 0.0

    def dense_part(self, tensor: torch.Tensor, state: dict, world_size: int) -> torch.Tensor:
        """What a tensor under ``min_numel`` sends in the dense all-reduce: the clipped
        gradient through :func:`momentum_dense` (its momentum u lives in ``state``); outside
        gradient mode (elastic differences) the tensor itself, as the large tensors then
        send their accumulated difference without momentum."""
        if not self.gradient_mode:
            return tensor
        flat = tensor.reshape(-1)
        members = state.get("members")  # the fused exchange's dense message: each its own norm
        if members and self.clip_norm is not None:
            parts = [(off, n) for _, off, n in members]
            flat = clip_parts(flat, parts, self.clip_norm, world_size, flat.clone())
        else:
            flat = clip_local(flat, self.clip_norm, world_size)
        if self.momentum == 0:
            return flat.clone().view_as(tensor)
        u = state.get("u")
        if u is None or u.shape != flat.shape or u.device != flat.device or u.dtype != flat.dtype:
            u = state["u"] = torch.zeros_like(flat)
        return momentum_dense(flat, u, self.momentum, self.nesterov).view_as(tensor)

    def _adopt_epoch_length(self, steps_per_epoch: int | None) -> list[str]:
        """``warmup_ratio_epochs`` in optimizer steps; the warning to log when the epoch
        length is unknown."""
        if steps_per_epoch:
            self.set_steps_per_epoch(int(steps_per_epoch))
        elif self.warmup_ratio_epochs is not None:
            return [
                "compression.warmup_ratio_epochs: the epoch length is unknown, so the DGC "
                f"warm-up uses compression.warmup_ratio_steps={self.warmup_ratio_steps}"
            ]
        return []

    def bind_training(self, optimizers, steps_per_epoch: int | None) -> list[str]:
        """Adopt a training run (called by the strategy before the first step): the epochs
        of ``warmup_ratio_epochs`` become ``steps_per_epoch`` optimizer steps each, and with
        ``momentum > 0`` the optimizers' own momentum is set to 0 (DGC applies its own;
        both would compound). Returns the warnings to log."""
        self.gradient_mode = True
        notes = self._adopt_epoch_length(steps_per_epoch)
        if self.momentum > 0 and release_optimizer_momentum(optimizers):
            notes.append(
                f"compression=dgc applies its own momentum (compression.momentum={self.momentum}); "
                "the optimizer's momentum was set to 0 so it is not applied twice"
            )
        return notes

    def bind_exchange(self, steps_per_epoch: int | None, step_of=None) -> list[str]:
        """Adopt an elastic exchange (``sync_easgd``, ``local_sgd``; called before the first
        step): no clipping and no momentum correction (see the module docstring), the
        optimizer's momentum is left alone, and the warm-up counts ``step_of()`` (the
        0-based optimizer step) instead of exchanges. ``warmup_ratio_epochs`` becomes
        ``steps_per_epoch`` optimizer steps per epoch. Returns the warnings to log."""
        self.gradient_mode = False
        self._step_of = step_of
        notes = self._adopt_epoch_length(steps_per_epoch)
        if self.momentum > 0 or self.clip_norm is not None:
            notes.append(
                "compression=dgc exchanges elastic differences here, not gradients: its momentum "
                "correction and local clipping are off (the optimizer keeps its own momentum)"
            )
        return notes

    def set_steps_per_epoch(self, steps: int) -> None:
        """Turn ``warmup_ratio_epochs`` into steps (called by a strategy that knows the epoch size)."""
        self._steps_per_epoch = check_int("compression.steps_per_epoch", steps, 1)

    @property
    def total_warmup_steps(self) -> int:
        """Warm-up length in steps (``warmup_ratio_epochs`` * steps per epoch when both are known)."""
        if self.warmup_ratio_epochs is not None and self._steps_per_epoch is not None:
            return int(round(self.warmup_ratio_epochs * self._steps_per_epoch))
        return self.warmup_ratio_steps

    def density(self, step: int) -> float:
        """Density used at 0-based ``step``."""
        return dgc_density(step, self.ratio, self.warmup_ratios, self.total_warmup_steps)

    def select(self, flat: torch.Tensor, state: dict) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError("DGC selects inside compress (it sparsifies v, not g)")

    def compress(self, tensor: torch.Tensor, state: dict):
        flat = tensor.reshape(-1)
        step = int(state.get("step", 0))
        state["step"] = step + 1
        if self._step_of is not None:  # elastic: the warm-up counts optimizer steps
            step = max(0, int(self._step_of()))
        g = flat
        if self.gradient_mode:
            g = clip_local(flat, self.clip_norm, int(state.get("world_size", 1)))
        v = state.get("v")
        if v is None or v.shape != flat.shape or v.device != flat.device:
            v = state["v"] = torch.zeros_like(flat)
            state["u"] = torch.zeros_like(flat)
        u = state["u"]
        density = self.density(step)
        k = num_selected(flat.numel(), density)
        if self._momentum > 0:
            idx, val, rounds = momentum_select_values(
                g, u, v, self.momentum, self.nesterov, k, self._rule, scratch_of(state)
            )
        else:
            v.add_(g)
            idx, val, rounds = dgc_select_values(v, k, self._rule, scratch_of(state))
        payload = sparse_payload(v, idx, val)  # packs a copy of the values
        # momentum factor masking: the sent entries restart from zero
        _native.zero_at(v, idx)
        _native.zero_at(u, idx)
        state["last_nnz"] = int(idx.numel())
        state["last_density"] = density
        state["last_rounds"] = rounds
        return payload

    fused_segments = True

    def compress_segments(self, flat: torch.Tensor, segments: Segments, state: dict):
        """:meth:`compress` for every segment of the flat buffer at once (u, v: one flat
        buffer each in ``state``; one step counter for the exchange)."""
        step = int(state.get("step", 0))
        state["step"] = step + 1
        if self._step_of is not None:
            step = max(0, int(self._step_of()))
        v = state.get("v")
        if v is None or v.shape != flat.shape or v.device != flat.device:
            v = state["v"] = torch.zeros_like(flat)
            state["u"] = torch.zeros_like(flat)
        density = self.density(step)
        if self.gradient_mode and self.clip_norm is not None:
            clipped = scratch_buffer(scratch_of(state), "clipped", flat.numel(), flat.dtype, flat.device)
            flat = clip_parts(flat, segments, self.clip_norm, int(state.get("world_size", 1)), clipped)
        idx, val, rounds = dgc_segments(
            flat, state["u"], v, segments, density, self._momentum, self.nesterov, self._rule, scratch_of(state)
        )
        state["last_nnz"] = int(idx.numel())
        state["last_density"] = density
        state["last_rounds"] = rounds
        return sparse_payload(v, idx, val)

    def _launch(self, tensor: torch.Tensor, state: dict, collective: Collective):
        state["world_size"] = collective.world_size
        return super()._launch(tensor, state, collective)
