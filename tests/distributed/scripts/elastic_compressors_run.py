"""One rank of the new compressors under the elastic strategies (launched torchrun-style).

Usage: elastic_compressors_run.py OUT CASE[,CASE...]   (CASE = STRATEGY/COMPRESSOR, e.g.
sync_easgd/gcomp, local_sgd/two_way; the compressor ``two_way`` is top-k wrapped in
TwoWayCompressor). Every case is one short ``Trainer.fit`` of a 16 -> 32 linear layer
(the 512-entry weight is compressed, the 32-entry bias travels dense) in the same process
group; the rank saves, per case, the final module parameters (the center, on every rank),
its optimizer steps, the bytes the meter counted for the exchange kind during the fit, and
what the case's compressor state says (DGC: the density of every exchange, its momentum
buffer).
"""

import os
import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import easgd_lightning  # noqa: F401  (registers names)
from easgd_lightning.comm.meter import get_meter
from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks.compressors.two_way import TwoWayCompressor
from easgd_lightning.strategies import LocalSGDStrategy, SyncEASGDStrategy

DIM, OUT, BATCH, STEPS, LR = 16, 32, 8, 6, 0.05
#: the weight (512 entries) is compressed, the bias (32) is under min_numel
MIN_NUMEL = 64
#: sync_easgd exchanges every step, local_sgd every TAU_LOCAL steps
TAU = {"sync_easgd": 1, "local_sgd": 2}

COMPRESSORS = {
    "none": lambda: None,
    "gcomp": lambda: build_compressor("gcomp", mantissa_bits=23, min_numel=MIN_NUMEL),
    "lgc": lambda: build_compressor("lgc", ratio=0.1, coder_warmup_steps=2, train_iters=5, hidden=8,
                                    block=64, min_numel=MIN_NUMEL),
    "sparse_gc": lambda: build_compressor("sparse_gc", ratio=0.05, min_numel=MIN_NUMEL),
    "acpsgd": lambda: build_compressor("acpsgd", rank=2, min_numel=MIN_NUMEL),
    "two_way": lambda: TwoWayCompressor(build_compressor("topk", ratio=0.1, min_numel=MIN_NUMEL)),
    # 3 batches per epoch: warm-up of one epoch = optimizer steps 0..2
    "dgc": lambda: build_compressor("dgc", ratio=0.01, momentum=0.9, warmup_ratio_epochs=1,
                                    warmup_ratios=[0.5, 0.25, 0.125], sample_ratio=1.0,
                                    min_numel=MIN_NUMEL),
}


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.lin = nn.Linear(DIM, OUT)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.lin(x).sum(1, keepdim=True), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def rank_data(rank: int) -> TensorDataset:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(3 * BATCH, DIM, generator=g)
    return TensorDataset(x, (x.sum(1) + 0.1 * torch.randn(3 * BATCH, generator=g)).unsqueeze(1))


def _states(tree):
    """Every per-tensor state dict in a compressor-state tree (the ones that stepped)."""
    if isinstance(tree, dict):
        if "step" in tree or "last_density" in tree:
            yield tree
        for v in tree.values():
            yield from _states(v)


class Densities(pl.Callback):
    """DGC: the density of the weight's exchange after each optimizer step."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dens = [s["last_density"] for s in _states(trainer.strategy._compress_state) if "last_density" in s]
        self.seen.append(dens[0] if dens else None)


def run_case(case: str, rank: int, world: int) -> dict:
    strategy_name, comp_name = case.split("/")
    comp = COMPRESSORS[comp_name]()
    tau = TAU[strategy_name]
    strategy = (SyncEASGDStrategy(tau=tau, beta=0.9, compression=comp) if strategy_name == "sync_easgd"
                else LocalSGDStrategy(tau=tau, compression=comp))
    kind = strategy.comm_kind
    meter = get_meter().by_kind[kind]
    before = meter.bytes_sent, meter.dense_bytes, meter.calls
    model = Regression()
    densities = Densities()
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[densities],
    )
    trainer.fit(model, DataLoader(rank_data(rank), batch_size=BATCH, shuffle=False))
    meter = get_meter().by_kind[kind]
    out = {
        "center": torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]),
        "init": torch.cat([p.detach().reshape(-1).clone() for p in Regression().parameters()]),
        "steps": strategy.local_steps,
        "bytes_sent": meter.bytes_sent - before[0],
        "dense_bytes": meter.dense_bytes - before[1],
        "optimizer_momentum": trainer.optimizers[0].param_groups[0]["momentum"],
    }
    if comp_name == "dgc":
        states = list(_states(strategy._compress_state))
        out["densities"] = densities.seen
        out["gradient_mode"] = comp.gradient_mode
        out["u_max"] = max(float(s["u"].abs().max()) for s in states if "u" in s)
    return out


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2].split(",")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.save({case: run_case(case, rank, world) for case in cases}, os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
