"""Original EASGD with a master that serves workers strictly in rank order.

The baseline that SC17 (You, Buluc, Demmel, "Scaling Deep Learning on GPU and Knights
Landing clusters") improves on; the rule is Zhang, Choromanska, LeCun, NeurIPS 2015.
Every tau local steps, in rank order i = 0, 1, ..., p-1 (worker i+1 waits for worker i):

    worker i sends x_i (the point where its gradient was computed) to the master
    master:   d_i = alpha * (x_i - c);  c <- c + d_i;  sends d_i back
    worker i: x_i <- opt_step(x_i, g_i) - d_i

Global rank 0 is both the master and worker 0 (served first, without messages), so every
rank trains. The p - 1 sequential send/receive pairs cost p (a + |W| b) per round, the
cost SC17's tree all-reduce brings down to log p (a + |W| b). The center lives on the
master; it is broadcast to every rank for validation, checkpoints and at the end of fit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer
from typing_extensions import override

from easgd_lightning.comm import ops
from easgd_lightning.strategies import elastic
from easgd_lightning.strategies.base import CenterStrategy
from easgd_lightning.strategies.registry import register_strategy
from easgd_lightning.utils.checks import check_int

__all__ = ["RoundRobinEASGDStrategy"]

MASTER = 0
_LOG_LEN = 600


@register_strategy("easgd_round_robin", options=("tau", "alpha", "beta", "rho"))
class RoundRobinEASGDStrategy(CenterStrategy):
    """Original EASGD, round-robin master (``strategy="easgd_round_robin"``).

    Args:
        tau: communication period in local steps (>= 1).
        alpha: moving rate in (0, 1); or ``beta`` (= p * alpha) or ``rho`` (alpha = lr * rho).
        record_order: keep the master's service log (step, rank, time) for inspection.
    """

    strategy_name = "easgd_round_robin"
    alpha_from_lr = True

    def __init__(
        self,
        tau: int = 1,
        alpha: float | None = None,
        beta: float | None = None,
        rho: float | None = None,
        record_order: bool = True,
        compression: Any = None,
        **kwargs: Any,
    ) -> None:
        if compression is not None:
            raise ValueError(
                "compression: easgd_round_robin is the uncompressed baseline; "
                "use compression=none (compressed elastic differences: sync_easgd, async_easgd, async_measgd)"
            )
        super().__init__(**kwargs)
        self.tau = check_int("strategy.tau", tau)
        self._set_moving_rate_options(alpha, beta, rho)
        self.record_order = record_order
        # bounded: the most recent rounds are enough to inspect the order
        self.service_log: deque[tuple[int, int, float]] = deque(maxlen=_LOG_LEN)
        self.exchange_times: deque[tuple[int, float]] = deque(maxlen=_LOG_LEN)

    @override
    def _validate_world(self, world_size: int) -> None:
        self._resolve_moving_rate(world_size)

    @override
    def _fetch_center(self) -> None:
        if self.world_size > 1:
            ops.broadcast(self._center, src=MASTER, kind=self.comm_kind)

    def _serve(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """Master: apply one worker's elastic difference to the center and return it."""
        diff = elastic.elastic_difference(x, self._center, self._alpha)
        elastic.apply_center_update(self._center, diff)
        if self.record_order:
            self.service_log.append((self._local_steps, rank, time.time()))
        return diff

    @override
    def _exchange_step(self, take_step: Callable[[], Any], optimizer: Optimizer) -> Any:
        if not elastic.is_exchange_step(self._local_steps, self.tau):
            return take_step()
        x = self._elastic_flat()  # the resident buffer: sent without a copy
        if self.global_rank == MASTER:
            diff = self._serve(x, MASTER)
            buf = torch.empty_like(x)
            for rank in range(1, self.world_size):
                ops.recv(buf, src=rank, kind=self.comm_kind)
                ops.send(self._serve(buf, rank), dst=rank, kind=self.comm_kind)
        else:
            ops.send(x, dst=MASTER, kind=self.comm_kind)
            diff = torch.empty_like(x)
            ops.recv(diff, src=MASTER, kind=self.comm_kind)
        self.exchange_times.append((self._local_steps, time.time()))
        out = take_step()
        with torch.no_grad():
            new_x = self._elastic_flat()
            elastic.apply_elastic_pull(new_x, diff)
            self._store_elastic(new_x)
        return out

    @override
    def summary_extras(self) -> dict:
        extras = {
            "tau": self.tau,
            "alpha": self._alpha,
            "master_rank": MASTER,
            "exchange_times": list(self.exchange_times),
        }
        if self.global_rank == MASTER:
            extras["service_order"] = [r for _, r, _ in self.service_log]
            extras["service_log"] = list(self.service_log)
        return extras
