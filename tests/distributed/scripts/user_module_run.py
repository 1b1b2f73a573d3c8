"""A user's own LightningModule trained with ``Trainer(strategy="sync_easgd")``.

Lightning's default launcher re-runs this script for rank 1, exactly as a user's script.
Usage: user_module_run.py OUT
"""

import os
import sys

import pytorch_lightning as pl
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import easgd_lightning  # noqa: F401  -- registers "sync_easgd"


class TinyNet(pl.LightningModule):
    """Nothing EASGD-specific in here."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def main() -> None:
    out = sys.argv[1]
    pl.seed_everything(0, verbose=False)
    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target)
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    model = TinyNet()
    trainer = pl.Trainer(
        strategy="sync_easgd", accelerator="cpu", devices=2, max_epochs=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, loader)
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    center = trainer.strategy.center.clone()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save(
        {"acc": acc, "flat": flat, "center": center[: flat.numel()], "strategy": type(trainer.strategy).__name__},
        os.path.join(out, f"rank{trainer.global_rank}.pt"),
    )


if __name__ == "__main__":
    main()
