"""Update rules of the asynchronous family as small pure tensor functions (no I/O).

Zhang, Choromanska, LeCun, "Deep learning with Elastic Averaging SGD", NeurIPS 2015
(Async EASGD, EAMSGD); You, Buluc, Demmel, "Scaling Deep Learning on GPU and Knights
Landing clusters", SC17 (Async EASGD / MEASGD / Hogwild EASGD and the Async SGD, Async
MSGD, Hogwild SGD baselines). Notation of ``ALGORITHMS.md``: x a worker's variable, c the
center, alpha the moving rate, eta the learning rate, delta (mu) the momentum.

* Elastic exchange with one worker (the server's rule, applied on arrival)::

      d = alpha * (x - c);   c <- c + d;   the worker then sets x <- x - d

* EAMSGD, Nesterov form, on the worker::

      v <- delta * v;  x_look = x + v;  g = grad(x_look)
      x <- x_look - eta * g;  v <- v - eta * g

  written here as a look-ahead (:func:`nesterov_lookahead`) and a velocity update from the
  optimizer's own displacement (:func:`nesterov_velocity_update`), so any optimizer's step
  (weight decay included) replaces ``- eta * g``.

* Async SGD / MSGD / Hogwild SGD (server or shared-memory rule, PyTorch SGD semantics)::

      g' = g + wd * w;  b <- mu * b + g'  (b = g' the first time);  w <- w - eta * b

  mu = 0 is plain SGD (no buffer is kept).
"""

from __future__ import annotations

import torch

__all__ = [
    "server_elastic_update",
    "nesterov_lookahead",
    "nesterov_velocity_update",
    "sgd_update",
    "check_momentum",
]


def check_momentum(key: str, value: object) -> float:
    """A momentum in [0, 1).

    Raises:
        ValueError: naming ``key`` when ``value`` is not a number in [0, 1).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{key} must be a number in [0, 1), got {value!r}")
    return float(value)


@torch.no_grad()
def server_elastic_update(center: torch.Tensor, x: torch.Tensor, alpha: float) -> torch.Tensor:
    """Async EASGD server rule for one arriving worker: ``d = alpha (x - c); c <- c + d``.

    Args:
        center: the center c, updated in place.
        x: the worker's variable as sent.
        alpha: moving rate in (0, 1).

    Returns:
        The elastic difference d (a new tensor) that the worker subtracts from its x.
    """
    diff = (x - center).mul_(alpha)
    center.add_(diff)
    return diff


@torch.no_grad()
def nesterov_lookahead(x: torch.Tensor, velocity: torch.Tensor, delta: float) -> torch.Tensor:
    """EAMSGD look-ahead: ``v <- delta v; x <- x + v`` (both in place); returns x.

    The gradient of this step is then taken at the returned point.
    """
    velocity.mul_(delta)
    return x.add_(velocity)


@torch.no_grad()
def nesterov_velocity_update(
    velocity: torch.Tensor, x_look: torch.Tensor, x_after: torch.Tensor
) -> torch.Tensor:
    """EAMSGD velocity: ``v <- v + (x_after - x_look)`` = ``v - eta g`` for plain SGD (in place)."""
    return velocity.add_(x_after - x_look)


@torch.no_grad()
def sgd_update(
    weights: torch.Tensor,
    grad: torch.Tensor,
    lr: float,
    *,
    momentum: float = 0.0,
    buffer: torch.Tensor | None = None,
    weight_decay: float = 0.0,
) -> torch.Tensor | None:
    """One SGD (heavy-ball) step on ``weights`` in place, PyTorch ``torch.optim.SGD`` semantics.

    Args:
        weights: w, updated in place.
        grad: g at (a possibly stale copy of) w.
        lr: eta.
        momentum: mu in [0, 1); 0 keeps no buffer.
        buffer: the momentum buffer b from the previous call (None the first time).
        weight_decay: wd (L2 term added to the gradient).

    Returns:
        The momentum buffer to pass to the next call (None when ``momentum == 0``).
    """
    step = grad if weight_decay == 0 else grad.add(weights, alpha=weight_decay)
    if momentum:
        if buffer is None:
            buffer = step.clone()
        else:
            buffer.mul_(momentum).add_(step)
        step = buffer
    weights.add_(step, alpha=-lr)
    return buffer if momentum else None
