"""Elastic-averaging math as small pure functions (no I/O, no process groups).

Zhang, Choromanska, LeCun, "Deep learning with Elastic Averaging SGD", NeurIPS 2015;
You, Buluc, Demmel, "Scaling Deep Learning on GPU and Knights Landing clusters", SC17.

Synchronous ("simultaneous") rule, at every step t with t % tau == 0, using the parameters
x_i at which this step's gradient was computed::

    d_i = alpha * (x_i - c)
    x_i <- x_i - eta * g_i - d_i        (the optimizer's step replaces -eta * g_i)
    c   <- c + sum_i d_i                = (1 - beta) c + beta * mean_i x_i,  beta = p * alpha

Asynchronous / round-robin exchange with one worker at a time: the same d_i, computed
against the center as it is when that worker is served, applied to c at once.
"""

from __future__ import annotations

import torch

from easgd_lightning.utils.checks import check_float, check_positive

__all__ = [
    "resolve_alpha",
    "is_exchange_step",
    "elastic_difference",
    "apply_elastic_pull",
    "apply_center_update",
]


def resolve_alpha(
    *,
    world_size: int,
    alpha: float | None = None,
    beta: float | None = None,
    rho: float | None = None,
    lr: float | None = None,
) -> float:
    """The moving rate alpha from exactly one of alpha, beta (= p * alpha), rho (alpha = lr * rho).

    With none given, beta = 0.9 (the paper's default), i.e. alpha = 0.9 / p.

    Raises:
        ValueError: more than one given, a value out of range, or beta = p * alpha >= 1.
    """
    given = {k: v for k, v in (("alpha", alpha), ("beta", beta), ("rho", rho)) if v is not None}
    if len(given) > 1:
        raise ValueError(
            f"strategy: set only one of alpha, beta, rho (got {', '.join(sorted(given))})"
        )
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if rho is not None:
        check_positive("strategy.rho", rho)
        if lr is None:
            raise ValueError("strategy.rho needs the optimizer's learning rate (alpha = lr * rho)")
        a = float(lr) * float(rho)
    elif beta is not None:
        check_float("strategy.beta", beta, 0.0, 1.0, lo_open=True, hi_open=True)
        a = float(beta) / world_size
    elif alpha is not None:
        a = float(alpha)
    else:
        a = 0.9 / world_size
    check_float("strategy.alpha", a, 0.0, 1.0, lo_open=True, hi_open=True)
    if world_size * a >= 1.0:
        raise ValueError(
            f"strategy.alpha: beta = world_size * alpha must be < 1 for a stable center, "
            f"got {world_size} * {a} = {world_size * a:g}"
        )
    return a


def is_exchange_step(step: int, tau: int) -> bool:
    """True when the 1-based local step index ``step`` is a multiple of ``tau``."""
    return step % tau == 0


def elastic_difference(
    x: torch.Tensor, center: torch.Tensor, alpha: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """d = alpha * (x - c) (into ``out`` when given; bitwise the same either way)."""
    return torch.sub(x, center, out=out).mul_(alpha) if out is not None else (x - center).mul_(alpha)


def apply_elastic_pull(x: torch.Tensor, diff: torch.Tensor) -> torch.Tensor:
    """Worker side: x <- x - d (in place)."""
    return x.sub_(diff)


def apply_center_update(center: torch.Tensor, diff_sum: torch.Tensor) -> torch.Tensor:
    """Center side: c <- c + sum_i d_i (in place)."""
    return center.add_(diff_sum)
