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

__all__ = ["ClassifierModule"]


class ClassifierModule(pl.LightningModule):
    """Wraps ``net`` with a loss, metrics and the optimizer described by the config.

    Args:
        net: the network.
        lr: learning rate; momentum, weight_decay, nesterov: SGD options.
        optimizer: ``sgd`` or ``adamw``.
        schedule: ``constant``, ``cosine`` or ``step`` (per step, with linear ``warmup_steps``).
        total_steps: horizon of the cosine schedule; step_size/gamma for the step schedule.
        channels_last: use channels-last memory format for 4-D inputs.
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
        total_steps: int = 1000,
        step_size: int = 1000,
        gamma: float = 0.1,
        min_lr: float = 0.0,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        self.net = net
        self.save_hyperparameters(ignore=["net"])
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
            raise ValueError(f"optim.optimizer={hp.optimizer!r}; choose sgd or adamw")
        if hp.schedule == "constant" and hp.warmup_steps == 0:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=self._lr_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def _lr_factor(self, step: int) -> float:
        hp = self.hparams
        if hp.warmup_steps and step < hp.warmup_steps:
            return (step + 1) / hp.warmup_steps
        s = step - hp.warmup_steps
        floor = hp.min_lr / hp.lr if hp.lr else 0.0
        if hp.schedule == "cosine":
            horizon = max(1, hp.total_steps - hp.warmup_steps)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(s, horizon) / horizon))
        if hp.schedule == "step":
            return hp.gamma ** (s // max(1, hp.step_size))
        return 1.0
