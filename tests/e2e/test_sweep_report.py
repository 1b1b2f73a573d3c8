"""A 2x2 Hydra multirun sweep on digits, then ``easgd-report`` on it, on one run and on a failure.

Also the wandb identity of sweep jobs (one group per sweep, run names from overrides),
computed from the directories Hydra really wrote.
"""

from __future__ import annotations

import itertools
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import PY, REPO, assert_valid_png, base_env, run_cli

PLOTS = ("val_acc_vs_time.png", "acc_vs_bytes.png", "comm_share.png")
STRATEGIES = ("ddp", "sync_easgd")
COMPRESSIONS = ("none", "fp16")


def _report(*args: str) -> subprocess.CompletedProcess:
    """The installed console script's code path: ``python -m easgd_lightning.cli.report``."""
    return subprocess.run(
        [PY, "-m", "easgd_lightning.cli.report", *args],
        env=base_env(), cwd=REPO, capture_output=True, text=True, timeout=300,
    )


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep") / "digits_sweep"
    proc = run_cli(
        ["-m",
         f"strategy={','.join(STRATEGIES)}", f"compression={','.join(COMPRESSIONS)}",
         # hidden 512: the 64x512 layer is over the compressors' default min_numel (16384),
         # which EASGD strategies apply; min_numel=0 reaches the DDP hook
         "model.hidden=512", "compression.min_numel=0", "trainer.devices=2", "trainer.max_epochs=2",
         "trainer.limit_train_batches=6",
         "checkpoint.enabled=false", "logger=csv", "trainer.enable_progress_bar=false",
         f"hydra.sweep.dir={root}"],
        check=False, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return root


def _jobs(sweep: Path) -> list[Path]:
    return sorted(p.parent for p in sweep.glob("*/summary.json"))


@pytest.mark.slow
def test_sweep_runs_every_combination(sweep: Path) -> None:
    jobs = _jobs(sweep)
    assert len(jobs) == 4
    summaries = [json.loads((j / "summary.json").read_text()) for j in jobs]
    assert sorted((s["strategy"], s["compression"]) for s in summaries) == sorted(
        itertools.product(STRATEGIES, COMPRESSIONS)
    )
    for s in summaries:
        assert s["status"] == "ok", s.get("error")
        assert s["world_size"] == 2 and s["steps_per_rank"] == [12, 12]
        assert len(s["val_history"]) >= 2  # one validation per epoch (+ the final one)
    fp16 = {s["strategy"]: s for s in summaries if s["compression"] == "fp16"}
    dense = {s["strategy"]: s for s in summaries if s["compression"] == "none"}
    for strategy in STRATEGIES:  # fp16 halves the bytes of the same exchanges
        assert sum(fp16[strategy]["comm"]["bytes_sent"]) < sum(dense[strategy]["comm"]["bytes_sent"])


@pytest.mark.slow
def test_report_on_the_sweep(sweep: Path) -> None:
    proc = _report(str(sweep))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (sweep / "report.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "| run |" not in ln]
    assert len(rows) == 4
    for strategy, compression in itertools.product(STRATEGIES, COMPRESSIONS):
        assert sum(f"| {strategy} | {compression} |" in r for r in rows) == 1, rows
    assert all("| ok |" in r for r in rows)
    summaries = {json.loads((j / "summary.json").read_text())["compression"] for j in _jobs(sweep)}
    assert summaries == set(COMPRESSIONS)
    fp16_rows = [r for r in rows if "| fp16 |" in r]
    for r in fp16_rows:  # compression ratio column (dense / sent) > 1 for fp16
        ratio = float(r.strip("|").split("|")[10])
        assert ratio > 1.3, r
    for name in PLOTS:
        assert f"({name})" in text
        assert_valid_png(sweep / name)


@pytest.mark.slow
def test_report_on_one_run_and_on_a_failed_run(sweep: Path, tmp_path: Path) -> None:
    from easgd_lightning.cli import report

    one = _jobs(sweep)[0]
    out = tmp_path / "one"
    assert report.main([str(one), "--out", str(out)]) == 0
    _, table = report.write_report(one, out)
    assert len(table) == 1 and table[0]["status"] == "ok" and table[0]["run"] == one.name
    for name in PLOTS:
        assert_valid_png(out / name)

    mixed = tmp_path / "mixed"
    shutil.copytree(one, mixed / "good")
    bad = run_cli(
        [f"hydra.run.dir={mixed / 'bad'}", "logger=none", "strategy=sync_easgd", "strategy.tau=0"],
        check=False, timeout=180,
    )
    assert bad.returncode == 2
    assert report.main([str(mixed)]) == 0
    _, table = report.write_report(mixed)
    by_run = {r["run"]: r for r in table}
    assert by_run["good"]["status"] == "ok"
    assert by_run["bad"]["status"] == "failed" and "strategy.tau" in by_run["bad"]["error"]
    text = (mixed / "report.md").read_text()
    assert "## Failed runs" in text and "- bad: " in text
    assert_valid_png(mixed / "val_acc_vs_time.png")


@pytest.mark.slow
def test_wandb_identity_of_sweep_jobs(sweep: Path, tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    from easgd_lightning.cli.worker import run_identity

    for job in _jobs(sweep):
        cfg = OmegaConf.create(json.loads((job / "summary.json").read_text())["config"])
        cfg.logger = {"name": "wandb", "group": None}
        name, group = run_identity(cfg, job)
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        assert group == sweep.name  # one wandb group per sweep
        assert name == ",".join(overrides) and "strategy=" in name and "compression=" in name
        cfg.logger.group = "mine"
        cfg.run_name = "named"
        assert run_identity(cfg, job) == ("named", "mine")  # explicit values win
    single = tmp_path / "single"
    shutil.copytree(_jobs(sweep)[0], single)
    cfg = OmegaConf.create({"run_name": None, "logger": {"name": "wandb", "group": None}})
    name, group = run_identity(cfg, single)
    assert group is None and "strategy=" in name  # a single run is in no group
