"""Training on CUDA through the real CLI (``trainer=gpu``): one process per GPU; one GPU
runs the single-process strategies, two GPUs add the two-process ones over NCCL, three the
parameter server; bf16-mixed and 16-mixed; pipeline_3d on one GPU (pp=1) (issue 30 item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import train_summary

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

#: (overrides, GPUs needed)
RUNS = [
    (["strategy=ddp"], 1),
    (["strategy=ddp", "compression=topk", "compression.min_numel=0"], 1),
    (["strategy=ddp", "compression=powersgd", "compression.min_numel=0"], 1),
    (["strategy=local_sgd", "strategy.tau=4"], 1),
    (["strategy=diloco", "strategy.tau=8"], 1),
    (["strategy=ddp", "trainer.precision=16-mixed"], 1),
    (["strategy=ddp", "trainer.precision=bf16-mixed"], 1),
    (["strategy=pipeline_3d", "model=gpt_tiny", "data=text", "strategy.pp=1", "trainer.precision=32-true"], 1),
    (["strategy=ddp", "compression=topk", "compression.min_numel=0"], 2),
    (["strategy=sync_easgd", "strategy.tau=2"], 2),
    (["strategy=local_sgd", "strategy.tau=4"], 2),
    (["strategy=diloco", "strategy.tau=8", "compression=qsgd", "compression.levels=7", "compression.min_numel=0"], 2),
    (["strategy=async_easgd"], 3),
]


@pytest.mark.parametrize("overrides,gpus", RUNS, ids=[f"{g}gpu-" + "-".join(o) for o, g in RUNS])
def test_trains_on_cuda(tmp_path: Path, overrides: list[str], gpus: int) -> None:
    if GPUS < gpus:
        pytest.skip(f"needs {gpus} GPUs, this machine has {GPUS}")
    summary = train_summary(
        tmp_path / "run", "trainer=gpu", f"trainer.devices={gpus}", "trainer.max_epochs=2",
        "checkpoint.enabled=false", *overrides, timeout=240,
    )
    assert summary["status"] == "ok", summary.get("rank_errors")
    assert summary["config"]["trainer"]["accelerator"] == "gpu"
    if summary.get("val_acc") is not None and "gpt_tiny" not in " ".join(overrides):
        assert summary["val_acc"] > 0.5  # digits trained on the GPU
