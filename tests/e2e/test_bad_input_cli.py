"""Bad input through the real ``easgd-train``: exit status 2, exactly one
``easgd-train: error:`` line naming the key, no traceback, no worker started.

The full table of cases runs in-process in tests/unit/test_validation.py; these are one
of each kind: an unknown key (checked before Hydra composes), a value, what the module
built on the meta device cannot do, and a sweep with an unknown group option.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import PY, REPO, base_env, run_cli
from tests.helpers import one_error_line as _one_error_line

CASES = [
    (["+trainer.max_epocs=3"], "trainer.max_epocs: unknown key; did you mean trainer.max_epochs?"),
    (["optim.lr=-1"], "optim.lr: must be a number > 0, got -1"),
    (["model=gpt_tiny", "model.builder=tests.unit.test_validation:two_optimizers", "strategy=sync_easgd"],
     "model=gpt: configure_optimizers returns 2 optimizers; strategy=sync_easgd drives exactly 1"),
]


def _sweep(sweep: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "easgd_lightning.cli.train", "-m", "strategy=ddp,bogus", "logger=none",
         f"hydra.sweep.dir={sweep}"],
        env=base_env(), cwd=REPO, capture_output=True, text=True, timeout=120,
    )


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict:
    """Every command of this file, each a fresh interpreter, run side by side (one core busy
    importing each, as in test_wheel_install): {case id or "sweep": (its directory, the
    CompletedProcess)}; each test checks its own as when they ran one after the other."""
    root = tmp_path_factory.mktemp("bad_input")
    dirs = {" ".join(o): root / f"case{i}" / "run" for i, (o, _) in enumerate(CASES)}
    jobs = {key: (lambda run=run, o=o: run_cli([f"hydra.run.dir={run}", "logger=none", *o], check=False,
                                                 timeout=120, fresh=True))
            for (key, run), (o, _) in zip(dirs.items(), CASES)}
    dirs["sweep"] = root / "sweep"
    jobs["sweep"] = lambda: _sweep(dirs["sweep"])
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        return {key: (dirs[key], f.result()) for key, f in futures.items()}


@pytest.mark.parametrize("overrides,expected", CASES, ids=[" ".join(o) for o, _ in CASES])
def test_exit_2_one_line_no_worker(answers: dict, overrides: list[str], expected: str) -> None:
    run, proc = answers[" ".join(overrides)]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expected in _one_error_line(proc.stderr)
    assert not (run / "ranks").exists()  # no worker started
    summary = run / "summary.json"  # value errors are recorded; Hydra-level ones stop before a run dir
    assert not summary.exists() or json.loads(summary.read_text())["status"] == "failed"


def test_sweep_with_one_bad_job_starts_none(answers: dict) -> None:
    sweep, proc = answers["sweep"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "strategy=bogus: no such option" in _one_error_line(proc.stderr)
    assert not sweep.exists()  # not even the valid job ran
