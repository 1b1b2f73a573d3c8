"""One cell of the README's feature table: a two-layer module on digits trained through
``Trainer(strategy=STRATEGY)`` (Lightning's own launcher re-runs this script for each rank).

Features: ``auto`` (baseline), ``manual`` (one optimizer, ``automatic_optimization=False``),
``two_opt`` (two optimizers, manual), ``accum`` (``accumulate_grad_batches=2``), ``clip``
(``gradient_clip_val=1e-9``: nothing may move), ``sched`` (a scheduler with factor 0: nothing
may move), ``metric`` (a torchmetrics accuracy logged on epoch), ``bf16-mixed``, ``64-true``.
Writes OUT/STRATEGY-FEATURE-rankR.json (status, optimizer steps, largest weight change,
accuracy) and OUT/STRATEGY-FEATURE-rankR.pt (the final weights).

Usage: feature_run.py STRATEGY FEATURE OUT
"""

import json
import os
import sys

import pytorch_lightning as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import easgd_lightning  # noqa: F401  -- registers the strategy names

STRATEGY, FEATURE, OUT = sys.argv[1], sys.argv[2], sys.argv[3]


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.Tanh())
        self.head = nn.Linear(32, 10)
        self.automatic_optimization = FEATURE not in ("manual", "two_opt")
        if FEATURE == "metric":
            import torchmetrics

            self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10)

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.automatic_optimization:
            return loss
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        for opt in opts:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in opts:
            opt.step()
        return loss

    def validation_step(self, batch, batch_idx):
        if FEATURE == "metric":
            x, y = batch
            self.acc.update(self(x), y)
            self.log("val/acc", self.acc, on_epoch=True)

    def configure_optimizers(self):
        if FEATURE == "two_opt":
            return [torch.optim.SGD(self.body.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)]
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if FEATURE == "sched":  # the rate is 0 from the first step on
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
        return opt


def main() -> None:
    pl.seed_everything(0, verbose=False)
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    train = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)
    val = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=64)
    model = Net()
    init = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    kwargs = dict(
        accelerator="cpu", devices=3 if STRATEGY.startswith("async") else 2, max_epochs=2,
        limit_train_batches=8, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    if FEATURE == "accum":
        kwargs["accumulate_grad_batches"] = 2
    if FEATURE == "clip":
        kwargs["gradient_clip_val"] = 1e-9
    if FEATURE in ("bf16-mixed", "64-true"):
        kwargs["precision"] = FEATURE
    trainer = pl.Trainer(strategy=STRATEGY, **kwargs)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    record: dict = {"strategy": STRATEGY, "feature": FEATURE, "rank": rank}
    try:
        trainer.fit(model, train, val)
        final = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        record.update(
            status="ok",
            steps=int(getattr(trainer.strategy, "local_steps", trainer.global_step)),
            moved=float((final - init).abs().max()),
            acc=float((model.float()(x).argmax(1) == y).float().mean()),
        )
        torch.save(final, os.path.join(OUT, f"{STRATEGY}-{FEATURE}-rank{rank}.pt"))
    except Exception as err:
        record.update(status="error", error=f"{type(err).__name__}: {err}")
    with open(os.path.join(OUT, f"{STRATEGY}-{FEATURE}-rank{rank}.json"), "w") as f:
        json.dump(record, f)
    if record["status"] != "ok":
        sys.exit(1)


if __name__ == "__main__":
    main()
