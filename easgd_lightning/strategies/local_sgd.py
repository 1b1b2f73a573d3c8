"""Local SGD with periodic parameter averaging, the Quadratic Synchronization Rule and
CoCoD-SGD overlap.

**Local SGD** (``tau_rule=constant``): every worker takes H = ``tau`` local optimizer steps on its
own data, then the workers average their parameters with one all-reduce::

    x_i <- opt_step(x_i, g_i)                  H times, no communication
    c   <- mean_i x_i ;  x_i <- c              one all-reduce of the flat vector

After a round every rank holds the same parameters; that average is the center ``c``
(the model that is validated, checkpointed and left in the module after ``fit``).

**Quadratic Synchronization Rule** (``tau_rule=qsr``; Gu, Lyu, Arora, Zhang, Huang,
"A Quadratic Synchronization Rule for Distributed Deep Learning", ICLR 2024): the period
is recomputed right after each averaging round, from the learning rate eta_t the
optimizer will use next::

    H = max(H_base, floor((gamma / eta_t) ** 2))    capped by the remaining steps
    H = H_base during learning-rate warm-up (or when gamma = 0)

with H_base = ``tau_base``, gamma = ``qsr_coefficient`` and the warm-up ``qsr_warmup_steps``

so a decaying schedule lengthens the local phases. The paper reports e.g. ViT-B Local
AdamW on 16 GPUs 26.7 h -> 20.2 h with +1.16% top-1.

**CoCoD-SGD** (``cocod=true``; Shen, Xu, Liu, Tang, Li, Yang, "CoCoD-SGD: Computation
and Communication Decoupled SGD", IJCAI 2019): at a round boundary each worker snapshots
x_i^t and starts a *non-blocking* all-reduce of it, then keeps computing; at the next
boundary it waits for the result and merges::

    x_i <- mean_j(x_j^t) + (x_i' - x_i^t)          (x_i': its parameters now)

and the merged parameters are the next snapshot. The communication of round t runs while
round t+1 computes: its time is metered (``comm.time_s``) but only the wait at the
boundary, if any, adds to the step time. The first boundary has nothing to merge (all
workers start equal, so the average of the initial snapshot is the initial point).

**End of training**: a pending exchange is merged and, if any worker moved since its last
average, one last blocking average is taken, so every rank ends with the same model.

**Compression** (``compression=X``): the averaged quantity becomes the difference from
the last average, d_i = x_i - c, compressed per parameter with error feedback (residual
r_i, as the compressor chooses; tensors under ``compression.min_numel`` travel dense)::

    c <- c + (1/p) * sum_i C(d_i + r_i);   r_i <- d_i + r_i - C(d_i + r_i);   x_i <- c

The compressed exchange is blocking, so it is not combined with ``cocod``.

**Communication layout** (``comm`` group): the average travels as lazy all-reduce buckets
of whole parameters of at least ``comm.fusion_mb`` (GradientFlow), reduced inside each
node first with ``comm.hierarchy=node`` (reduce to the node's leader, all-reduce among
leaders, broadcast); the compressed exchange fuses its all-reduce payloads the same way.

Defaults: H = 8 (constant). QSR: H_base = ``tau_base`` (default: ``tau``),
``qsr_coefficient`` (gamma) required; the paper's gamma is tuned so that (gamma / eta)^2 exceeds H_base once the
learning rate has decayed by a few times. Raise H (16, 32) to cut traffic further; keep
it at 1-4 when the workers' data differ strongly.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer
from typing_extensions import override

from easgd_lightning.comm import ops
from easgd_lightning.hooks.elastic import exchange_sum
from easgd_lightning.strategies.base import CenterStrategy
from easgd_lightning.strategies.registry import register_strategy
from easgd_lightning.utils.checks import check_bool, check_choice, check_float, check_int, is_number
from easgd_lightning.utils.renames import accepts_renamed

log = logging.getLogger(__name__)

__all__ = [
    "LocalSGDStrategy",
    "PERIOD_RULES",
    "qsr_period",
    "cocod_merge",
    "flatten_into",
    "average_from_sum",
    "validate_local_sgd_options",
]

#: accepted values of ``strategy.tau_rule``
PERIOD_RULES = ("constant", "qsr")

#: returned by :func:`qsr_period` when neither the rule nor the horizon bounds the period
UNBOUNDED_PERIOD = sys.maxsize


# ---------------------------------------------------------------------- pure math
def qsr_period(
    h_base: int,
    gamma: float,
    lr: float,
    remaining_steps: float | None = None,
    *,
    warmup: bool = False,
) -> int:
    """The Quadratic Synchronization Rule (Gu et al., ICLR 2024).

    ``H = max(H_base, floor((gamma / lr) ** 2))``; ``H = H_base`` when ``gamma == 0`` or
    during warm-up; the result is capped by ``remaining_steps`` (never below 1).

    Args:
        h_base: the smallest period H_base (>= 1).
        gamma: the QSR growth coefficient (>= 0).
        lr: the learning rate eta_t at the start of the round (an lr <= 0 makes the
            quadratic term unbounded).
        remaining_steps: optimizer steps left in training (None or inf: no cap).
        warmup: True while the learning rate is warming up.

    Returns:
        The number of local steps of the next round.
    """
    if h_base < 1:
        raise ValueError(f"h_base must be >= 1, got {h_base}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if warmup or gamma == 0:
        period = int(h_base)
    else:
        try:
            ratio = math.inf if lr <= 0 else (gamma / lr) ** 2
        except OverflowError:  # tiny lr: (gamma / lr)^2 exceeds the float range
            ratio = math.inf
        quad = math.floor(ratio) if math.isfinite(ratio) else UNBOUNDED_PERIOD
        period = max(int(h_base), min(quad, UNBOUNDED_PERIOD))
    if remaining_steps is not None and math.isfinite(remaining_steps):
        period = min(period, max(1, int(remaining_steps)))
    return period


def cocod_merge(
    avg_snapshot: torch.Tensor,
    snapshot: torch.Tensor,
    current: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CoCoD-SGD merge (Shen et al., IJCAI 2019): ``mean_j(x_j^t) + (x_i' - x_i^t)``.

    Args:
        avg_snapshot: mean over workers of the snapshots x_j^t.
        snapshot: this worker's snapshot x_i^t (taken when the all-reduce started).
        current: this worker's parameters x_i' now.
        out: where to write the result (may be ``current`` itself); None: a new tensor.
            Both forms give bitwise the same values.

    Returns:
        The averaged snapshot plus this worker's progress since it.
    """
    if out is None:
        return avg_snapshot + (current - snapshot)
    if out is not current:
        out.copy_(current)
    return out.sub_(snapshot).add_(avg_snapshot)


def flatten_into(tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` one after the other into the flat buffer ``out``; returns ``out``."""
    offset = 0
    for t in tensors:
        n = t.numel()
        out[offset : offset + n].copy_(t.detach().reshape(-1))
        offset += n
    return out


def average_from_sum(center: torch.Tensor, total: torch.Tensor, world_size: int) -> torch.Tensor:
    """New average from the summed differences: ``c + (1/p) * sum_i (x_i - c)``.

    Args:
        center: the previous average c (identical on every rank).
        total: ``sum_i d_i`` as returned by the (possibly compressed) exchange.
        world_size: the number of workers p.

    Returns:
        A new tensor holding the new average.
    """
    return center + total / world_size


def validate_local_sgd_options(
    tau: Any, tau_rule: Any, tau_base: Any, qsr_coefficient: Any, qsr_warmup_steps: Any
) -> tuple[int, str, int, float, int | None]:
    """Check the ``strategy.*`` options of ``local_sgd``; returns them normalised.

    Raises:
        ValueError: naming the key and the allowed values.
    """

    tau = check_int("strategy.tau", tau)
    check_choice("strategy.tau_rule", tau_rule, PERIOD_RULES)
    tau_base = tau if tau_base is None else check_int("strategy.tau_base", tau_base)
    gamma = qsr_coefficient
    if tau_rule == "qsr":
        if gamma == 0 and is_number(gamma):
            raise ValueError(
                f"strategy.qsr_coefficient must be > 0 with strategy.tau_rule=qsr, got {gamma!r} "
                "(0 is a constant period: use strategy.tau_rule=constant)"
            )
        try:
            check_float("strategy.qsr_coefficient", gamma, 0.0, math.inf, lo_open=True, hi_open=True)
        except ValueError as err:
            raise ValueError(f"{err} (needed by strategy.tau_rule=qsr)") from None
    else:
        check_float("strategy.qsr_coefficient", gamma, 0.0, nullable=True)
    check_int("strategy.qsr_warmup_steps", qsr_warmup_steps, 0, nullable=True)
    return tau, tau_rule, tau_base, float(gamma or 0.0), qsr_warmup_steps


# ---------------------------------------------------------------------- strategy
@register_strategy(
    "local_sgd", options=("tau", "tau_rule", "tau_base", "qsr_coefficient", "qsr_warmup_steps", "cocod")
)
class LocalSGDStrategy(CenterStrategy):
    """Local SGD: H local steps, then parameter averaging (``strategy="local_sgd"``).

    Args:
        tau: H for ``tau_rule="constant"`` (>= 1).
        tau_rule: ``constant`` or ``qsr`` (Quadratic Synchronization Rule).
        tau_base: QSR's smallest period H_base (default: ``tau``).
        qsr_coefficient: QSR's gamma (> 0, required for ``qsr``).
        qsr_warmup_steps: steps of learning-rate warm-up during which QSR keeps H = H_base
            (default: the LightningModule's ``hparams.warmup_steps`` if it has one, else 0).
        cocod: CoCoD-SGD: run each round's all-reduce while the next round computes.
        comm: the ``comm`` layout (``CommLayout`` or its options: ``fusion_mb``,
            ``hierarchy``, ``procs_per_node``); None: the defaults.
        compression: a compressor for the parameter differences (not with ``cocod``).

    The names before 0.2 (``period``, ``period_rule``, ``h_base``, ``gamma``,
    ``warmup_steps``, ``overlap``) still work, with a ``FutureWarning``.
        memory: error-feedback memory for the compressor (default: the compressor's own
            choice, kept in the exchange state: residuals for sparsifiers, PowerSGD, sign).
    """

    strategy_name = "local_sgd"
    comm_kind = "model_averaging"
    min_world_size = 1
    hierarchical = True

    @accepts_renamed("local_sgd")
    def __init__(
        self,
        tau: int = 8,
        tau_rule: str = "constant",
        tau_base: int | None = None,
        qsr_coefficient: float | None = None,
        qsr_warmup_steps: int | None = None,
        cocod: bool = False,
        compression: Any = None,
        memory: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(compression=compression, **kwargs)
        (self.tau, self.tau_rule, self.tau_base, self.qsr_coefficient, self.qsr_warmup_steps) = (
            validate_local_sgd_options(tau, tau_rule, tau_base, qsr_coefficient, qsr_warmup_steps)
        )
        check_bool("strategy.cocod", cocod)
        if cocod and compression is not None:
            raise ValueError(
                "strategy.cocod=true needs compression=none (the compressed exchange is "
                "blocking, so there is nothing to overlap)"
            )
        self.cocod = cocod
        self._memory = memory
        self._compress_state: dict = {}
        # round state
        self._round_steps = 0
        self._current_period: int | None = None  # None: compute at the next step
        self._periods: list[int] = []
        self._rounds = 0
        self._warmup: int | None = None
        self._horizon: float | None = None
        # overlap state
        self._pending: torch.futures.Future | None = None
        self._snapshot: torch.Tensor | None = None
        # flat buffers reused every round (no allocation per round): the one in flight, a
        # spare; the center and the snapshot rotate through them
        self._inflight: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None
        self._merge_ready = False

    # ------------------------------------------------------------------ properties
    @property
    def taus(self) -> list[int]:
        """The H of every round started so far, in order."""
        return list(self._periods)

    # ------------------------------------------------------------------ set-up
    def _warmup_steps(self) -> int:
        if self._warmup is None:
            if self.qsr_warmup_steps is not None:
                self._warmup = self.qsr_warmup_steps
            else:
                hp = getattr(self.lightning_module, "hparams", {}) or {}
                self._warmup = int(hp.get("warmup_steps", 0) or 0)
        return self._warmup

    def _total_steps(self) -> float:
        if self._horizon is None:
            try:
                self._horizon = float(self.lightning_module.trainer.estimated_stepping_batches)
            except Exception:  # no trainer / unknown length: no cap
                self._horizon = math.inf
        return self._horizon

    # ------------------------------------------------------------------ rounds
    def _next_period(self, optimizer: Optimizer, steps_done: int) -> int:
        """H for the round that starts after ``steps_done`` optimizer steps."""
        if self.tau_rule == "constant":
            return self.tau
        return qsr_period(
            self.tau_base,
            self.qsr_coefficient,
            self._optimizer_lr(optimizer),
            self._total_steps() - steps_done,
            warmup=steps_done < self._warmup_steps(),
        )

    def _start_round(self, optimizer: Optimizer) -> None:
        steps_done = self._local_steps - 1  # the step about to be taken is not done yet
        period = self._next_period(optimizer, steps_done)
        self._current_period = period
        self._periods.append(period)
        self._log_period(period, steps_done)

    def _log_period(self, period: int, step: int) -> None:
        if not self.is_global_zero:
            return
        try:
            loggers = self.lightning_module.trainer.loggers
        except Exception:  # pragma: no cover - strategy used without a trainer
            return
        for logger in loggers:
            logger.log_metrics({"local_sgd/tau": float(period)}, step=step)

    @override
    def _exchange_step(self, take_step: Callable[[], Any], optimizer: Optimizer) -> Any:
        if self._current_period is None:
            self._start_round(optimizer)
        out = take_step()
        self._round_steps += 1
        if self._round_steps >= self._current_period:
            self._end_round()
        return out

    def _end_round(self) -> None:
        tensors = self._elastic_tensors()
        if self.cocod:
            self._overlap_boundary(tensors)
        else:
            self._average(tensors)
        self._rounds += 1
        self._round_steps = 0
        self._current_period = None

    def _take_buffer(self) -> torch.Tensor:
        """A free flat buffer shaped like the center."""
        buf, self._spare = self._spare, None
        if buf is None or buf.shape != self._center.shape or buf.dtype != self._center.dtype:
            buf = torch.empty_like(self._center)
        return buf

    @torch.no_grad()
    def _average(self, tensors: list[torch.Tensor]) -> None:
        """Blocking average: center <- mean_i x_i, then x_i <- center."""
        world = self.world_size
        if self._compression is None:  # in place in the (resident) elastic buffer
            x = self._elastic_flat()
            x.div_(world)
            self._comm.all_reduce_flat(x, [t.numel() for t in tensors], kind=self.comm_kind)
            self._store_elastic(x)
            center = self._take_buffer().copy_(x)
            self._spare, self._center = self._center, center
            return
        diff = self._elastic_flat() - self._center
        total = exchange_sum(
            diff,
            compressor=self._compression,
            memory=self._memory,
            state=self._compress_state,
            kind=self.comm_kind,
            shapes=[t.shape for t in tensors],
            layout=self._comm,
        )
        self._center = average_from_sum(self._center, total, world)
        self._load_elastic(self._center)

    @torch.no_grad()
    def _overlap_boundary(self, tensors: list[torch.Tensor]) -> None:
        """CoCoD-SGD boundary: merge the previous round's average, launch this one's."""
        self._complete_pending()
        if self._merge_ready:
            current = self._elastic_flat()
            self._store_elastic(cocod_merge(self._center, self._snapshot, current, out=current))
            self._merge_ready = False
        x = self._copy_elastic(self._take_buffer())
        if self._snapshot is None or self._snapshot.shape != x.shape:
            self._snapshot = torch.empty_like(x)
        self._snapshot.copy_(x)
        self._inflight = x.div_(self.world_size)
        self._pending = self._comm.all_reduce_flat_async(x, [t.numel() for t in tensors], kind=self.comm_kind)

    def _complete_pending(self) -> None:
        """Wait for the in-flight average (if any); it becomes the center."""
        if self._pending is None:
            return
        start = time.perf_counter()
        value = ops.wait(self._pending, kind=self.comm_kind)
        result = value[0] if isinstance(value, (list, tuple)) else value
        if result.data_ptr() != self._inflight.data_ptr():
            self._inflight.copy_(result)
        self._spare, self._center = self._center, self._inflight
        self._pending = self._inflight = None
        self._merge_ready = True
        log.debug("waited %.4fs for the overlapped average", time.perf_counter() - start)

    @torch.no_grad()
    def _finish(self) -> None:
        """End of training: merge what is pending, then average any unsynchronised progress."""
        tensors = self._elastic_tensors()
        self._complete_pending()
        if self._merge_ready:
            current = self._elastic_flat()
            self._store_elastic(cocod_merge(self._center, self._snapshot, current, out=current))
            self._merge_ready = False
            self._snapshot = None
        if self._round_steps > 0:
            self._average(tensors)
            self._rounds += 1
            self._round_steps = 0
            self._current_period = None

    # ------------------------------------------------------------------ center
    @override
    def _fetch_center(self) -> None:
        self._complete_pending()

    @override
    def finish_exchange(self) -> None:
        if self._center is not None:
            self._swap_out()
            if dist.is_available() and dist.is_initialized():
                self._finish()
        super().finish_exchange()

    # ------------------------------------------------------------------ checkpoints
    @override
    def _worker_extra_state(self) -> dict:
        self._complete_pending()
        # the base turns this into tensors and plain data (utils.checkpoint.to_plain)
        return {
            "round_steps": self._round_steps,
            "current_period": self._current_period,
            "periods": list(self._periods),
            "rounds": self._rounds,
            "snapshot": None if self._snapshot is None else self._snapshot.detach().cpu().clone(),
            "merge_ready": self._merge_ready,
            **self._compression_state(),
        }

    @override
    def _load_worker_extra_state(self, state: dict) -> None:
        self._round_steps = int(state.get("round_steps", 0))
        self._current_period = state.get("current_period")
        self._periods = list(state.get("periods", []))
        self._rounds = int(state.get("rounds", 0))
        snap = state.get("snapshot")
        self._snapshot = None if snap is None else snap.to(self.root_device, self._center.dtype)
        self._merge_ready = bool(state.get("merge_ready", False)) and self._snapshot is not None
        self._load_compression_state(state)

    # ------------------------------------------------------------------ reporting
    @override
    def summary_extras(self) -> dict:
        return {
            "tau_rule": self.tau_rule,
            "tau": self.tau,
            "tau_base": self.tau_base,
            "qsr_coefficient": self.qsr_coefficient,
            "cocod": self.cocod,
            "rounds": self._rounds,
            "taus": list(self._periods),
            "comm": self._comm.as_dict(),
        }

    @override
    def release_exchange(self) -> None:
        if self._pending is not None:
            try:
                self._pending.wait()
            except Exception:  # pragma: no cover - a broken group at teardown
                log.debug("pending average failed at teardown", exc_info=True)
            self._pending = self._inflight = None
        self._spare = None
        super().release_exchange()

