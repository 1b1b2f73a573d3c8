"""``hparams_search=compression_optuna|compression_pareto`` through the real CLI on digits:
four trials finish, ``easgd-report`` draws the Pareto front and marks the chosen trial, and
a bad search space is one line before any trial (issue 30 item 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import assert_valid_png, one_error_line, run_cli

COMMON = ["strategy=sync_easgd", "trainer.max_epochs=2", "logger=none", "trainer.enable_progress_bar=false",
          "checkpoint.enabled=false", "compression.min_numel=0", "hydra.sweeper.n_trials=4"]


@pytest.mark.slow
@pytest.mark.parametrize("search", ["compression_optuna", "compression_pareto"])
def test_four_trial_search_finishes_and_reports(tmp_path: Path, search: str) -> None:
    from easgd_lightning.cli.report import write_report

    sweep = tmp_path / "sweep"
    extra = ["search.bytes_budget=200000"] if search == "compression_pareto" else []
    run_cli([f"hparams_search={search}", f"hydra.sweep.dir={sweep}", *COMMON, *extra], timeout=600)
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert len(summaries) == 4 and all(s["status"] == "ok" for s in summaries)
    tried = {s["compression"] for s in summaries}
    assert tried <= {"none", "topk", "powersgd", "qsgd"} and len(tried) >= 2
    if search == "compression_optuna":  # the best value is the best trial's val_acc
        assert results["best_value"] == pytest.approx(max(s["val_acc"] for s in summaries))
    else:
        assert len(results["solutions"]) >= 1  # the Pareto trials Optuna kept
    report, _ = write_report(sweep)
    text = report.read_text()
    assert "## Compression search (Optuna)" in text and "| yes |" in text
    assert_valid_png(sweep / "pareto.png")


@pytest.mark.slow
def test_a_bad_search_space_is_one_line_before_any_trial(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_cli(["hparams_search=compression_optuna", f"hydra.sweep.dir={sweep}", *COMMON,
                    "search.compressions=[topk,bogus]"], check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert one_error_line(proc.stderr).startswith(
        "easgd-train: error: search.compressions must name compressors, got 'bogus'")
    assert not sweep.exists()  # no trial ran
