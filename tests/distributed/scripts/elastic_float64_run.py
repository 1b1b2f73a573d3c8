"""One rank of a deterministic float64 EASGD run (launched torchrun-style by the tests).

Usage: elastic_float64_run.py OUT STRATEGY TAU ALPHA STEPS [overlap-pair [COMPRESSION]]
Linear regression, plain SGD (no momentum), per-rank fixed data, ``precision="64-true"``.
Saves the data, the initial parameters and the final module parameters of this rank.

``overlap-pair`` (sync_easgd): two fits in the same processes, ``strategy.overlap=false``
then ``true``, each saving the final parameters (= the center), the train loss of every
step, and how many exchanges were still in flight when the next difference was formed;
also the data and the initial parameters, for the reference.
COMPRESSION ``topk``: the weight (5 entries) is top-k compressed with residuals, the bias
(under ``min_numel``) travels dense.
"""

import os
import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import easgd_lightning  # noqa: F401  (registers names)
from easgd_lightning.hooks import build_compressor
from easgd_lightning.strategies import RoundRobinEASGDStrategy, SyncEASGDStrategy

DIM, BATCH, LR = 5, 8, 0.05


def rank_data(rank: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(steps * BATCH, DIM, generator=g, dtype=torch.float64)
    w = torch.arange(1, DIM + 1, dtype=torch.float64)
    y = (x @ w + 0.5 + 0.1 * torch.randn(steps * BATCH, generator=g, dtype=torch.float64)).unsqueeze(1)
    return x, y


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.lin = nn.Linear(DIM, 1)
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.lin(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def fit_pair(out: str, tau: int, alpha: float, steps: int, compression: str, rank: int, world: int) -> None:
    """sync_easgd with overlap false, then true, in the same process group."""
    x, y = rank_data(rank, steps)
    init = {k: v.detach().double().clone() for k, v in Regression().state_dict().items()}
    results = {"x": x, "y": y, "init": init}  # for the reference (every fit starts from init)
    for overlap in (False, True):
        model = Regression()
        comp = build_compressor("topk", ratio=0.4, min_numel=2) if compression == "topk" else None
        strategy = SyncEASGDStrategy(tau=tau, alpha=alpha, overlap=overlap, compression=comp)
        trainer = pl.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, precision="64-true",
            max_steps=steps, use_distributed_sampler=False, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False))
        results[overlap] = {
            "final": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "losses": torch.stack(model.losses),
            "overlapped": strategy.exchanges_overlapped,
            # weight and bias are views of one buffer (the resident elastic variable)
            "resident": model.lin.weight.untyped_storage().data_ptr()
            == model.lin.bias.untyped_storage().data_ptr(),
            "steps": strategy.local_steps,
        }
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def main() -> None:
    out, strategy_name, tau, alpha, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if len(sys.argv) > 6 and sys.argv[6] == "overlap-pair":
        fit_pair(out, tau, alpha, steps, sys.argv[7] if len(sys.argv) > 7 else "none", rank, world)
        return
    x, y = rank_data(rank, steps)
    model = Regression()
    init = {k: v.detach().double().clone() for k, v in model.state_dict().items()}
    cls = {"sync_easgd": SyncEASGDStrategy, "easgd_round_robin": RoundRobinEASGDStrategy}[strategy_name]
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=cls(tau=tau, alpha=alpha), precision="64-true",
        max_steps=steps, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False))
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"x": x, "y": y, "init": init, "final": final, "steps": trainer.strategy.local_steps,
                "dtype": str(next(model.parameters()).dtype)}, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
