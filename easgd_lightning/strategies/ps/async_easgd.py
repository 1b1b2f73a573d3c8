"""Asynchronous parameter-server family: Async EASGD, Async MEASGD, Async SGD, Async MSGD.

Rules (Zhang, Choromanska, LeCun, NeurIPS 2015; You, Buluc, Demmel, SC17; the pure math is
in :mod:`easgd_lightning.strategies.ps.rules`):

* ``async_easgd``: every ``tau`` local steps worker i sends x_i (the point where this step's
  gradient is computed) to the server, which applies, on arrival and for that one worker,
  ``d = alpha (x_i - c); c <- c + d`` and returns d; the worker sets
  ``x_i <- opt_step(x_i, g_i) - d``. The request is sent *before* the local step and the
  reply is awaited after it, so the worker computes its gradient while d travels (SC17).
  Default beta = p * alpha = 0.9 over the p workers, tau = 1. With ``compression`` the
  worker pushes C(x_i - x~_i), x~_i the server's estimate of x_i that both ends keep (error
  feedback: x_i - x~_i carries what compression left out), the server applies the rule to
  x~_i and replies with the dense d (:mod:`easgd_lightning.strategies.ps.compressed`).
* ``async_measgd``: the same exchange; the worker's local step is EAMSGD's Nesterov form
  (``v <- delta v; x <- x + v; g = grad(x); x <- x - eta g; v <- v - eta g``) with
  ``momentum`` = delta in [0, 1) (default 0.9). The strategy owns that momentum: the
  optimizer's own ``momentum`` is set to 0 (with a warning) so it is not applied twice.
* ``async_sgd``: every step the worker computes g at its copy of the weights and pushes g;
  the server takes one step of the user's optimizer (its class, parameter groups, weight
  decay; the server holds its state) for g and returns w, which the worker loads. With plain
  SGD that is ``w <- w - eta (g + wd w)``. Each group's eta is the worker optimizer's current
  learning rate of that group (sent with the request; schedules apply) unless ``lr`` is set.
  Parameters the worker has no gradient for (frozen) are skipped, as ``torch.optim`` does.
  With ``compression`` the pushes are compressed with error feedback, and with
  ``compression.two_way`` the replies too (:mod:`easgd_lightning.strategies.ps.compressed`).
* ``async_msgd``: Async SGD with heavy-ball momentum held by the server
  (``b <- mu b + g; w <- w - eta b``, ``momentum`` = mu, default 0.9): SGD's own momentum,
  so the optimizer must be ``torch.optim.SGD`` with momentum 0 or mu (refused otherwise);
  over momentum 0 it warns once (rank 0) that it applies mu.

``servers=S`` (all four): the center is cut into S contiguous shards, held by the last S
ranks, one each (:mod:`easgd_lightning.strategies.ps.shards`); a worker sends shard j of
every push to server j, all S in flight together, and each server applies the rule above
to its shard.

The machinery (dedicated server rank, liveness, stopping, checkpoints) is
:class:`~easgd_lightning.strategies.ps.strategy.AsyncCenterStrategy`'s.
"""

from __future__ import annotations

from typing import Any

from easgd_lightning.strategies.ps.strategy import AsyncCenterStrategy
from easgd_lightning.strategies.registry import register_strategy

__all__ = ["AsyncEASGDStrategy", "AsyncMEASGDStrategy", "AsyncSGDStrategy", "AsyncMSGDStrategy"]

_COMMON = ("stop_policy", "max_time_s", "worker_timeout_s", "heartbeat_s", "checkpoint_every_s",
           "checkpoint_path", "server", "servers")


@register_strategy("async_easgd")
class AsyncEASGDStrategy(AsyncCenterStrategy):
    """Async EASGD: FCFS parameter server, elastic exchange every tau steps (``strategy="async_easgd"``).

    Args:
        tau: communication period in local steps (>= 1).
        alpha: moving rate in (0, 1); or ``beta`` (= p * alpha over the p workers) or ``rho``
            (alpha = lr * rho). Default beta = 0.9.
        server: ``"dedicated"`` (the last rank serves; the only mode).
        servers: S >= 1 servers, the last S ranks, server j holding the j-th contiguous shard
            of the center (:mod:`~easgd_lightning.strategies.ps.shards`); at most the workers.
        stop_policy: ``"first"`` (stop everyone when the first worker finishes) or ``"all"``.
        max_time_s: optional wall-clock budget per worker.
        worker_timeout_s: heartbeat silence after which a rank is dead (default min(30, timeout/2)).
        checkpoint_every_s: period of the server's ``center.ckpt`` (null: only at the end).
        overlap: send x before the local step and collect d after it (SC17).
    """

    strategy_name = "async_easgd"
    _OPTIONS = ("tau", "alpha", "beta", "rho", "overlap", *_COMMON)

    def __init__(self, tau: int = 1, alpha: float | None = None, beta: float | None = None,
                 rho: float | None = None, **kwargs: Any) -> None:
        self._reject_unknown(kwargs)
        super().__init__(tau=tau, alpha=alpha, beta=beta, rho=rho, **kwargs)


@register_strategy("async_measgd")
class AsyncMEASGDStrategy(AsyncCenterStrategy):
    """Async MEASGD: Async EASGD with EAMSGD Nesterov momentum on the workers (``strategy="async_measgd"``).

    Args:
        momentum: delta in [0, 1) (default 0.9); replaces the optimizer's own momentum.
        tau, alpha, beta, rho, ...: as :class:`AsyncEASGDStrategy`.
    """

    strategy_name = "async_measgd"
    worker_momentum = True
    _OPTIONS = ("tau", "alpha", "beta", "rho", "momentum", "overlap", *_COMMON)

    def __init__(self, tau: int = 1, momentum: float = 0.9, alpha: float | None = None,
                 beta: float | None = None, rho: float | None = None, **kwargs: Any) -> None:
        self._reject_unknown(kwargs)
        super().__init__(tau=tau, momentum=momentum, alpha=alpha, beta=beta, rho=rho, **kwargs)


@register_strategy("async_sgd")
class AsyncSGDStrategy(AsyncCenterStrategy):
    """Async SGD: workers push gradients, the server applies SGD and returns weights (``strategy="async_sgd"``).

    Args:
        lr: server learning rate (null: the worker optimizer's current lr, sent with each push).
        stop_policy, max_time_s, ...: as :class:`AsyncEASGDStrategy`.
    """

    strategy_name = "async_sgd"
    rule = "sgd"
    _OPTIONS = ("lr", *_COMMON)

    def __init__(self, lr: float | None = None, **kwargs: Any) -> None:
        self._reject_unknown(kwargs)
        super().__init__(lr=lr, **kwargs)


@register_strategy("async_msgd")
class AsyncMSGDStrategy(AsyncCenterStrategy):
    """Async MSGD: Async SGD with heavy-ball momentum at the server (``strategy="async_msgd"``).

    Args:
        momentum: mu in [0, 1) (default 0.9), held by the server (checkpointed with it).
        lr: as :class:`AsyncSGDStrategy`.
    """

    strategy_name = "async_msgd"
    rule = "sgd"
    server_momentum = True
    _OPTIONS = ("lr", "momentum", *_COMMON)

    def __init__(self, momentum: float = 0.9, lr: float | None = None, **kwargs: Any) -> None:
        self._reject_unknown(kwargs)
        super().__init__(momentum=momentum, lr=lr, **kwargs)

