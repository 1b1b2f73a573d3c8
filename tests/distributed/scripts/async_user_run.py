"""One rank of a user's ordinary LightningModule trained with ``Trainer(strategy=NAME)``.

Nothing in the module is written for this project: a ``torchmetrics`` accuracy updated in
``validation_step`` and logged with ``on_epoch=True``, Adam with two parameter groups (the
second with lr 0; the first with weight decay and a frozen layer in it),
``ModelCheckpoint(monitor="val_loss")``.

Usage (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_* in the environment: tests/helpers.launch_ranks):
    async_user_run.py STRATEGY DEVICES OUT MODE

MODE:
    train: fit 3 epochs; every rank saves OUT/rank<R>.pt (see ``main``).
    collective: the module calls ``torch.distributed.all_reduce`` itself at the end of the
        first validation (a collective the parameter server never joins); timeout 8 s.
        Each rank writes OUT/rank<R>.err with the error it stopped with.
    hang: the same collective with a 300 s timeout; each worker writes OUT/hung<R> just
        before it blocks (the test then sends SIGTERM).
"""

from __future__ import annotations

import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import torch
import torchmetrics
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import easgd_lightning  # noqa: F401  -- registers the strategy names
from easgd_lightning.strategies import STRATEGY_CLASSES


class UserNet(pl.LightningModule):
    """An ordinary module: nothing in it knows about the strategy."""

    def __init__(self, mode: str, out: Path) -> None:
        super().__init__()
        self.mode, self.out = mode, out
        self.frozen = nn.Linear(64, 32)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(torch.tanh(self.frozen(x)))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.log("val_acc", self.val_acc, on_epoch=True)
        self.log("val_loss", F.cross_entropy(logits, y), on_epoch=True, batch_size=len(y))

    def on_validation_epoch_end(self) -> None:
        if self.mode == "train" or self.trainer.sanity_checking:
            return
        rank = self.trainer.global_rank
        (self.out / f"hung{rank}").touch()
        torch.distributed.all_reduce(torch.ones(1))  # the user's own collective

    def configure_optimizers(self):
        return torch.optim.Adam([
            {"params": [*self.frozen.parameters(), *self.hidden.parameters()], "lr": 0.01, "weight_decay": 1e-3},
            {"params": self.head.parameters(), "lr": 0.0},
        ])


class ScoreRecorder(Callback):
    """Right after each validation (before ModelCheckpoint saves): the weights the module
    was validated with and the values logged for them."""

    def __init__(self) -> None:
        self.scored: list[dict] = []

    def on_validation_end(self, trainer, module) -> None:
        if trainer.sanity_checking:
            return
        self.scored.append({
            "epoch": trainer.current_epoch,
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "val_acc": float(trainer.callback_metrics["val_acc"]),
            "val_loss": float(trainer.callback_metrics["val_loss"]),
        })


def digits() -> tuple[TensorDataset, TensorDataset]:
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target)
    return TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])


def main(strategy_name: str, devices: int, out: Path, mode: str) -> None:
    pl.seed_everything(0, verbose=False)
    train, val = digits()
    model = UserNet(mode, out)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    recorder = ScoreRecorder()
    checkpoint = ModelCheckpoint(dirpath=str(out / "ckpt"), monitor="val_loss", mode="min", save_top_k=1,
                                 filename="best-{epoch}")
    strategy: object = strategy_name
    if mode != "train":
        strategy = STRATEGY_CLASSES[strategy_name](timeout=timedelta(seconds=8 if mode == "collective" else 300))
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_epochs=3 if mode == "train" else 2,
        logger=False, callbacks=[recorder, checkpoint], enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=2,
    )
    try:
        trainer.fit(model, DataLoader(train, batch_size=32, shuffle=True), DataLoader(val, batch_size=64))
    except BaseException as err:
        (out / f"rank{trainer.global_rank}.err").write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        raise
    torch.save({
        "role": trainer.strategy.summary_extras()["role"],
        "initial": initial,
        "final": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "scored": recorder.scored,
        "best_path": checkpoint.best_model_path,
        "best_score": None if checkpoint.best_model_score is None else float(checkpoint.best_model_score),
        "steps": trainer.strategy.local_steps,
    }, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
