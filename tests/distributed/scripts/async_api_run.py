"""A user's own LightningModule under an asynchronous strategy, started as a user starts it:
``python async_api_run.py MODE STRATEGY OUT`` with ``Trainer(devices=3)``, so Lightning's
own launcher starts the other two ranks (no rendezvous variables in the environment).

MODE:
    gather: ``validation_step`` calls ``self.trainer.strategy.barrier()`` (recording the
        error it raises in OUT/barrier<R>.txt) and then ``self.all_gather(loss)``, which must
        fail at the call (the run fails; each rank writes OUT/gather<R>.txt with the error,
        or with the gathered shape if it returned).
    steplr: fit 2 short epochs with a ``StepLR`` scheduler; each rank writes OUT/done<R>.
    evaluate: SGD with momentum 0 (async_msgd warns once that it applies its own), fit 1 short
        epoch, then ``trainer.test`` and ``trainer.predict``; each rank saves OUT/rank<R>.pt
        with the sample indices its test_step and predict_step saw.
    refuse: Adam under the strategy (async_measgd refuses it at set-up).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import easgd_lightning  # noqa: F401  -- registers the strategy names

N_TRAIN, N_EVAL = 256, 90


class Net(pl.LightningModule):
    def __init__(self, mode: str, out: Path) -> None:
        super().__init__()
        self.mode, self.out = mode, out
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.tested: list[int] = []
        self.predicted: list[int] = []

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = F.cross_entropy(self(x), y)
        if self.mode == "gather":
            rank = self.trainer.global_rank
            try:
                self.trainer.strategy.barrier()
                (self.out / f"barrier{rank}.txt").write_text("returned")
            except RuntimeError as err:
                (self.out / f"barrier{rank}.txt").write_text(str(err))
            try:
                gathered = self.all_gather(loss)
            except RuntimeError as err:
                (self.out / f"gather{rank}.txt").write_text(str(err))
                raise
            (self.out / f"gather{rank}.txt").write_text(f"shape {list(gathered.shape)}")
        self.log("val_loss", loss)

    def test_step(self, batch, batch_idx):
        x, y, idx = batch
        self.tested += idx.tolist()
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        x, _, idx = batch
        self.predicted += idx.tolist()
        return self(x).argmax(1)

    def configure_optimizers(self):
        if self.mode == "refuse":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.0)
        if self.mode == "steplr":
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}
        return opt


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y, torch.arange(n))


def main(mode: str, strategy: str, out: Path) -> None:
    pl.seed_everything(0, verbose=False)
    model = Net(mode, out)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=3, max_epochs=2 if mode == "steplr" else 1,
        limit_train_batches=6, limit_val_batches=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
    )
    train = DataLoader(data(N_TRAIN, 1), batch_size=16, shuffle=True)
    evaluate = DataLoader(data(N_EVAL, 2), batch_size=8)
    trainer.fit(model, train, evaluate)
    rank = trainer.global_rank
    if mode == "steplr":
        (out / f"done{rank}").write_text(str(trainer.strategy.local_steps))
        return
    if mode == "evaluate":
        results = trainer.test(model, evaluate, verbose=False)
        predictions = trainer.predict(model, evaluate)
        torch.save({"tested": model.tested, "predicted": model.predicted, "results": results,
                    "n_predictions": sum(len(p) for p in predictions or [])}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
