"""One rank of the Fabric-versus-Trainer runs (launched torchrun-style by test_fabric_strategies.py).

Usage: fabric_run.py OUT
For each case: the same network, seed, optimizer, per-rank batches and strategy options,
trained once by ``pl.Trainer`` (``precision="64-true"``) and once by a hand-written Lightning
Fabric loop (``fabric.backward(loss); optimizer.step()``, ``fabric.strategy.finish()`` at
the end), in the same process group. Saves per case both final parameter lists, the
initial ones, each path's step count and (sync_easgd) the exchanges still in flight when
the next difference was formed, the Fabric strategy's summary extras, and (the center
strategies) the parameters inside ``holding_center()`` and after it, before ``finish()``.
"""

import os
import sys

import pytorch_lightning as pl
import torch
from lightning_fabric import Fabric
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import easgd_lightning.fabric as ef
from easgd_lightning.hooks import build_compressor
from easgd_lightning.strategies import (
    CompressedDDPStrategy,
    DiLoCoStrategy,
    RoundRobinEASGDStrategy,
    SyncEASGDStrategy,
)

DIM, HIDDEN, BATCH, LR, MOMENTUM, STEPS = 5, 8, 8, 0.05, 0.5, 10
TOPK = {"name": "topk", "ratio": 0.3, "min_numel": 4}  # error feedback (the default memory)


def topk():
    params = dict(TOPK)
    return build_compressor(params.pop("name"), **params)


#: name -> (the Trainer's strategy, the Fabric strategy); a fresh object (and compressor) each
CASES = {
    "ddp_compressed": (lambda: CompressedDDPStrategy(compression=topk()),
                       lambda: ef.strategy("ddp_compressed", compression=TOPK)),
    "sync_easgd_topk": (lambda: SyncEASGDStrategy(tau=2, alpha=0.3, compression=topk()),
                        lambda: ef.strategy("sync_easgd", tau=2, alpha=0.3, compression=TOPK)),
    "sync_easgd": (lambda: "sync_easgd", lambda: "sync_easgd"),  # by name: the defaults, both registries
    "local_sgd": (lambda: "local_sgd", lambda: "local_sgd"),  # tau 8: 10 steps end in a partial round
    "diloco": (lambda: DiLoCoStrategy(tau=4, fragments=2), lambda: ef.strategy("diloco", tau=4, fragments=2)),
    "easgd_round_robin": (lambda: RoundRobinEASGDStrategy(tau=2, alpha=0.3),
                          lambda: ef.strategy("easgd_round_robin", tau=2, alpha=0.3)),
}


def rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(STEPS * BATCH, DIM, generator=g, dtype=torch.float64)
    y = (x @ torch.arange(1.0, DIM + 1, dtype=torch.float64)).tanh().unsqueeze(1)
    return x, y


def net() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


class Lit(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return optimizer(self.net)


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def trainer_fit(strategy, x, y, world: int) -> dict:
    lit = Lit()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, precision="64-true", max_steps=STEPS,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(lit, DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False))
    used = trainer.strategy
    return {"final": params(lit.net), "steps": used.local_steps,
            "overlapped": getattr(used, "exchanges_overlapped", None)}


def fabric_fit(strategy, x, y, world: int) -> dict:
    """The user's loop: no Trainer, no LightningModule. Fabric's ``64-true`` hands the
    module's output back in the default dtype: with float64 the default, the loss is
    computed in float64, as the Trainer's ``training_step`` computes it."""
    fabric = Fabric(accelerator="cpu", devices=world, strategy=strategy, precision="64-true")
    fabric.launch()
    model = net()
    model, opt = fabric.setup(model, optimizer(model))
    torch.set_default_dtype(torch.float64)
    try:
        for t in range(STEPS):
            xb, yb = x[t * BATCH : (t + 1) * BATCH], y[t * BATCH : (t + 1) * BATCH]
            opt.zero_grad()
            fabric.backward(F.mse_loss(model(xb), yb))
            opt.step()
    finally:
        torch.set_default_dtype(torch.float32)
    held = worker = None
    if hasattr(fabric.strategy, "holding_center"):  # the center strategies
        with fabric.strategy.holding_center():
            held = params(model)
        worker = params(model)
    fabric.strategy.finish()
    used = getattr(fabric.strategy, "exchange", fabric.strategy)
    return {"final": params(model), "held": held, "worker": worker,
            "steps": used.local_steps, "extras": used.summary_extras(),
            "overlapped": getattr(used, "exchanges_overlapped", None), "strategy": used.strategy_name}


def main() -> None:
    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    x, y = rank_data(rank)
    results = {"init": params(net().double())}
    for case, (for_trainer, for_fabric) in CASES.items():
        results[case] = {"trainer": trainer_fit(for_trainer(), x, y, world),
                         "fabric": fabric_fit(for_fabric(), x, y, world)}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
