"""``TrainClockCallback`` counts a rank's training batches and not its validation passes,
and ``bench/_tables.py`` takes a step time from it rather than from the wall time of ``fit``."""

from __future__ import annotations

import os
import time

import pytest
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from bench import _tables
from easgd_lightning.callbacks import TrainClockCallback

TRAIN_SLEEP_S, VAL_SLEEP_S, STEPS = 0.01, 0.5, 6


class _Sleepy(pl.LightningModule):
    """A training step of >= TRAIN_SLEEP_S and a validation batch of VAL_SLEEP_S."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(TRAIN_SLEEP_S)
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        time.sleep(VAL_SLEEP_S)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(64, 2)), batch_size=4)


def test_train_clock_counts_batches_and_leaves_out_validation_passes() -> None:
    clock = TrainClockCallback()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, max_steps=STEPS,
        val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=1, callbacks=[clock],
    )
    start = time.perf_counter()
    trainer.fit(_Sleepy(), train_dataloaders=_loader(), val_dataloaders=_loader())
    fit_s = time.perf_counter() - start
    # 1 sanity pass + validations after steps 2, 4 and 6: >= 4 x 0.5 s inside fit
    assert fit_s >= 4 * VAL_SLEEP_S
    # the clock holds the six training steps only: counting even one validation pass
    # would put it above VAL_SLEEP_S
    assert STEPS * TRAIN_SLEEP_S <= clock.train_time_s < VAL_SLEEP_S


def test_train_clock_is_none_before_a_batch_ends() -> None:
    assert TrainClockCallback().train_time_s is None


def test_steady_figures_take_the_summaries_train_time_over_wall_and_history() -> None:
    def summary(wall, train, history, steps):
        return {
            "steps_per_rank": steps, "wall_time_s": wall, "train_time_s": train,
            "samples_per_s": 1.0, "train_loss": 1.0,
            "comm": {"bytes_sent": [0] * len(steps), "time_s": [0.0] * len(steps)},
            "val_history": [{"time_s": history, "step": steps[0]}],
        }

    # set-up jitter: the short run's fit took 1.5 s longer, its batches did not
    short, long = summary(3.0, 0.2, 0.7, [10, 10]), summary(2.5, 1.2, 1.9, [110, 110])
    got = _tables.steady_figures(long, short)
    assert got["clock"] == "train"
    assert got["step_time_s"] == pytest.approx(1.0 / 100)
    # without the field (older summaries): the validation history's clock, as before
    for s in (short, long):
        s["train_time_s"] = None
    assert _tables.steady_figures(long, short)["step_time_s"] == pytest.approx(1.2 / 100)


def _spin(seconds: float) -> None:
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass


class _HalfBusy(pl.LightningModule):
    """A training step of BUSY_S spent on the CPU, then SLEEP_S asleep; a validation batch
    of VAL_BUSY_S on the CPU."""

    BUSY_S, SLEEP_S, VAL_BUSY_S = 0.03, 0.05, 0.2

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        _spin(self.BUSY_S)
        time.sleep(self.SLEEP_S)
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        _spin(self.VAL_BUSY_S)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_train_cpu_counts_the_process_cpu_and_the_machine_over_training() -> None:
    clock = TrainClockCallback()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, max_steps=STEPS, val_check_interval=2, limit_val_batches=1,
        num_sanity_val_steps=0, callbacks=[clock],
    )
    assert clock.train_cpu is None
    trainer.fit(_HalfBusy(), train_dataloaders=_loader(), val_dataloaders=_loader())
    cpu = clock.train_cpu
    busy, asleep = STEPS * _HalfBusy.BUSY_S, STEPS * _HalfBusy.SLEEP_S
    # three validation passes of 0.2 s of CPU each ran inside fit: left out of both clocks
    assert busy + asleep <= cpu["wall_s"] < busy + asleep + _HalfBusy.VAL_BUSY_S
    # the busy loops count, the sleeps do not (Lightning's own work adds a little)
    assert busy <= cpu["process_s"] < busy + asleep / 2
    host = cpu["host"]
    assert set(host) == {"user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal"}
    # the machine ran at least this process's CPU time, in at most wall x cores
    assert sum(host.values()) - host["idle"] - host["iowait"] >= 0.9 * cpu["process_s"]
    assert sum(host.values()) <= 1.2 * cpu["wall_s"] * os.cpu_count() + 0.05
