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

* Async SGD / MSGD / Hogwild SGD: the update applied to the shared weights w is the step of
  the user's own optimizer (its class, parameter groups, learning rates, weight decay and
  state) for the gradient g a worker computed at its copy of w
  (:func:`optimizer_step_on`). Parameters without a gradient (frozen ones,
  ``requires_grad=False``, or unused in the step) are skipped, as ``torch.optim`` skips them.
  Async MSGD's (and Hogwild SGD's, when set) heavy-ball momentum mu is SGD's momentum, PyTorch
  semantics (:func:`sgd_update` is the reference)::

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
    "bind_views",
    "optimizer_step_on",
    "momentum_buffers",
    "optimizer_displacement",
    "check_sgd_momentum",
    "check_fixed_lr",
    "CLI_TERMS",
    "api_terms",
]


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


def bind_views(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Make each tensor of ``params`` a view of consecutive slices of ``flat`` (values of
    ``flat`` kept): stepping an optimizer over ``params`` then moves ``flat`` in place."""
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat[offset : offset + n].view_as(p)
        offset += n


@torch.no_grad()
def optimizer_step_on(
    optimizer: torch.optim.Optimizer,
    params: list[torch.Tensor],
    grad: torch.Tensor,
    has_grad: list[bool],
    lrs: list[float],
) -> None:
    """One step of ``optimizer`` for the flat gradient ``grad`` (a worker's push).

    Args:
        optimizer: the user's optimizer over ``params`` (its state is updated).
        params: its parameters, in the order of ``grad``'s slices.
        grad: consecutive gradients of ``params``.
        has_grad: per parameter, whether the worker had a gradient; those without get
            ``grad = None``, which ``torch.optim`` skips (no weight decay, no state change).
        lrs: learning rate of each parameter group for this step.
    """
    offset = 0
    for p, has in zip(params, has_grad):
        n = p.numel()
        p.grad = grad[offset : offset + n].view_as(p) if has else None
        offset += n
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    try:
        optimizer.step()
    finally:
        for p in params:
            p.grad = None


@torch.no_grad()
def optimizer_displacement(before: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Per parameter, what an optimizer step moved it (``p - before``); None when it has no
    gradient (the step did not touch it)."""
    out: list[torch.Tensor | None] = []
    offset = 0
    for p in params:
        n = p.numel()
        out.append(None if p.grad is None else p.detach().reshape(-1) - before[offset : offset + n])
        offset += n
    return out


def momentum_buffers(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> torch.Tensor | None:
    """SGD's heavy-ball buffers of ``params``, flat (zeros where none yet); None when none."""
    bufs = [optimizer.state.get(p, {}).get("momentum_buffer") for p in params]
    if all(b is None for b in bufs):
        return None
    return torch.cat(
        [(b if b is not None else torch.zeros_like(p)).detach().reshape(-1).cpu() for b, p in zip(bufs, params)]
    )


#: how a refusal names what the user set: the CLI's keys, or the Python API's arguments
CLI_TERMS = {
    "momentum": "strategy.momentum", "optim_momentum": "optim.momentum", "use_sgd": "optim.optimizer=sgd",
    "no_momentum": "strategy.momentum=0", "lr": "strategy.lr", "no_lr": "strategy.lr=null",
}


def api_terms(cls: str) -> dict:
    """:data:`CLI_TERMS` in the Python API's words, for strategy class ``cls``."""
    return {
        "momentum": f"{cls}'s momentum", "optim_momentum": "the SGD's own momentum",
        "use_sgd": "return torch.optim.SGD from configure_optimizers", "no_momentum": f"{cls}(momentum=0)",
        "lr": f"{cls}'s lr", "no_lr": f"{cls}(lr=None)",
    }


def check_sgd_momentum(optimizer: torch.optim.Optimizer, mu: float, who: str, terms: dict | None = None) -> str | None:
    """Refusal of an optimizer under a strategy that applies heavy-ball momentum ``mu``
    itself (one line), else None; groups whose momentum is 0 get ``mu`` (in place).
    ``terms``: how to name the settings (:data:`CLI_TERMS` by default, :func:`api_terms`).

    Momentum on top of another optimizer's (Adam's first moment, a different SGD momentum)
    would be a rule neither the paper nor the user asked for, so it is refused, not mixed.
    """
    t = terms or CLI_TERMS
    if not isinstance(optimizer, torch.optim.SGD):
        return (
            f"{t['momentum']}: {who} applies heavy-ball SGD momentum ({mu}) and needs "
            f"torch.optim.SGD, got {type(optimizer).__name__} ({t['use_sgd']}; or set {t['no_momentum']})"
        )
    for i, group in enumerate(optimizer.param_groups):
        own = float(group.get("momentum", 0.0) or 0.0)
        if own not in (0.0, mu):
            return (
                f"{t['momentum']}={mu} and the optimizer's momentum={own} (param group {i}, "
                f"{t['optim_momentum']}) differ: {who} applies one momentum; make them equal or set one to 0"
            )
    for group in optimizer.param_groups:
        group["momentum"] = mu
    return None


def check_fixed_lr(optimizer: torch.optim.Optimizer, lr: float | None, who: str, terms: dict | None = None) -> str | None:
    """Refusal (one line) of a single fixed ``strategy.lr`` over groups with different lrs."""
    if lr is None:
        return None
    t = terms or CLI_TERMS
    own = sorted({float(g["lr"]) for g in optimizer.param_groups})
    if len(own) > 1:
        return (
            f"{t['lr']}={lr} would replace the different learning rates of the optimizer's "
            f"param groups {own} ({who}); set {t['no_lr']} to use each group's"
        )
    return None
