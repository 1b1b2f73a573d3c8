"""Compressed DDP through the real CLI on digits, 2 workers (slow).

Same seed and epochs for every run. Batch 8 gives 900 steps per worker in 10 epochs: DGC
at 99.9% sparsity sends each coordinate about once per 1000 steps, so it needs about that
many steps to catch up with dense training (in a 20-epoch run it was 0.02 behind at epoch
5 and within 0.01 from epoch 6 on). DGC carries the momentum itself (optimizer momentum
0); every tensor is compressed (min_numel=0) so the ratio measures the scheme.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers import run_cli, train_summary

COMMON = ["strategy=ddp", "trainer.devices=2", "data.batch_size=8", "trainer.max_epochs=10",
          "checkpoint.enabled=false", "seed=0"]
N_PARAMS = 64 * 128 + 128 + 128 * 10 + 10

RUNS = {
    "none": ["compression=none"],
    "dgc": [
        "compression=dgc",
        "compression.ratio=0.001",
        "compression.min_numel=0",
        "compression.warmup_ratio_steps=20",
        "optim.momentum=0",
    ],
    "powersgd": ["compression=powersgd", "compression.rank=2", "compression.min_numel=0"],
}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    return train_summary(tmp_path_factory.mktemp("none"), *COMMON, *RUNS["none"], timeout=900)


def trained_like_dense(run_dir: Path, baseline: dict, name: str, overrides: list[str],
                       timeout: float) -> tuple[dict, dict]:
    """Train with ``overrides`` (compression ``name``) and check it against the dense
    ``baseline`` of the same seed and steps: both ran (the baseline to >= 0.9), the same
    steps, accuracy within 0.02 of the baseline's, the compressor engaged. Returns the
    run's summary and its compression stats."""
    assert baseline["status"] == "ok" and baseline["val_acc"] >= 0.9
    s = train_summary(run_dir, *overrides, timeout=timeout)
    assert s["status"] == "ok", s.get("error")
    assert s["compression"] == name and s["steps_per_rank"] == baseline["steps_per_rank"]
    assert s["val_acc"] >= baseline["val_acc"] - 0.02, (s["val_acc"], baseline["val_acc"])
    stats = s["extras"][0]["compression_stats"]
    assert stats["compressor"] == name and stats["compressed_calls"] > 0
    return s, stats


def _ratio(s: dict) -> float:
    dp = s["comm"]["by_kind"]["data_parallel"]
    return dp["dense_bytes"] / dp["bytes_sent"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dgc", "powersgd"])
def test_compressed_ddp_matches_dense_accuracy(tmp_path: Path, baseline: dict, name: str) -> None:
    s, stats = trained_like_dense(tmp_path / name, baseline, name, [*COMMON, *RUNS[name]], timeout=900)
    # the dense cost is the same gradient traffic as the uncompressed run
    steps = s["steps_per_rank"][0]
    assert s["comm"]["by_kind"]["data_parallel"]["dense_bytes"] == 2 * steps * N_PARAMS * 4
    if name == "dgc":
        assert s["comm"]["dense_bytes"][0] / s["comm"]["bytes_sent"][0] >= 100
        assert _ratio(s) >= 100
    else:
        assert _ratio(s) > 5


#: issue 12's schemes at their papers' defaults (label -> overrides, least ratio). Measured
#: (seed 0, 2 cores shared): none 0.9361; sparse_gc at 0.01% 0.9556 (ratio 360); lgc 0.9472
#: (ratio 20.4, 47% of the exchanges in codes). Shorter runs miss the bound: at 5 epochs of
#: batch 32 (115 steps) sparse_gc ends at 0.875 and lgc (50 coder warm-up steps) at 0.772.
PAPER_DEFAULTS = {
    # 0.01% density (99.99% dropped): one entry of each tensor per step here
    "sparse_gc": (["compression=sparse_gc", "compression.min_numel=0"], 200),
    # 1% shared mask, codes of a quarter of it after the 50-step coder warm-up
    "lgc": (["compression=lgc", "compression.min_numel=0"], 15),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PAPER_DEFAULTS))
def test_paper_default_compressors_match_dense_accuracy(tmp_path: Path, baseline: dict, name: str) -> None:
    overrides, min_ratio = PAPER_DEFAULTS[name]
    s, stats = trained_like_dense(tmp_path / name, baseline, name, [*COMMON, *overrides], timeout=900)
    assert _ratio(s) >= min_ratio
    if name == "lgc":  # the codes were used, not only the top-k fallback
        assert stats["lgc_learned_fraction"] > 0.2


def test_dgc_warmup_epochs_and_its_own_momentum_through_the_trainer(tmp_path: Path) -> None:
    """compression.warmup_ratio_epochs counts the Trainer's epochs (the strategy tells DGC
    the steps per epoch; the step default, 100000 here, would still be warming up), and
    DGC takes over the default optim.momentum=0.9 with a warning."""
    proc = run_cli(
        [f"hydra.run.dir={tmp_path}", "logger=none", "trainer.enable_progress_bar=false",
         "strategy=ddp", "trainer.devices=2", "checkpoint.enabled=false", "compression=dgc",
         "compression.min_numel=0", "compression.warmup_ratio_steps=100000",
         "compression.warmup_ratio_epochs=2", "trainer.max_epochs=3"],
        timeout=600,
    )
    assert "the optimizer's momentum was set to 0" in proc.stdout + proc.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "ok"
    # 1437 samples / 2 ranks / batch 32 = 23 steps per epoch; 2 warm-up epochs = 46 steps,
    # the last step of epoch 3 (compress step 67, after the hook's dense first step) is past them
    assert s["steps_per_rank"] == [69, 69]
    for extras in s["extras"]:
        assert extras["compression_stats"]["last_density"] == 0.001
    # the warm-up happened, over those 46 steps: nominal bytes sum_t sum_tensors 8 ceil(d_t n)
    densities = [(0.25, 0.0625, 0.0156, 0.004)[t * 4 // 46] if t < 46 else 0.001 for t in range(68)]
    sizes = (64 * 128, 128, 128 * 10, 10)
    nominal = sum(8 * math.ceil(d * n - 1e-9) for d in densities for n in sizes) + N_PARAMS * 4
    for sent in s["comm"]["bytes_sent"]:
        assert 0.7 * nominal < sent < 1.4 * nominal, (sent, nominal)


# bad compression values: in-process in tests/unit/cli/test_validation.py
