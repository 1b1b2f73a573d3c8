"""A plain classification LightningModule: cross-entropy, accuracy, SGD with optional schedule.

Nothing in it knows about distribution; every strategy trains it unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F

from easgd_lightning.utils.checks import check_positive

__all__ = ["ClassifierModule", "SCHEDULES", "OPTIMIZERS"]

SCHEDULES = ("constant", "cosine", "step", "multistep")
OPTIMIZERS = ("sgd", "adamw")


class ClassifierModule(pl.LightningModule):
    """Wraps ``net`` with a loss, metrics and the optimizer described by the config.

    Args:
        net: the network.
        lr: learning rate; momentum, weight_decay, nesterov: SGD options.
        optimizer: ``sgd`` or ``adamw``.
        schedule: ``constant``, ``cosine``, ``step`` (multiply by ``gamma`` every
            ``step_size`` steps after warm-up) or ``multistep`` (multiply by ``gamma`` at each
            of ``milestones``, counted from the first step); all per optimizer step, after a
            linear warm-up of ``warmup_steps`` steps.
        total_steps: horizon of the cosine schedule (null: the whole run,
            ``trainer.estimated_stepping_batches``); step_size/gamma for the step schedule.
        milestones: optimizer steps of the multistep schedule.
        warmup_epochs, step_size_epochs, milestone_epochs: the same lengths in epochs, as
            papers state them; when set they replace ``warmup_steps`` / ``step_size`` /
            ``milestones``, converted with the run's optimizer steps per epoch (per-worker
            batches per epoch after ``limit_train_batches`` and gradient accumulation).
        channels_last: use channels-last memory format for 4-D inputs.

    After ``configure_optimizers`` the schedule in optimizer steps is in
    ``resolved_schedule`` (a dict).
    """

    def __init__(
        self,
        net: nn.Module,
        lr: float = 0.05,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        optimizer: str = "sgd",
        schedule: str = "constant",
        warmup_steps: int = 0,
        total_steps: int | None = 1000,
        step_size: int = 1000,
        gamma: float = 0.1,
        min_lr: float = 0.0,
        milestones: list[int] | None = None,
        warmup_epochs: float | None = None,
        step_size_epochs: float | None = None,
        milestone_epochs: list[float] | None = None,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        if schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule={schedule!r}; choose one of {', '.join(SCHEDULES)}")
        for key, value in (("warmup_epochs", warmup_epochs), ("step_size_epochs", step_size_epochs)):
            check_positive(f"optim.{key}", value, allow_zero=True, nullable=True)
        if schedule == "multistep" and milestones is None and milestone_epochs is None:
            raise ValueError("optim.schedule=multistep needs optim.milestones or optim.milestone_epochs")
        self.net = net
        self.save_hyperparameters(ignore=["net"])
        self.resolved_schedule: dict[str, Any] = {}
        if channels_last:
            self.net = self.net.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.hparams.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.net(x)

    def loss_and_correct(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Mean loss, number of correct predictions and batch size."""
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.float(), y)
        correct = (logits.argmax(dim=-1) == y).sum()
        return loss, correct, y.numel()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, correct, n = self.loss_and_correct(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/acc", correct.float() / n)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, correct, n = self.loss_and_correct(batch)
        self.log("val/loss", loss, sync_dist=True, prog_bar=True)
        self.log("val/acc", correct.float() / n, sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        hp = self.hparams
        if hp.optimizer == "sgd":
            opt = torch.optim.SGD(
                self.parameters(), lr=hp.lr, momentum=hp.momentum,
                weight_decay=hp.weight_decay, nesterov=hp.nesterov and hp.momentum > 0,
            )
        elif hp.optimizer == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        else:
            raise ValueError(f"optim.optimizer={hp.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        self.resolved_schedule = self._resolve_schedule()
        if hp.schedule == "constant" and self.resolved_schedule["warmup_steps"] == 0:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=self._lr_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch of this run (needs the Trainer)."""
        trainer = self._trainer
        if trainer is None:
            raise ValueError(
                "optim.*_epochs and optim.total_steps=null need a Trainer (they are converted "
                "with the run's steps per epoch); give the lengths in steps instead"
            )
        trainer.estimated_stepping_batches  # noqa: B018  (loads the train loader, sets the count)
        batches = trainer.num_training_batches
        if not math.isfinite(batches):
            raise ValueError("optim.*_epochs needs a training loader with a length")
        return max(1, math.ceil(int(batches) / max(1, trainer.accumulate_grad_batches)))

    def _resolve_schedule(self) -> dict[str, Any]:
        """The schedule in optimizer steps (epoch-denominated lengths converted)."""
        hp = self.hparams
        uses_epochs = any(
            v is not None for v in (hp.warmup_epochs, hp.step_size_epochs, hp.milestone_epochs)
        ) or (hp.schedule == "cosine" and hp.total_steps is None)
        per_epoch = self._steps_per_epoch() if uses_epochs else None

        def steps(epochs: float | None, default: Any) -> Any:
            return default if epochs is None else int(round(float(epochs) * per_epoch))

        total = hp.total_steps
        if total is None:
            total = int(self._trainer.estimated_stepping_batches) if self._trainer is not None else 1000
        milestones = hp.milestones
        if hp.milestone_epochs is not None:
            milestones = [steps(e, 0) for e in hp.milestone_epochs]
        return {
            "schedule": hp.schedule,
            "lr": hp.lr,
            "steps_per_epoch": per_epoch,
            "warmup_steps": steps(hp.warmup_epochs, int(hp.warmup_steps or 0)),
            "step_size": max(1, steps(hp.step_size_epochs, int(hp.step_size))),
            "gamma": hp.gamma,
            "milestones": sorted(int(m) for m in (milestones or [])),
            "total_steps": int(total),
        }

    def _lr_factor(self, step: int) -> float:
        hp = self.hparams
        r = self.resolved_schedule or self._resolve_schedule()
        warmup = r["warmup_steps"]
        if warmup and step < warmup:
            return (step + 1) / warmup
        s = step - warmup
        floor = hp.min_lr / hp.lr if hp.lr else 0.0
        if hp.schedule == "cosine":
            horizon = max(1, r["total_steps"] - warmup)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(s, horizon) / horizon))
        if hp.schedule == "step":
            return hp.gamma ** (s // r["step_size"])
        if hp.schedule == "multistep":
            return hp.gamma ** sum(1 for m in r["milestones"] if step >= m)
        return 1.0
