"""One rank of a Lightning ``Trainer(strategy=Pipeline3DStrategy(...))`` run, for the tests.

Phase 1 trains ``--epochs`` epochs of ``--batches`` steps with a checkpoint after every
epoch; phase 2 (a fresh module and Trainer in the same processes) resumes from the
first checkpoint and trains the remaining epochs; phase 3 resumes from a copy of it whose
last-stage shard has 64 values overwritten and records the error every rank raises. Writes
``rank{R}.json`` with both loss sequences, the validation losses, the meter, the strategy's
summary extras and that error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.train: list[float] = []
        self.val: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train.append(float(outputs["loss"]))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if "val/loss" in trainer.callback_metrics:
            self.val.append(float(trainer.callback_metrics["val/loss"]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--compression", type=str, default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from easgd_lightning.comm import get_meter
    from easgd_lightning.data.text import TextDataModule
    from easgd_lightning.models.gpt import GPTConfig, GPTLightningModule
    from easgd_lightning.strategies.pipeline import Pipeline3DStrategy

    world = int(os.environ["WORLD_SIZE"])
    out = Path(args.out)
    compression = json.loads(args.compression) if args.compression else None

    def fit(ckpt_path: str | None, recorder: LossRecorder):
        pl.seed_everything(0, verbose=False)
        module = GPTLightningModule(
            GPTConfig(seq_len=32, n_layer=2, n_head=4, d_model=64), lr=3e-3
        )
        dm = TextDataModule(seq_len=32, batch_size=args.batch_size, max_bytes=1 << 19)
        strategy = Pipeline3DStrategy(
            pp=args.pp, tp=args.tp, micro_batches=args.micro_batches, compression=compression
        )
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            max_epochs=args.epochs,
            limit_train_batches=args.batches,
            limit_val_batches=2,
            num_sanity_val_steps=0,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[
                recorder,
                pl.callbacks.ModelCheckpoint(
                    dirpath=str(out / "ckpt"), filename="ep{epoch}", auto_insert_metric_name=False, save_top_k=-1,
                    every_n_epochs=1, save_last=False,
                ),
            ],
            default_root_dir=str(out),
        )
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        return strategy

    straight = LossRecorder()
    strategy = fit(None, straight)
    extras = strategy.summary_extras()
    meter = get_meter().snapshot()
    resumed = LossRecorder()
    fit(str(out / "ckpt" / "ep0.ckpt"), resumed)
    rank = int(os.environ["RANK"])
    damaged = out / f"damaged_rank{rank}"  # each rank its own copy: no file race
    shutil.copytree(out / "ckpt" / "ep0.ckpt", damaged)
    shard = damaged / f"stage{args.pp - 1:02d}_tp00.pt"
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64 * 4] = torch.full((64,), 7.0).numpy().tobytes()
    shard.write_bytes(bytes(data))
    try:
        fit(str(damaged), LossRecorder())
        refused = None
    except Exception as err:  # noqa: BLE001 -- recorded for the test to check
        refused = f"{type(err).__name__}: {err}"
    (out / f"rank{rank}.json").write_text(
        json.dumps(
            {
                "train": straight.train,
                "val": straight.val,
                "resumed_train": resumed.train,
                "resumed_val": resumed.val,
                "extras": extras,
                "meter": meter,
                "refused": refused,
            }
        )
    )


if __name__ == "__main__":
    main()
