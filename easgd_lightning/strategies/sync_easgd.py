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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer
from typing_extensions import override

from easgd_lightning.hooks.elastic import exchange_sum
from easgd_lightning.strategies import elastic
from easgd_lightning.strategies.base import (
    CenterStrategy,
    check_positive_int,
    flatten,
    unflatten_into,
)
from easgd_lightning.utils.checkpoint import from_plain

__all__ = ["SyncEASGDStrategy"]


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
    """

    strategy_name = "sync_easgd"

    def __init__(
        self,
        tau: int = 1,
        alpha: float | None = None,
        beta: float | None = None,
        rho: float | None = None,
        compression: Any = None,
        memory: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(compression=compression, **kwargs)
        self._tau = check_positive_int("strategy.tau", tau)
        self._set_moving_rate_options(alpha, beta, rho)
        self._memory = memory
        self._compress_state: dict = {}

    @property
    def tau(self) -> int:
        return self._tau

    @property
    def alpha(self) -> float | None:
        return self._alpha

    @override
    def _validate_world(self, world_size: int) -> None:
        self._resolve_moving_rate(world_size)

    @override
    def _exchange_step(self, take_step: Callable[[], Any], optimizer: Optimizer) -> Any:
        if not elastic.is_exchange_step(self._local_steps, self._tau):
            return take_step()
        tensors = self._elastic_tensors()
        diff = elastic.elastic_difference(flatten(tensors), self._center, self._alpha)
        out = take_step()
        with torch.no_grad():
            x = flatten(tensors)
            elastic.apply_elastic_pull(x, diff)
            unflatten_into(x, tensors)
        total = exchange_sum(
            diff,
            compressor=self._compression,
            memory=self._memory,
            state=self._compress_state,
            kind=self.comm_kind,
            shapes=[t.shape for t in tensors] if self._compression is not None else None,
        )
        elastic.apply_center_update(self._center, total)
        return out

    @override
    def _worker_extra_state(self) -> dict:
        # the base turns this into tensors and plain data (utils.checkpoint.to_plain)
        mem = self._memory.state_dict() if hasattr(self._memory, "state_dict") else None
        return {"memory": mem, "compress_state": self._compress_state}

    @override
    def _load_worker_extra_state(self, state: dict) -> None:
        self._compress_state = from_plain(state.get("compress_state") or {}, self.root_device)
        mem = state.get("memory")
        if mem is not None and hasattr(self._memory, "load_state_dict"):
            self._memory.load_state_dict(from_plain(mem, self.root_device))

    @override
    def summary_extras(self) -> dict:
        return {"tau": self._tau, "alpha": self._alpha, "beta": (self._alpha or 0) * self.world_size}
