"""Stop a run whose training loss is NaN or infinite, instead of training on garbage.

Rule: before every backward pass the loss of this rank is checked; a non-finite value
raises :class:`NonFiniteLossError` naming the optimizer step (1-based, counted like
``trainer.global_step``) and the rank, so the run ends with ``status: failed`` and that
message in ``summary.json``'s ``rank_errors``. It is checked before backward so the rank
stops before the step's gradient exchange; its peers then fail at their next exchange
(the connection closes) rather than averaging NaN into the model. ``trainer.
allow_nonfinite_loss=true`` turns the check off (e.g. mixed precision with dynamic loss
scaling, where an overflowing step is skipped on purpose).

``faults.nan_at_step`` / ``faults.nan_rank`` (tests): overwrite one parameter with NaN on
that rank just before that step, so its loss becomes NaN there.
"""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch

__all__ = ["NonFiniteLossError", "NonFiniteLossGuard", "NaNFaultInjection"]


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite."""


class NonFiniteLossGuard(pl.Callback):
    """Raises :class:`NonFiniteLossError` at the first non-finite training loss.

    Args:
        allow: ``allow_nonfinite_loss``: True skips the check.
    """

    def __init__(self, allow: bool = False) -> None:
        if not isinstance(allow, bool):
            raise ValueError(f"allow_nonfinite_loss must be true or false, got {allow!r}")
        self.allow = allow

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self.allow:
            return
        value = loss.detach()
        if bool(torch.isfinite(value).all()):
            return
        shown = float(value.reshape(-1)[0]) if value.numel() else math.nan
        raise NonFiniteLossError(
            f"train loss is {shown} at step {trainer.global_step + 1} on rank {trainer.global_rank} "
            f"(epoch {trainer.current_epoch}); stopped (set allow_nonfinite_loss=true to go on)"
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
