"""DiLoCo and Streaming DiLoCo: an outer optimizer over pseudo-gradients, in fragments.

**DiLoCo** (Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam, Shen,
"DiLoCo: Distributed Low-Communication Training of Language Models", 2023, arXiv
2311.08105). Every worker i starts a round from the shared weights theta, takes H =
``tau`` inner steps with the module's own optimizer (its state stays on the worker), and
then::

    delta_i = theta - theta_i                    the pseudo-gradient
    Delta   = mean_i delta_i                     one all-reduce (metered as ``pseudo_gradient``)
    theta   <- OuterOpt(theta, grad = Delta)     SGD, Nesterov momentum (paper: lr 0.7, mu 0.9)
    theta_i <- theta

The outer step is PyTorch's SGD arithmetic (``b <- mu b + g``; ``g + mu b`` with Nesterov,
else ``b``; ``theta <- theta - lr * step``). With ``outer_lr=1, outer_momentum=0`` (or
``outer=average``) the rule is theta <- mean_i theta_i, and that is what is computed (the
all-reduce of theta_i / p, as ``local_sgd`` does), so it gives local SGD's bits.

**Streaming DiLoCo** (Douillard et al., "Streaming DiLoCo with overlapping communication",
2025, arXiv 2501.18512). The elastic tensors (parameters, then floating-point buffers) are
cut into F = ``fragments`` contiguous fragments of about equal size at tensor boundaries.
Every tau / F inner steps one fragment is synchronised, in turn, so fragment f is
synchronised at the steps t with ``t = (f + 1) * tau / F  (mod tau)`` and each fragment
every tau steps; one exchange carries 1/F of the model. With ``fragment_sync_delay`` = d,
fragment f's pseudo-gradient is formed and its all-reduce started d steps before its
synchronisation step; the inner steps go on meanwhile (all fragments train), and at the
synchronisation step the outer update is applied and mixed with the locally advanced
fragment::

    theta_f      <- OuterOpt(theta_f, mean_i delta_i,f)    delta from d steps ago
    theta_i,f    <- lerp(theta_f, theta_i,f, a) = (1 - a) theta_f + a theta_i,f

with a = ``fragment_update_alpha`` (0: the d local steps on that fragment are replaced by
the new global fragment; the paper's choice). d < tau / F.

**Compressed pseudo-gradients** (``compression=X``): the exchanged quantity is
u_i = theta_i - theta (= -delta_i) of each fragment, compressed per tensor with error
feedback (the residual is kept per fragment); the outer step takes -sum_i C(u_i) / p.
fp16 / bf16 (OpenDiLoCo, arXiv 2407.07852), ``qsgd`` 4-bit (Streaming DiLoCo), ``topk``
with error feedback, and ``sparseloco`` (top-k then 2-bit values, SparseLoCo, arXiv
2508.15706).

**Elastic outer rule** (``outer=elastic``; this project's bridge to EASGD, Zhang,
Choromanska, LeCun, NeurIPS 2015): at a fragment's synchronisation step the fragment is
pulled toward the centre instead of being reset, with the Sync EASGD arithmetic at the
point where that step's gradient was computed::

    d_i = alpha (x_i,f - c_f);   x_i,f <- opt_step(x_i,f) - d_i;   c_f <- c_f + sum_i d_i

With one fragment this is ``sync_easgd`` with the same tau and alpha, bit for bit. The
centre's sum may arrive up to d = ``fragment_sync_delay`` steps later (it is not needed
before the fragment's next difference).

**Inner optimizer state** stays local and is not reset at a round (as in the paper): its
moments keep describing the worker's own trajectory.

**End of fit**: a synchronisation in flight is completed at its step's rule; then every
fragment with inner steps not yet synchronised takes one last outer step (so the
deliverable holds every worker's work, as local SGD averages a last partial round);
``outer=elastic`` ends on the centre, as Sync EASGD does. The module then holds theta.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import override

from easgd_lightning.hooks.elastic import PendingSum, start_exchange_sum
from easgd_lightning.strategies import elastic
from easgd_lightning.strategies.base import CenterStrategy
from easgd_lightning.strategies.registry import register_strategy
from easgd_lightning.utils.checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_momentum,
    is_int,
)

__all__ = [
    "DiLoCoStrategy",
    "OUTER_RULES",
    "outer_sgd_step",
    "fragment_bounds",
    "fragment_to_prepare",
    "fragment_to_sync",
    "merge_fragment",
    "validate_diloco_options",
]

#: accepted values of ``strategy.outer``
OUTER_RULES = ("nesterov", "average", "elastic")


# ---------------------------------------------------------------------- pure math
def outer_sgd_step(
    theta: torch.Tensor,
    momentum: torch.Tensor | None,
    grad: torch.Tensor,
    lr: float,
    mu: float,
    nesterov: bool,
) -> torch.Tensor:
    """One outer SGD step in place on ``theta`` (PyTorch's SGD rule, no dampening).

    ``b <- mu * b + g``; ``step = g + mu * b`` (Nesterov) or ``b``; ``theta <- theta - lr * step``.
    With ``mu == 0`` the step is ``g`` and ``momentum`` is not read. The buffer starts at
    zero, so the first step's ``b`` is ``g`` (PyTorch clones ``g``: the same values).
    """
    if mu != 0:
        momentum.mul_(mu).add_(grad)
        step = grad.add(momentum, alpha=mu) if nesterov else momentum
    else:
        step = grad
    return theta.add_(step, alpha=-lr)


def merge_fragment(global_new: torch.Tensor, local: torch.Tensor, alpha: float) -> torch.Tensor:
    """Streaming DiLoCo's mix: ``(1 - alpha) * global_new + alpha * local`` (``torch.lerp``),
    written into ``local``; alpha = 0 is a copy of ``global_new``."""
    if alpha == 0:
        return local.copy_(global_new)
    return local.copy_(torch.lerp(global_new, local, alpha))


def fragment_bounds(numels: list[int], fragments: int) -> list[tuple[int, int]]:
    """Cut tensors of sizes ``numels`` (in order) into ``fragments`` contiguous runs of whole
    tensors of about equal total size; returns each run's ``(start, end)`` tensor indices.

    Boundary k is the tensor boundary nearest to k / F of the total, kept strictly
    increasing so that no fragment is empty.

    Raises:
        ValueError: more fragments than tensors.
    """
    n = len(numels)
    if fragments > n:
        raise ValueError(
            f"strategy.fragments={fragments} is more than the model's {n} tensors; "
            f"choose at most {n}"
        )
    cum = [0]
    for k in numels:
        cum.append(cum[-1] + int(k))
    total = cum[-1]
    cuts = [0]
    for k in range(1, fragments):
        target = total * k / fragments
        lo, hi = cuts[-1] + 1, n - (fragments - k)  # leave a tensor for each fragment after
        best = min(range(lo, hi + 1), key=lambda j: (abs(cum[j] - target), j))
        cuts.append(best)
    cuts.append(n)
    return [(cuts[i], cuts[i + 1]) for i in range(fragments)]


def fragment_to_sync(step: int, tau: int, fragments: int) -> int | None:
    """The fragment synchronised after the 1-based inner step ``step`` (None: none).

    One fragment every ``tau / fragments`` steps, in turn from fragment 0."""
    slot = tau // fragments
    if step < slot or step % slot:
        return None
    return (step // slot - 1) % fragments


def fragment_to_prepare(step: int, tau: int, fragments: int, delay: int) -> int | None:
    """The fragment whose all-reduce starts after inner step ``step``: the one synchronised
    ``delay`` steps later (None: none)."""
    return fragment_to_sync(step + delay, tau, fragments)


def validate_diloco_options(
    tau: Any,
    outer: Any,
    outer_lr: Any,
    outer_momentum: Any,
    outer_nesterov: Any,
    fragments: Any,
    fragment_sync_delay: Any,
    fragment_update_alpha: Any,
) -> dict[str, Any]:
    """Check ``strategy.*`` of ``diloco``; returns the options normalised (public names).

    Raises:
        ValueError: one line naming the key and what is allowed.
    """
    tau = check_int("strategy.tau", tau)
    check_choice("strategy.outer", outer, OUTER_RULES)
    outer_lr = check_float("strategy.outer_lr", outer_lr, 0.0, math.inf, lo_open=True, hi_open=True)
    outer_momentum = check_momentum("strategy.outer_momentum", outer_momentum)
    check_bool("strategy.outer_nesterov", outer_nesterov)
    if outer_nesterov and outer_momentum == 0 and outer == "nesterov":
        outer_nesterov = False  # Nesterov without momentum is plain SGD
    fragments = check_int("strategy.fragments", fragments)
    if tau % fragments:
        raise ValueError(
            f"strategy.tau={tau} must be a multiple of strategy.fragments={fragments} "
            "(one fragment is synchronised every tau / fragments steps)"
        )
    slot = tau // fragments
    delay = fragment_sync_delay
    if not is_int(delay) or not 0 <= delay < slot:
        raise ValueError(
            f"strategy.fragment_sync_delay must be an integer in [0, tau / fragments = {slot}), got {delay!r}"
        )
    alpha = check_float("strategy.fragment_update_alpha", fragment_update_alpha, 0.0, 1.0)
    return {
        "tau": tau,
        "outer": outer,
        "outer_lr": outer_lr,
        "outer_momentum": outer_momentum,
        "outer_nesterov": outer_nesterov,
        "fragments": fragments,
        "fragment_sync_delay": delay,
        "fragment_update_alpha": alpha,
    }


class _Done(PendingSum):
    """An exchange whose result is already here (restored from a checkpoint)."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__(lambda: value)


# ---------------------------------------------------------------------- strategy
@register_strategy(
    "diloco",
    options=(
        "tau", "outer", "outer_lr", "outer_momentum", "outer_nesterov", "alpha",
        "fragments", "fragment_sync_delay", "fragment_update_alpha",
    ),
)
class DiLoCoStrategy(CenterStrategy):
    """DiLoCo: tau inner steps, then an outer optimizer step on the averaged pseudo-gradient
    (``strategy="diloco"``).

    Args:
        tau: inner steps per round (H; paper 500 for LLM pre-training).
        outer: ``nesterov`` (outer SGD with momentum), ``average`` (theta <- mean_i theta_i:
            local SGD) or ``elastic`` (EASGD's force as the outer update).
        outer_lr: the outer learning rate (paper 0.7).
        outer_momentum: the outer momentum mu in [0, 1) (paper 0.9).
        outer_nesterov: Nesterov momentum (paper: true).
        alpha: the elastic moving rate for ``outer=elastic`` (default: beta = p * alpha = 0.9).
        fragments: F, Streaming DiLoCo's fragments (tau must be a multiple of F).
        fragment_sync_delay: d, inner steps a fragment's all-reduce overlaps (d < tau / F).
        fragment_update_alpha: a in [0, 1], the weight of the local fragment in the merge.
        compression: a compressor for the pseudo-gradients (error feedback per fragment).
        memory: error-feedback memory (default: the compressor's own choice).
        comm: the ``comm`` layout (fusion buckets, ``hierarchy=node``); None: the defaults.
    """

    strategy_name = "diloco"
    comm_kind = "pseudo_gradient"
    min_world_size = 1
    hierarchical = True

    def __init__(
        self,
        tau: int = 16,
        outer: str = "nesterov",
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        outer_nesterov: bool = True,
        alpha: float | None = None,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        compression: Any = None,
        memory: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(compression=compression, **kwargs)
        self.options = validate_diloco_options(
            tau, outer, outer_lr, outer_momentum, outer_nesterov,
            fragments, fragment_sync_delay, fragment_update_alpha,
        )
        if alpha is not None and outer != "elastic":
            raise ValueError(f"strategy.alpha applies to strategy.outer=elastic only, got outer={outer}")
        if alpha is not None:
            check_float("strategy.alpha", alpha, 0.0, 1.0, lo_open=True, hi_open=True)
        self._alpha_opt = alpha
        self._alpha: float | None = None
        self._memory = memory
        self._compress_state: dict = {}
        self._bounds: list[tuple[int, int]] = []  # per fragment: flat (start, end)
        self._shapes: list[list[torch.Size]] = []  # per fragment: its tensors' shapes
        self._outer_buf: torch.Tensor | None = None  # row 0: theta (the centre); row 1: momentum
        self._momentum: torch.Tensor | None = None
        self._pending: dict[int, PendingSum] = {}
        self._due: dict[int, int] = {}  # elastic: the step by which fragment f's sum is applied
        self._scratch: dict[int, torch.Tensor] = {}
        self._synced_at: list[int] = []  # per fragment: the inner step of its last sync
        self._syncs: list[int] = []  # per fragment: outer steps taken
        self._restored: dict | None = None

    # ------------------------------------------------------------------ properties
    @property
    def tau(self) -> int:
        return self.options["tau"]

    @property
    def outer(self) -> str:
        return self.options["outer"]

    @property
    def fragment_numels(self) -> list[int]:
        """Elements of each fragment (one exchange carries one fragment)."""
        return [b - a for a, b in self._bounds]

    @property
    def _averages(self) -> bool:
        """The outer step is theta <- mean_i theta_i (``average``, or SGD with lr 1, mu 0)."""
        o = self.options
        return o["outer"] == "average" or (
            o["outer"] == "nesterov" and o["outer_lr"] == 1.0 and o["outer_momentum"] == 0.0
        )

    # ------------------------------------------------------------------ set-up
    @override
    def _validate_world(self, world_size: int) -> None:
        if self.outer == "elastic":
            self._alpha = elastic.resolve_alpha(world_size=world_size, alpha=self._alpha_opt)

    @override
    def validate_world_size(self, world_size: int) -> None:
        super().validate_world_size(world_size)
        self._validate_world(world_size)

    def validate_module(self, module: torch.nn.Module) -> None:
        """Before launch: the module has at least ``fragments`` elastic tensors.

        Raises:
            ValueError: naming ``strategy.fragments`` and the most the module allows.
        """
        tensors = list(module.parameters()) + [b for b in module.buffers() if b.is_floating_point()]
        fragment_bounds([t.numel() for t in tensors], self.options["fragments"])

    @override
    def _on_center_ready(self) -> None:
        """Lay out the fragments and hold theta and the outer momentum in one flat buffer."""
        tensors = self._elastic_tensors()
        runs = fragment_bounds([t.numel() for t in tensors], self.options["fragments"])
        offsets = [0]
        for t in tensors:
            offsets.append(offsets[-1] + t.numel())
        self._bounds = [(offsets[a], offsets[b]) for a, b in runs]
        self._shapes = [[t.shape for t in tensors[a:b]] for a, b in runs]
        rows = 2 if self._uses_momentum() else 1
        buf = torch.zeros(rows, self._center.numel(), dtype=self._center.dtype, device=self._center.device)
        buf[0].copy_(self._center)
        restored = self._restored or {}
        if rows == 2 and restored.get("momentum") is not None:
            buf[1].copy_(restored["momentum"])
        self._outer_buf, self._center = buf, buf[0]
        self._momentum = buf[1] if rows == 2 else None
        count = self.options["fragments"]
        self._synced_at = list(restored.get("synced_at") or [self._local_steps] * count)
        self._syncs = list(restored.get("syncs") or [0] * count)
        for f, value in (restored.get("pending") or {}).items():
            self._pending[int(f)] = _Done(value.to(self.root_device, self._center.dtype))
        self._due = {int(f): int(s) for f, s in (restored.get("due") or {}).items()}
        self._restored = None

    def _uses_momentum(self) -> bool:
        return self.outer == "nesterov" and not self._averages and self.options["outer_momentum"] != 0

    # ------------------------------------------------------------------ the step
    @override
    def _exchange_step(self, take_step: Callable[..., Any], optimizer: Optimizer) -> Any:
        if self.outer == "elastic":
            return self._elastic_step(take_step)
        out = take_step()
        self._after_inner_step(self._local_steps)
        return out

    def _after_inner_step(self, step: int) -> None:
        o = self.options
        f = fragment_to_prepare(step, o["tau"], o["fragments"], o["fragment_sync_delay"])
        if f is not None:
            self._prepare(f)
        f = fragment_to_sync(step, o["tau"], o["fragments"])
        if f is not None:
            self._perform(f, step)

    def _buffer(self, f: int) -> torch.Tensor:
        a, b = self._bounds[f]
        buf = self._scratch.get(f)
        if buf is None or buf.numel() != b - a or buf.dtype != self._center.dtype:
            buf = self._scratch[f] = torch.empty(b - a, dtype=self._center.dtype, device=self._center.device)
        return buf

    @torch.no_grad()
    def _prepare(self, f: int) -> None:
        """Start fragment f's exchange: theta_i,f / p summed (averaging), or the compressed
        or dense sum of u_i = theta_i,f - theta_f."""
        a, b = self._bounds[f]
        x = self._elastic_flat()[a:b]
        buf = self._buffer(f)
        if self._averages and self._compression is None:
            torch.div(x, self.world_size, out=buf)
        else:
            torch.sub(x, self._center[a:b], out=buf)
        self._start_sum(f, buf)

    def _start_sum(self, f: int, buf: torch.Tensor) -> None:
        """Start summing fragment f's ``buf`` over the ranks (compressed with the fragment's
        own residuals when a compressor is set); it is pending until its step."""
        self._pending[f] = start_exchange_sum(
            buf,
            compressor=self._compression,
            memory=self._memory,
            state=self._compress_state,
            kind=self.comm_kind,
            key=f"fragment{f}",
            shapes=self._shapes[f],
            layout=self._comm,
        )

    @torch.no_grad()
    def _perform(self, f: int, step: int) -> None:
        """Finish fragment f's exchange: the outer step on theta_f, then the merge into the
        worker's fragment."""
        total = self._pending.pop(f).wait()
        a, b = self._bounds[f]
        theta = self._center[a:b]
        o, p = self.options, self.world_size
        if self._averages and self._compression is None:
            theta.copy_(total)  # the all-reduce of theta_i / p is the mean
        elif self._averages:
            theta.add_(total / p)  # c + sum_i C(u_i) / p, as local SGD's compressed average
        else:
            grad = total / -p  # mean_i delta_i = -mean_i u_i (exact negation)
            momentum = None if self._momentum is None else self._momentum[a:b]
            outer_sgd_step(theta, momentum, grad, o["outer_lr"], o["outer_momentum"], o["outer_nesterov"])
        x = self._elastic_flat()
        merge_fragment(theta, x[a:b], o["fragment_update_alpha"])
        self._store_elastic(x)
        self._synced_at[f] = step
        self._syncs[f] += 1

    # ------------------------------------------------------------------ elastic outer rule
    def _elastic_step(self, take_step: Callable[..., Any]) -> Any:
        step = self._local_steps
        for g, due in list(self._due.items()):
            if due < step:  # the sum was due after an earlier step
                self._finish_elastic(g)
        f = fragment_to_sync(step, self.tau, self.options["fragments"])
        if f is None:
            return take_step()
        formed: list[bool] = []
        out = take_step(after_closure=lambda: formed.append(self._elastic_difference(f)))
        if not formed:
            raise RuntimeError(
                "diloco (outer=elastic): the optimizer stepped without calling its closure, so the "
                "elastic difference could not be formed at the gradient's point"
            )
        a, b = self._bounds[f]
        with torch.no_grad():
            x = self._elastic_flat()
            elastic.apply_elastic_pull(x[a:b], self._scratch[f])
            self._store_elastic(x)
        self._start_sum(f, self._scratch[f])
        self._due[f] = step + self.options["fragment_sync_delay"]
        self._synced_at[f] = step
        self._syncs[f] += 1
        if self.options["fragment_sync_delay"] == 0:
            self._finish_elastic(f)
        return out

    @torch.no_grad()
    def _elastic_difference(self, f: int) -> bool:
        """After forward + backward, before the update: c_f += any sum in flight, then
        d = alpha (x_f - c_f) at the point where the gradient was computed."""
        self._finish_elastic(f)
        a, b = self._bounds[f]
        elastic.elastic_difference(self._elastic_flat()[a:b], self._center[a:b], self._alpha, out=self._buffer(f))
        return True

    def _finish_elastic(self, f: int) -> None:
        pending = self._pending.pop(f, None)
        self._due.pop(f, None)
        if pending is not None:
            a, b = self._bounds[f]
            elastic.apply_center_update(self._center[a:b], pending.wait())

    @override
    def _complete_exchange(self) -> None:
        """Elastic: add every sum in flight to the centre (exact at any time: the centre is
        read only when a difference is formed). DiLoCo's pending fragments are finished at
        their own step (their merge reads the worker's parameters then)."""
        if self.outer == "elastic":
            for f in list(self._pending):
                self._finish_elastic(f)

    @override
    def _drop_exchange(self) -> None:
        self._pending.clear()
        self._due.clear()

    # ------------------------------------------------------------------ end of fit
    @override
    def finish_exchange(self) -> None:
        if self._center is not None:
            self._swap_out()
            if dist.is_available() and dist.is_initialized() and self.outer != "elastic":
                self._finish()
        super().finish_exchange()

    @torch.no_grad()
    def _finish(self) -> None:
        """Perform what is in flight, then one last outer step for every fragment with inner
        steps not yet synchronised (every rank has taken the same steps)."""
        step = self._local_steps
        for f in sorted(self._pending):
            self._perform(f, step)
        for f in range(self.options["fragments"]):
            if self._synced_at[f] < step:
                self._prepare(f)
                self._perform(f, step)

    # ------------------------------------------------------------------ checkpoints
    def _pending_results(self) -> dict[int, torch.Tensor]:
        """Wait for every exchange in flight; keep each result (the checkpoint holds it)."""
        out = {}
        for f, pending in list(self._pending.items()):
            value = pending.wait().detach().clone()
            self._pending[f] = _Done(value)
            out[f] = value.cpu()
        return out

    @override
    def _extra_state(self) -> dict:
        return {"momentum": None if self._momentum is None else self._momentum.detach().cpu().clone()}

    @override
    def _load_extra_state(self, state: dict) -> None:
        self._restored = {**(self._restored or {}), "momentum": state.get("momentum")}

    @override
    def _worker_extra_state(self) -> dict:
        return {
            "pending": self._pending_results(),
            "due": dict(self._due),
            "synced_at": list(self._synced_at),
            "syncs": list(self._syncs),
            **self._compression_state(),
        }

    @override
    def _load_worker_extra_state(self, state: dict) -> None:
        keep = ("pending", "due", "synced_at", "syncs")
        self._restored = {**(self._restored or {}), **{k: state.get(k) for k in keep}}
        self._load_compression_state(state)

    # ------------------------------------------------------------------ reporting
    @override
    def summary_extras(self) -> dict:
        numels = self.fragment_numels
        size = self._center.element_size() if self._center is not None else 0
        return {
            **self.options,
            "alpha": self._alpha,
            "outer_syncs": list(self._syncs),
            "fragment_numels": numels,
            "peak_exchange_dense_bytes": max(numels, default=0) * size,
            "comm": self._comm.as_dict(),
        }

    @override
    def release_exchange(self) -> None:
        self._pending.clear()
        self._scratch.clear()
        super().release_exchange()
