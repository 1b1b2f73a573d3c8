"""Lightning callbacks used by the CLI: comm metrics, validation history, fault injection,
and an atomic CheckpointIO."""

from __future__ import annotations

import os
import time
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.plugins import TorchCheckpointIO
from lightning_fabric.utilities.types import _PATH

from easgd_lightning.comm import get_meter
from easgd_lightning.utils.atomic import atomic_torch_save

__all__ = [
    "AtomicCheckpointIO",
    "CommMetricsCallback",
    "ValHistoryCallback",
    "FaultInjectionCallback",
    "EpochPrinter",
]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that writes a temporary file and renames it into place."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        atomic_torch_save(checkpoint, path)


class CommMetricsCallback(pl.Callback):
    """Logs this rank's communication totals as ``comm/*`` metrics every ``every`` steps."""

    def __init__(self, every: int = 10) -> None:
        self.every = max(1, every)
        self.fit_start: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.fit_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every or self.fit_start is None:
            return
        meter = get_meter()
        elapsed = max(1e-9, time.perf_counter() - self.fit_start)
        pl_module.log_dict(
            {
                "comm/bytes_sent": float(meter.bytes_sent),
                "comm/dense_bytes": float(meter.dense_bytes),
                "comm/time_fraction": meter.time_s / elapsed,
            },
            on_step=True,
            on_epoch=False,
        )


class ValHistoryCallback(pl.Callback):
    """Records (seconds since fit start, step, val/acc, val/loss) after each validation."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.history: list[dict] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.start is None or trainer.sanity_checking:
            return
        m = trainer.callback_metrics
        self.history.append(
            {
                "time_s": time.perf_counter() - self.start,
                "step": int(trainer.global_step),
                "epoch": int(trainer.current_epoch),
                "val_acc": float(m["val/acc"]) if "val/acc" in m else None,
                "val_loss": float(m["val/loss"]) if "val/loss" in m else None,
            }
        )


class FaultInjectionCallback(pl.Callback):
    """``faults.slow_rank``/``slow_ms``: sleep before every step; ``crash_rank``/``crash_at_step``: die."""

    def __init__(self, slow_rank=None, slow_ms=0, crash_rank=None, crash_at_step=None, **_: Any):
        self.slow_rank, self.slow_ms = slow_rank, float(slow_ms or 0)
        self.crash_rank, self.crash_at_step = crash_rank, crash_at_step
        self.steps = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rank = trainer.global_rank
        self.steps += 1
        if self.crash_rank is not None and rank == self.crash_rank and self.steps >= self.crash_at_step:
            print(f"[faults] rank {rank} crashing at step {self.steps}", flush=True)
            os._exit(17)
        if self.slow_rank is not None and rank == self.slow_rank and self.slow_ms > 0:
            time.sleep(self.slow_ms / 1000.0)


class EpochPrinter(pl.Callback):
    """One plain progress line per validation on global rank 0 (for logs and pipes)."""

    def __init__(self, label: str = "") -> None:
        self.label = label
        self.start: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking or self.start is None:
            return
        if trainer.state.fn != "fit":
            return
        m = trainer.callback_metrics
        acc = f"{float(m['val/acc']):.4f}" if "val/acc" in m else "-"
        loss = f"{float(m['val/loss']):.4f}" if "val/loss" in m else "-"
        meter = get_meter()
        print(
            f"[{self.label}] epoch {trainer.current_epoch + 1}/{trainer.max_epochs} "
            f"step {trainer.global_step} t={time.perf_counter() - self.start:.1f}s "
            f"val/acc={acc} val/loss={loss} sent={meter.bytes_sent / 1e6:.2f}MB "
            f"comm={meter.time_s:.2f}s",
            flush=True,
        )
