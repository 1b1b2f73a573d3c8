"""Sync EASGD: elastic averaging with a replicated center and one all-reduce per exchange.

Rule (Zhang, Choromanska, LeCun, NeurIPS 2015; implemented as in You, Buluc, Demmel,
SC17 "Sync EASGD"), at every local step t with t % tau == 0::

    d_i = alpha * (x_i - c)                   (x_i: the point where g_i was computed)
    x_i <- opt_step(x_i, g_i) - d_i
    c   <- c + sum_i d_i                      (one all-reduce of the flat d_i)

Every rank holds the same c, so there is no master: the SC17 tree reduce + broadcast
becomes one all-reduce of a single contiguous buffer. Deterministic for a fixed seed.

Defaults: tau = 1 (exchange every step, as SC17's Sync EASGD), beta = p * alpha = 0.9.
Raise tau (4, 16, 64) to trade consensus for less traffic. With ``compression`` the
elastic differences are compressed with error feedback and c adds the decompressed sum.

Overlap (``overlap=true``, the default; SC17's third co-design step): the all-reduce of
step t's differences is needed only when the next difference is formed, at step t + tau
after that step's forward and backward. So it is launched non-blocking and waited for
just before that: the closure's forward + backward runs (x is still the point where the
gradient is computed), then the pending sum is added to c, d = alpha (x - c) is formed,
the optimizer steps, x <- x - d and the exchange of d is launched. ``overlap=false``
waits right after the launch. The arithmetic and its order are the same in both modes,
so they give bitwise the same centers; validation, checkpoints and the end of fit finish
a pending exchange first. With a compressor the exchange is split the same way
(:func:`easgd_lightning.hooks.elastic.start_exchange_sum`): compression and the residual
update at launch, decompression and the sum at the wait.

Communication layout (``comm`` group, :class:`easgd_lightning.comm.layout.CommLayout`):
the dense exchange travels as lazy all-reduce buckets of whole parameters of at least
``comm.fusion_mb`` (GradientFlow; a model under that size is one message, as SC17's
single-layer communication), and ``comm.hierarchy=node`` reduces each bucket inside the
node first (reduce to the node's leader, all-reduce among leaders, broadcast).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer
from typing_extensions import override

from easgd_lightning.hooks.elastic import PendingSum, start_exchange_sum
from easgd_lightning.strategies import elastic
from easgd_lightning.strategies.base import CenterStrategy
from easgd_lightning.strategies.registry import register_strategy
from easgd_lightning.utils.checks import check_bool, check_int

__all__ = ["SyncEASGDStrategy"]


@register_strategy("sync_easgd", options=("tau", "alpha", "beta", "rho", "overlap"))
class SyncEASGDStrategy(CenterStrategy):
    """Synchronous EASGD (``strategy="sync_easgd"``).

    Args:
        tau: communication period in local steps (>= 1).
        alpha: moving rate in (0, 1); or give ``beta`` (= p * alpha) or ``rho``
            (alpha = lr * rho). Default beta = 0.9.
        compression: a compressor (see ``easgd_lightning.hooks.build_compressor``) for the
            elastic differences, or None.
        memory: error-feedback memory for the compressor (default: the compressor's own
            choice, residuals for sparsifiers / PowerSGD / sign). The worker applies its
            exact difference; the center adds the decompressed sum, and what a compressor
            dropped reaches the center later through the residual.
        overlap: run each exchange behind the next exchange step's forward and backward
            (exact: the same centers as ``false``, bitwise).
        comm: the ``comm`` layout (``CommLayout`` or its options: ``fusion_mb``,
            ``hierarchy``, ``procs_per_node``); None: the defaults.
    """

    strategy_name = "sync_easgd"
    hierarchical = True
    alpha_from_lr = True

    def __init__(
        self,
        tau: int = 1,
        alpha: float | None = None,
        beta: float | None = None,
        rho: float | None = None,
        compression: Any = None,
        memory: Any = None,
        overlap: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(compression=compression, **kwargs)
        self.tau = check_int("strategy.tau", tau)
        self._set_moving_rate_options(alpha, beta, rho)
        self.overlap = check_bool("strategy.overlap", overlap)
        self._memory = memory
        self._compress_state: dict = {}
        self._diff: torch.Tensor | None = None  # d, reused every exchange
        self._pending: PendingSum | None = None
        self._diff_formed = False
        self._overlapped = 0  # exchanges still in flight when the next difference was formed

    @property
    def alpha(self) -> float | None:
        return self._alpha

    @property
    def exchanges_overlapped(self) -> int:
        """Exchanges that were still in flight when the next difference was formed."""
        return self._overlapped

    @override
    def _validate_world(self, world_size: int) -> None:
        self._resolve_moving_rate(world_size)

    @override
    def _exchange_step(self, take_step: Callable[..., Any], optimizer: Optimizer) -> Any:
        if not elastic.is_exchange_step(self._local_steps, self.tau):
            return take_step()
        out = self._step_forming_difference(take_step)
        with torch.no_grad():
            x = self._elastic_flat()
            elastic.apply_elastic_pull(x, self._diff)
            self._store_elastic(x)
        self._pending = start_exchange_sum(
            self._diff,
            compressor=self._compression,
            memory=self._memory,
            state=self._compress_state,
            kind=self.comm_kind,
            shapes=[t.shape for t in self._elastic_tensors()],
            layout=self._comm,
        )
        if not self.overlap:
            self._complete_exchange()
        return out

    def _step_forming_difference(self, take_step: Callable[..., Any]) -> Any:
        """The optimizer's step, with d = alpha (x - c) formed after its forward and backward
        (:meth:`_form_difference`); returns the step's output."""
        self._diff_formed = False
        out = take_step(after_closure=self._form_difference)
        if not self._diff_formed:
            raise RuntimeError(
                "sync_easgd: the optimizer stepped without calling its closure, so the "
                "elastic difference could not be formed at the gradient's point"
            )
        return out

    @torch.no_grad()
    def _form_difference(self) -> None:
        """After forward + backward, before the update: c += the pending sum, then
        d = alpha (x - c) at the point where the gradient was computed."""
        self._overlapped += self._pending is not None
        self._complete_exchange()
        x = self._elastic_flat()
        if self._diff is None or self._diff.shape != x.shape or self._diff.dtype != x.dtype:
            self._diff = torch.empty_like(x)
        elastic.elastic_difference(x, self._center, self._alpha, out=self._diff)
        self._diff_formed = True

    @override
    def _complete_exchange(self) -> None:
        """Wait for the exchange in flight and add its sum to the center."""
        pending, self._pending = self._pending, None
        if pending is not None:
            elastic.apply_center_update(self._center, pending.wait())

    @override
    def _drop_exchange(self) -> None:
        self._pending = None

    @override
    def _worker_extra_state(self) -> dict:
        self._complete_exchange()
        # the base turns this into tensors and plain data (utils.checkpoint.to_plain)
        return self._compression_state()

    @override
    def _load_worker_extra_state(self, state: dict) -> None:
        self._load_compression_state(state)

    @override
    def summary_extras(self) -> dict:
        return {
            "tau": self.tau,
            "alpha": self._alpha,
            "beta": (self._alpha or 0) * self.world_size,
            "overlap": self.overlap,
            "exchanges_overlapped": self._overlapped,
            "comm": self._comm.as_dict(),
        }
