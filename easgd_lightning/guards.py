"""Stop a run whose training loss is NaN or infinite, instead of training on garbage.

Rule: before every backward pass the loss of this rank is checked; a non-finite value
raises :class:`NonFiniteLossError` naming the optimizer step (1-based, counted like
``trainer.global_step``) and the rank, so the run ends with ``status: failed`` and that
message in ``summary.json``'s ``rank_errors``. It is checked before backward so the rank
stops before the step's gradient exchange; its peers then fail at their next exchange
(the connection closes) rather than averaging NaN into the model. ``trainer.
allow_nonfinite_loss=true`` turns the check off (e.g. mixed precision with dynamic loss
scaling, where an overflowing step is skipped on purpose).

Exploding loss (``loss_explosion_factor``, default 1e4; null turns it off): a finite loss
above ``loss_explosion_factor x max(|L1|, 1)``, where ``L1`` is this rank's first training
loss of the fit, raises the same error: the run has diverged although no value overflowed
yet (``optim.lr=1e6`` on the digits MLP: losses of 1e28). ``max(..., 1)`` keeps a loss that
starts near zero from tripping it on noise. The CLI ends such a run with ``status:
diverged`` (README "Signals, exit codes and run directories").

``faults.nan_at_step`` / ``faults.nan_rank`` (tests): overwrite one parameter with NaN on
that rank just before that step, so its loss becomes NaN there.
"""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch

from easgd_lightning.utils.checks import check_bool, check_float

__all__ = ["NonFiniteLossError", "NonFiniteLossGuard", "NaNFaultInjection"]


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite, or exploded (the run diverged)."""

    def __init__(self, message: str, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


class NonFiniteLossGuard(pl.Callback):
    """Raises :class:`NonFiniteLossError` at the first non-finite training loss.

    Args:
        allow: ``allow_nonfinite_loss``: True skips the non-finite check.
        explosion_factor: ``loss_explosion_factor``: a finite loss above this times
            ``max(|first loss|, 1)`` has exploded (None: not checked).
    """

    def __init__(self, allow: bool = False, explosion_factor: float | None = None) -> None:
        self.allow = check_bool("allow_nonfinite_loss", allow)
        self.factor = check_float("loss_explosion_factor", explosion_factor, 1.0, lo_open=True, nullable=True)
        self.first: float | None = None

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        value = loss.detach()
        step = trainer.global_step + 1
        where = f"at step {step} on rank {trainer.global_rank} (epoch {trainer.current_epoch})"
        if not bool(torch.isfinite(value).all()):
            if self.allow:
                return
            shown = float(value.reshape(-1)[0]) if value.numel() else math.nan
            raise NonFiniteLossError(
                f"train loss is {shown} {where}; stopped (set allow_nonfinite_loss=true to go on)", step
            )
        if self.factor is None or not value.numel():
            return
        current = float(value.float().mean())
        if self.first is None:
            self.first = current
            return
        bound = self.factor * max(abs(self.first), 1.0)
        if current > bound:
            raise NonFiniteLossError(
                f"train loss {current:.4g} {where} exploded: above loss_explosion_factor={self.factor:g} "
                f"x max(|first loss {self.first:.4g}|, 1) = {bound:.4g}; stopped (lower optim.lr, or set "
                "loss_explosion_factor=null to go on)", step
            )


class NaNFaultInjection(pl.Callback):
    """``faults.nan_at_step`` (1-based optimizer step) on ``faults.nan_rank`` (None: every
    rank): fill the module's first parameter with NaN just before that step."""

    def __init__(self, nan_at_step: int | None = None, nan_rank: int | None = None, **_: Any) -> None:
        self.at_step, self.rank = nan_at_step, nan_rank

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.at_step is None or trainer.global_step + 1 != self.at_step:
            return
        if self.rank is not None and trainer.global_rank != self.rank:
            return
        with torch.no_grad():
            next(pl_module.parameters()).fill_(math.nan)
