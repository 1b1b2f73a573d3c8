"""Claims of the README's feature table, measured through ``Trainer(strategy=...)``
(tests/distributed/scripts/feature_run.py; the whole table: ``python -m tests.feature_matrix``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_pythons

SCRIPT = Path(__file__).parent / "scripts" / "feature_run.py"
#: every (strategy, feature) run of this file
RUNS = (("sync_easgd", "auto"), ("sync_easgd", "manual"), ("async_sgd", "sched"))


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    """The runs of this file side by side, each its own Trainer and ranks (Lightning's
    launcher starts the other ranks of each as fresh interpreters, one core busy importing
    each while its rank 0 waits): the directory of their files, each named by strategy,
    feature and rank."""
    out = tmp_path_factory.mktemp("features")
    cwds = [out / f"cwd-{strategy}-{feature}" for strategy, feature in RUNS]  # one working directory each
    for cwd in cwds:
        cwd.mkdir()
    procs = run_pythons([(SCRIPT, [strategy, feature, str(out)], cwd) for (strategy, feature), cwd in zip(RUNS, cwds)],
                        timeout=240)
    for (strategy, feature), proc in zip(RUNS, procs):
        assert proc.returncode == 0, f"{strategy} {feature}:\n{proc.stderr[-4000:]}"
    return out


def _run(out: Path, strategy: str, feature: str) -> dict:
    return json.loads((out / f"{strategy}-{feature}-rank0.json").read_text())


@pytest.mark.slow
def test_manual_optimization_is_bitwise_automatic_under_sync_easgd(out: Path) -> None:
    auto, manual = _run(out, "sync_easgd", "auto"), _run(out, "sync_easgd", "manual")
    assert auto["steps"] == manual["steps"] == 16 and auto["moved"] > 1e-3
    for rank in (0, 1):
        assert torch.equal(torch.load(out / f"sync_easgd-auto-rank{rank}.pt"),
                           torch.load(out / f"sync_easgd-manual-rank{rank}.pt"))


@pytest.mark.slow
def test_async_sgd_server_follows_the_scheduler(out: Path) -> None:
    # the scheduler sets the rate to 0: the server, which applies the pushed gradients with
    # the worker's current rate, must leave every weight where it was
    r = _run(out, "async_sgd", "sched")
    worker1 = json.loads((out / "async_sgd-sched-rank1.json").read_text())
    # stop_policy=first: the first worker to finish its 16 steps stops the other
    assert max(r["steps"], worker1["steps"]) == 16
    assert r["moved"] == 0.0 and worker1["moved"] == 0.0


#: the README's diloco row, every cell
DILOCO_CELLS = ("auto", "manual", "two_opt", "accum", "clip", "sched", "metric", "bf16-mixed", "64-true")


@pytest.mark.slow
def test_diloco_row_of_the_feature_table(tmp_path: Path) -> None:
    """``Trainer(strategy="diloco")`` with the two-layer module, 2 processes, each feature:
    manual optimization ends bitwise equal to automatic; two optimizers are refused in one
    line; accumulation halves the optimizer steps; a rate of 0 (scheduler) leaves every
    weight where it was and a clip of 1e-9 almost so; a metric, bf16-mixed and 64-true run."""
    cwds = [tmp_path / f"cwd-{feature}" for feature in DILOCO_CELLS]
    for cwd in cwds:
        cwd.mkdir()
    procs = run_pythons([(SCRIPT, ["diloco", feature, str(tmp_path)], cwd) for feature, cwd in zip(DILOCO_CELLS, cwds)],
                        timeout=400)
    silent = {f: (p.returncode, p.stderr[-3000:]) for f, p in zip(DILOCO_CELLS, procs)
              if not (tmp_path / f"diloco-{f}-rank0.json").exists()}
    assert not silent, silent  # a rank 0 that died without its report: its exit status and stderr
    cells = {f: json.loads((tmp_path / f"diloco-{f}-rank0.json").read_text()) for f in DILOCO_CELLS}
    assert all(p.returncode == 0 for f, p in zip(DILOCO_CELLS, procs) if f != "two_opt")
    refusal = cells.pop("two_opt")
    assert refusal["status"] != "ok" and refusal["error"].startswith(
        "ValueError: strategy=diloco drives exactly one optimizer, but configure_optimizers returned 2")
    assert all(c["status"] == "ok" for c in cells.values()), cells
    assert cells["auto"]["steps"] == cells["manual"]["steps"] == 16 and cells["auto"]["moved"] > 1e-2
    for rank in (0, 1):
        assert torch.equal(torch.load(tmp_path / f"diloco-auto-rank{rank}.pt"),
                           torch.load(tmp_path / f"diloco-manual-rank{rank}.pt"))
    assert cells["accum"]["steps"] == 8
    assert cells["sched"]["moved"] == 0.0
    assert 0 < cells["clip"]["moved"] < 1e-9 < cells["auto"]["moved"]
    for feature in ("metric", "bf16-mixed", "64-true"):
        assert cells[feature]["steps"] == 16 and cells[feature]["moved"] > 1e-2, feature
