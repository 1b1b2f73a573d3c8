"""Claims of the README's feature table, measured through ``Trainer(strategy=...)``
(tests/distributed/scripts/feature_run.py; the whole table: ``python -m tests.feature_matrix``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_python

SCRIPT = Path(__file__).parent / "scripts" / "feature_run.py"


def _run(tmp_path: Path, strategy: str, feature: str) -> dict:
    proc = run_python(SCRIPT, [strategy, feature, str(tmp_path)], cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp_path / f"{strategy}-{feature}-rank0.json").read_text())


@pytest.mark.slow
def test_manual_optimization_is_bitwise_automatic_under_sync_easgd(tmp_path: Path) -> None:
    auto, manual = _run(tmp_path, "sync_easgd", "auto"), _run(tmp_path, "sync_easgd", "manual")
    assert auto["steps"] == manual["steps"] == 16 and auto["moved"] > 1e-3
    for rank in (0, 1):
        assert torch.equal(torch.load(tmp_path / f"sync_easgd-auto-rank{rank}.pt"),
                           torch.load(tmp_path / f"sync_easgd-manual-rank{rank}.pt"))


@pytest.mark.slow
def test_async_sgd_server_follows_the_scheduler(tmp_path: Path) -> None:
    # the scheduler sets the rate to 0: the server, which applies the pushed gradients with
    # the worker's current rate, must leave every weight where it was
    r = _run(tmp_path, "async_sgd", "sched")
    worker1 = json.loads((tmp_path / "async_sgd-sched-rank1.json").read_text())
    # stop_policy=first: the first worker to finish its 16 steps stops the other
    assert max(r["steps"], worker1["steps"]) == 16
    assert r["moved"] == 0.0 and worker1["moved"] == 0.0
