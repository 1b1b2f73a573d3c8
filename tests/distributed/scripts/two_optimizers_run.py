"""A user's module with two optimizers, ``Trainer(strategy=NAME)``: the strategy's setup must
refuse it in one line (Lightning's own launcher re-runs this script for rank 1).

Usage: two_optimizers_run.py STRATEGY
"""

import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import easgd_lightning  # noqa: F401  -- registers the strategy names


class TwoOptimizers(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 4), nn.Linear(4, 2)
        self.automatic_optimization = False  # Lightning needs it for several optimizers

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.head(self.body(x)), y)
        for opt in self.optimizers():
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()

    def configure_optimizers(self):
        return [torch.optim.SGD(self.body.parameters(), lr=0.1), torch.optim.SGD(self.head.parameters(), lr=0.1)]


def main() -> None:
    data = TensorDataset(torch.randn(32, 8), torch.randint(0, 2, (32,)))
    trainer = pl.Trainer(
        strategy=sys.argv[1], accelerator="cpu", devices=2, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(TwoOptimizers(), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    main()
