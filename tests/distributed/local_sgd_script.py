"""One rank of a local SGD test run (launched by tests/distributed/test_local_sgd.py).

Usage: ``python local_sgd_script.py MODE[,MODE...] OUT_DIR`` with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT set; the modes run one after the other in the same
processes (one process group, a fresh Trainer each). Modes:

* ``constant``: small float64 MLP, H = 3; records every step's parameters right after the
  optimizer step (before any averaging, via an optimizer step post-hook) and at the end of
  the batch (after averaging), and the final module parameters.
* ``overlap``: float64 linear regression with full-batch, rank-specific data, plain SGD,
  CoCoD-SGD overlap with H = 3; saves the data, the initial and the final parameters.
* ``qsr_cosine`` / ``qsr_step``: QSR under a cosine (with warm-up) or step schedule;
  the periods go to a CSV logger and to the saved record.
* ``compressed``: constant H = 2 with an fp16 compressor on the parameter differences.

Each rank writes ``OUT_DIR/MODE/rank<R>.pt``.
"""

from __future__ import annotations

import math
import os
import sys

import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from easgd_lightning.comm import reset_meter
from easgd_lightning.strategies.base import flatten
from easgd_lightning.strategies.local_sgd import LocalSGDStrategy
from tests.helpers import QUIET_TRAINER

QSR_LR = 0.2
QSR_H_BASE = 2
QSR_GAMMA = 0.25
QSR_STEPS = 40
QSR_WARMUP = 4
QSR_STEP_SIZE = 10
QSR_STEP_GAMMA = 0.5


class Recorder(pl.Callback):
    """Parameters after each optimizer step (pre-average) and after each batch (post-average)."""

    def __init__(self) -> None:
        self.pre: list[torch.Tensor] = []
        self.post: list[torch.Tensor] = []

    def on_train_start(self, trainer, pl_module) -> None:
        params = list(pl_module.parameters())

        def hook(optimizer, args, kwargs):
            self.pre.append(flatten(params).clone())

        trainer.optimizers[0].register_step_post_hook(hook)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.post.append(flatten(list(pl_module.parameters())).clone())


class Regression(pl.LightningModule):
    """Least squares on a full batch; plain SGD (optionally with an lr schedule)."""

    def __init__(self, d_in: int, d_out: int, lr: float, schedule: str = "constant") -> None:
        super().__init__()
        self.net = (
            nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Linear(8, d_out))
            if d_out > 1
            else nn.Linear(d_in, 1)
        )
        self.lr = lr
        self.schedule = schedule

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        if self.schedule == "constant":
            return opt
        if self.schedule == "cosine":
            fn = lambda s: (  # noqa: E731
                (s + 1) / QSR_WARMUP
                if s < QSR_WARMUP
                else 0.5 * (1 + math.cos(math.pi * (s - QSR_WARMUP) / (QSR_STEPS - QSR_WARMUP)))
            )
        else:
            fn = lambda s: QSR_STEP_GAMMA ** (s // QSR_STEP_SIZE)  # noqa: E731
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=fn)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def rank_data(rank: int, n: int, d_in: int, d_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    w = torch.randn(d_in, d_out, generator=g, dtype=torch.float64)
    y = x @ w + 0.1 * torch.randn(n, d_out, generator=g, dtype=torch.float64) + rank
    return x, y


def main() -> None:
    modes, out_root = sys.argv[1].split(","), sys.argv[2]
    env = dict(os.environ)
    for mode in modes:
        os.environ.update(env)  # Lightning's environment teardown removes WORLD_SIZE
        out_dir = os.path.join(out_root, mode)
        os.makedirs(out_dir, exist_ok=True)
        run_mode(mode, out_dir)


def run_mode(mode: str, out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    meter = reset_meter()
    # different initial weights per rank: the strategy's broadcast must make them equal
    pl.seed_everything(rank, verbose=False)
    record: dict = {"rank": rank}
    logger: object = False
    recorder = Recorder()
    if mode in ("constant", "compressed"):
        x, y = rank_data(rank, 24, 5, 3)
        module = Regression(5, 3, lr=0.05)
        loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)
        steps, epochs = 10, 2
        kwargs: dict = {"tau": 3 if mode == "constant" else 2}
        if mode == "compressed":
            from easgd_lightning.hooks import build_compressor

            kwargs["compression"] = build_compressor(name="fp16", min_numel=0)
    elif mode == "overlap":
        x, y = rank_data(rank, 16, 4, 1)
        module = Regression(4, 1, lr=0.05)
        loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
        steps, epochs = 11, 11
        kwargs = {"tau": 3, "cocod": True}
        record["data"] = (x, y)
    elif mode in ("qsr_cosine", "qsr_step"):
        x, y = rank_data(rank, 40, 5, 3)
        module = Regression(5, 3, lr=QSR_LR, schedule=mode.split("_")[1])
        loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)
        steps, epochs = QSR_STEPS, 4
        kwargs = {"tau_rule": "qsr", "tau_base": QSR_H_BASE, "qsr_coefficient": QSR_GAMMA}
        if mode == "qsr_cosine":
            kwargs["qsr_warmup_steps"] = QSR_WARMUP
        from pytorch_lightning.loggers import CSVLogger

        logger = CSVLogger(save_dir=out_dir, name="csv", version="")
    else:
        raise SystemExit(f"unknown mode {mode}")
    record["init_local"] = flatten(list(module.double().parameters())).clone()

    class Init(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            record["init"] = flatten(list(pl_module.parameters())).clone()

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=LocalSGDStrategy(**kwargs),
        precision="64-true",
        max_steps=steps,
        max_epochs=epochs,
        logger=logger,
        log_every_n_steps=1,
        callbacks=[recorder, Init()],
        **QUIET_TRAINER,
    )
    trainer.fit(module, train_dataloaders=loader)
    strategy = trainer.strategy
    record.update(
        pre=recorder.pre,
        post=recorder.post,
        final=flatten(list(module.parameters())).clone(),
        periods=strategy.taus,
        extras=strategy.summary_extras(),
        steps=strategy.local_steps,
        comm=meter.snapshot(),
    )
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
