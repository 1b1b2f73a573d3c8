"""easgd-report on hand-written summaries: rows, failed runs, CSV, plots, exit codes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from easgd_lightning.cli import report
from tests.helpers import PNG_SIGNATURE, assert_valid_png

PLOTS = ("val_acc_vs_time.png", "acc_vs_bytes.png", "comm_share.png")


def _summary(strategy: str, compression: str, *, acc: float, sent: int, dense: int, wall: float) -> dict:
    return {
        "status": "ok",
        "error": None,
        "strategy": strategy,
        "compression": compression,
        "world_size": 2,
        "steps_per_rank": [10, 10],
        "train_loss": 0.5,
        "val_loss": 0.4,
        "val_acc": acc,
        "wall_time_s": wall,
        "samples_per_s": 640.0 / wall if wall else 0.0,
        "comm": {
            "bytes_sent": [sent, sent],
            "bytes_recv": [sent, sent],
            "dense_bytes": [dense, dense],
            "time_s": [0.25 * wall, 0.25 * wall],
            "time_fraction": 0.25,
            "exposed_time_s": [0.1 * wall, 0.1 * wall],
            "exposed_fraction": 0.1,
        },
        "val_history": [
            {"epoch": 1, "step": 5, "time_s": wall / 2, "val_acc": acc - 0.1},
            {"epoch": 2, "step": 10, "time_s": wall, "val_acc": acc},
        ],
        "config": {"strategy": {"name": strategy}, "compression": {"name": compression}},
    }


def _write(run_dir: Path, summary: dict) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


@pytest.fixture()
def sweep(tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    root.mkdir()
    (root / "multirun.yaml").write_text("hydra: {}\n")
    _write(root / "0_ddp", _summary("ddp", "none", acc=0.90, sent=4_000_000, dense=4_000_000, wall=10.0))
    _write(root / "1_ddp_fp16", _summary("ddp", "fp16", acc=0.89, sent=2_000_000, dense=4_000_000, wall=8.0))
    failed = _summary("sync_easgd", "none", acc=0.0, sent=0, dense=0, wall=0.0)
    failed.update(status="failed", error="worker exit codes [0, 1]", rank_errors={"1": "RuntimeError: boom"})
    _write(root / "2_sync_easgd", failed)
    # a job that died before its summary: Hydra's .hydra/ and one failed rank report
    dead = root / "3_sync_easgd_fp16"
    (dead / ".hydra").mkdir(parents=True)
    (dead / ".hydra" / "config.yaml").write_text("strategy: {name: sync_easgd}\ncompression: {name: fp16}\n")
    (dead / ".hydra" / "overrides.yaml").write_text("- strategy=sync_easgd\n- compression=fp16\n")
    (dead / "ranks").mkdir()
    (dead / "ranks" / "rank1.json").write_text(json.dumps({"rank": 1, "status": "failed", "error": "OOM"}))
    return root


def test_rows_cover_every_run_and_mark_failures(sweep: Path) -> None:
    path, table = report.write_report(sweep)
    assert [r["run"] for r in table] == ["0_ddp", "1_ddp_fp16", "2_sync_easgd", "3_sync_easgd_fp16"]
    assert [r["status"] for r in table] == ["ok", "ok", "failed", "failed"]
    ok, fp16, failed, dead = table
    assert ok["mb_sent"] == pytest.approx(4.0) and ok["ratio"] == pytest.approx(1.0)
    assert fp16["ratio"] == pytest.approx(2.0)  # dense / sent
    assert fp16["comm_share"] == pytest.approx(0.1)  # the exposed fraction, not time_fraction
    assert failed["error"] == "worker exit codes [0, 1] (rank 1: RuntimeError: boom)"
    assert dead["strategy"] == "sync_easgd" and dead["compression"] == "fp16"
    assert "no summary.json" in dead["error"] and "rank 1: OOM" in dead["error"]

    text = path.read_text()
    table_lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert len(table_lines) == 1 + 4  # header + one row per run
    assert "## Failed runs" in text
    assert "- 2_sync_easgd: worker exit codes [0, 1]" in text
    for name in PLOTS:
        assert f"({name})" in text
        assert_valid_png(sweep / name)


def test_csv_has_the_same_rows(sweep: Path) -> None:
    report.write_report(sweep)
    with (sweep / "report.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["run"] for r in rows] == ["0_ddp", "1_ddp_fp16", "2_sync_easgd", "3_sync_easgd_fp16"]
    assert float(rows[1]["ratio"]) == pytest.approx(2.0)
    assert rows[3]["status"] == "failed" and rows[3]["val_acc"] == ""


def test_single_run_dir(sweep: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _, table = report.write_report(sweep / "1_ddp_fp16", out)
    assert len(table) == 1 and table[0]["run"] == "1_ddp_fp16" and table[0]["status"] == "ok"
    for name in PLOTS:
        assert_valid_png(out / name)


def test_only_failed_runs_still_give_a_report(tmp_path: Path) -> None:
    run = _write(tmp_path / "run", {"status": "failed", "error": "strategy.tau must be >= 1", "config": {}})
    path, table = report.write_report(run)
    assert table[0]["status"] == "failed" and "strategy.tau" in table[0]["error"]
    assert "## Failed runs" in path.read_text()
    for name in PLOTS:  # empty axes, but still valid images
        assert (run / name).read_bytes()[:8] == PNG_SIGNATURE


def test_unreadable_summary_is_a_failed_row(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "summary.json").write_text("{not json")
    _, table = report.write_report(tmp_path)
    assert table[0]["status"] == "failed" and "unreadable summary" in table[0]["error"]


def test_main_exit_codes(tmp_path: Path, sweep: Path, capsys) -> None:
    assert report.main([str(tmp_path / "missing")]) == 2
    (tmp_path / "empty").mkdir()
    assert report.main([str(tmp_path / "empty")]) == 1
    assert report.main([str(sweep)]) == 0
    assert "wrote" in capsys.readouterr().out
