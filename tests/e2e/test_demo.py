"""``make demo`` (``easgd-demo``): our progress lines, the table and the plot paths, and no
third-party warning a user cannot act on (issue 30 item 5), also when run a second time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, base_env

#: third-party messages the demo printed before (and one a second run would add)
NOISE = ("LeafSpec", "litlogger", "anonymous setting", "DistributedSampler", "exists and is not empty",
         "Warning", "WARNING")


@pytest.mark.slow
def test_demo_is_quiet_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    for attempt in range(2):  # the second run replaces the first one's directories
        proc = subprocess.run(
            [sys.executable, "-m", "easgd_lightning.cli.demo", "--out", str(out), "trainer.max_epochs=2"],
            env=base_env(OMP_NUM_THREADS="1", WANDB_SILENT="true"), cwd=REPO, capture_output=True, text=True,
            timeout=400,
        )
        text = proc.stdout + proc.stderr
        assert proc.returncode == 0, text[-4000:]
        noisy = [line for line in text.splitlines() if any(n in line for n in NOISE)]
        assert not noisy, noisy
        for strategy in ("ddp", "sync_easgd", "easgd_round_robin"):
            assert f"[{'ddp' if strategy == 'ddp' else strategy}/none] epoch 2/2" in text, strategy
        assert "| strategy |" in text or "| strategy" in text  # the side-by-side table
        for png in ("val_acc_vs_time.png", "acc_vs_bytes.png", "comm_share.png"):
            assert (out / png).is_file() and str(out / png) in text
        if attempt == 1:
            assert "replacing the previous demo run" in text
