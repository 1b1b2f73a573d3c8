"""One rank of the DiLoCo test runs (launched by tests/distributed/test_diloco.py).

Usage: ``python diloco_run.py MODE[,MODE...] OUT_DIR`` with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT set; the modes run one after the other in the same processes (a
fresh Trainer each). Every run is float64 least squares on rank-specific data (the data of
``local_sgd_script.rank_data``), batches of 4 in order. Modes (constants in ``MODES``):

* a DiLoCo run (``nesterov``, ``streaming``, ``adamw``, ``elastic_stream``): records the
  initial (broadcast) parameters, theta after every step, and the final module parameters;
* a pair (``pair_local_sgd``, ``pair_local_sgd_fp16``, ``pair_sync_easgd``): DiLoCo and the
  strategy it reduces to, trained from the same weights on the same batches; records both
  final parameter vectors and every step's theta / centre.

Each rank writes ``OUT_DIR/MODE/rank<R>.pt``.
"""

from __future__ import annotations

import os
import sys

import pytorch_lightning as pl
import torch

from easgd_lightning.comm import reset_meter
from easgd_lightning.hooks import build_compressor
from easgd_lightning.strategies import DiLoCoStrategy, LocalSGDStrategy, SyncEASGDStrategy
from easgd_lightning.strategies.base import flatten
from tests.distributed.local_sgd_script import Regression, rank_data
from tests.helpers import QUIET_TRAINER

#: mode -> (DiLoCo options, inner optimizer, lr, steps)
MODES: dict[str, tuple[dict, str, float, int]] = {
    "nesterov": ({"tau": 4}, "sgd", 0.05, 12),
    "streaming": (
        {"tau": 4, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5},
        "sgd", 0.05, 13,
    ),
    "adamw": ({"tau": 3, "outer_lr": 0.5, "outer_nesterov": False}, "adamw", 0.01, 10),
    "elastic_stream": (
        {"tau": 4, "outer": "elastic", "alpha": 0.2, "fragments": 2, "fragment_sync_delay": 1},
        "sgd", 0.05, 12,
    ),
    "topk_stream": (
        {"tau": 4, "fragments": 2, "fragment_sync_delay": 1}, "sgd", 0.05, 12,
    ),
    "pair_local_sgd": ({"tau": 3, "outer_lr": 1.0, "outer_momentum": 0.0}, "sgd", 0.05, 10),
    "pair_local_sgd_fp16": ({"tau": 2, "outer": "average"}, "sgd", 0.05, 9),
    "pair_sync_easgd": ({"tau": 2, "outer": "elastic", "alpha": 0.25}, "sgd", 0.05, 10),
}
BATCH, N = 4, 52
ENV = dict(os.environ)  # Lightning's environment teardown removes WORLD_SIZE after a fit


class Module(Regression):
    """``Regression`` with a choice of inner optimizer."""

    def __init__(self, optimizer: str, lr: float) -> None:
        super().__init__(5, 3, lr=lr)
        self.optimizer = optimizer

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class Thetas(pl.Callback):
    """theta (the strategy's centre) and the module's parameters after every step."""

    def __init__(self) -> None:
        self.thetas: list[torch.Tensor] = []
        self.workers: list[torch.Tensor] = []
        self.init: torch.Tensor | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.init = flatten(list(pl_module.parameters())).clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        strategy._complete_exchange()  # elastic: a sum in flight belongs to the centre
        self.thetas.append(strategy.center.clone())
        self.workers.append(flatten(list(pl_module.parameters())).clone())


def fit(strategy, optimizer: str, lr: float, steps: int, rank: int) -> dict:
    os.environ.update(ENV)
    x, y = rank_data(rank, N, 5, 3)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    pl.seed_everything(rank, verbose=False)  # different weights per rank: the broadcast must equalise
    module = Module(optimizer, lr).double()
    meter = reset_meter()
    thetas = Thetas()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        precision="64-true",
        max_steps=steps,
        max_epochs=-1,
        logger=False,
        callbacks=[thetas],
        **QUIET_TRAINER,
    )
    trainer.fit(module, train_dataloaders=loader)
    return {
        "init": thetas.init,
        "thetas": thetas.thetas,
        "workers": thetas.workers,
        "final": flatten(list(module.parameters())).clone(),
        "extras": trainer.strategy.summary_extras(),
        "steps": trainer.strategy.local_steps,
        "comm": meter.snapshot(),
    }


def run_mode(mode: str, out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    options, optimizer, lr, steps = MODES[mode]
    record: dict = {"rank": rank}
    if mode == "pair_local_sgd_fp16":
        fp16 = lambda: build_compressor("fp16", min_numel=0)  # noqa: E731
        record["diloco"] = fit(DiLoCoStrategy(**options, compression=fp16()), optimizer, lr, steps, rank)
        record["other"] = fit(LocalSGDStrategy(tau=options["tau"], compression=fp16()), optimizer, lr, steps, rank)
    elif mode == "pair_local_sgd":
        record["diloco"] = fit(DiLoCoStrategy(**options), optimizer, lr, steps, rank)
        record["other"] = fit(LocalSGDStrategy(tau=options["tau"]), optimizer, lr, steps, rank)
    elif mode == "pair_sync_easgd":
        record["diloco"] = fit(DiLoCoStrategy(**options), optimizer, lr, steps, rank)
        other = SyncEASGDStrategy(tau=options["tau"], alpha=options["alpha"])
        record["other"] = fit(other, optimizer, lr, steps, rank)
    elif mode == "topk_stream":  # exact top-k of 30% per tensor, error feedback per fragment
        topk = build_compressor("topk", ratio=0.3, exact=True, min_numel=0)
        record["diloco"] = fit(DiLoCoStrategy(**options, compression=topk), optimizer, lr, steps, rank)
    else:
        record["diloco"] = fit(DiLoCoStrategy(**options), optimizer, lr, steps, rank)
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


def main() -> None:
    modes, out_root = sys.argv[1].split(","), sys.argv[2]
    torch.set_num_threads(1)
    for mode in modes:
        out_dir = os.path.join(out_root, mode)
        os.makedirs(out_dir, exist_ok=True)
        run_mode(mode, out_dir)


if __name__ == "__main__":
    main()
