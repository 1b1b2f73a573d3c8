"""The asynchronous family under a user's own module, started as a user starts it (issue 31
section 8): ``python script.py`` with ``Trainer(strategy=NAME, devices=3)``, Lightning's own
launcher starting the other ranks (tests/distributed/scripts/async_api_run.py).

* A collective the module asks for after set-up (``self.all_gather``, the strategy's
  ``barrier``) fails at the call with one line that says why, on every rank: never a
  one-rank answer while ``world_size`` is 3.
* A refusal at set-up (Adam under ``async_measgd``) names the API's terms (the class,
  ``configure_optimizers``), not the CLI's keys, and is printed once (rank 0).
* ``async_msgd`` over an SGD with momentum 0 warns once that it applies momentum 0.9.
* ``trainer.test()`` / ``predict()`` after fit run once, on rank 0: every sample once there,
  none on the other worker or the server.
* 5 runs side by side with a ``StepLR`` scheduler each end with exit status 0 (the
  exit-time abort, "terminate called without an active exception", exit 134, was 1 in 3);
  the mechanism is checked deterministically in tests/unit/comm/test_liveness_exit.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import run_pythons

SCRIPT = Path(__file__).parent / "scripts" / "async_api_run.py"
N_EVAL = 90  # the script's evaluation set


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("async_api")
    cases = {
        "gather_async_sgd": ("gather", "async_sgd"),
        "gather_hogwild_easgd": ("gather", "hogwild_easgd"),
        "refuse_async_measgd": ("refuse", "async_measgd"),
        "evaluate_async_msgd": ("evaluate", "async_msgd"),
    }
    specs = []
    for name, (mode, strategy) in cases.items():
        (base / name).mkdir()
        specs.append((SCRIPT, [mode, strategy, str(base / name)], base / name))
    results = run_pythons(specs, timeout=540)
    return {name: (base / name, result) for name, result in zip(cases, results)}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["async_sgd", "hogwild_easgd"])
def test_a_module_collective_fails_at_the_call_in_one_line(runs: dict, strategy: str) -> None:
    out, result = runs[f"gather_{strategy}"]
    assert result.returncode != 0, result.stderr[-3000:]
    for rank in range(3):
        for what, head in (("gather", "all_gather (self.all_gather)"), ("barrier", "barrier()")):
            text = (out / f"{what}{rank}.txt").read_text()
            assert text.startswith(f"{head} under {strategy}: after set-up the ranks run apart"), (rank, text)
            assert "\n" not in text and "synchronous strategy" in text, text
    assert "parameter server (rank 2) never joins" in (out / "gather0.txt").read_text() or strategy.startswith("hog")


@pytest.mark.slow
def test_a_refusal_names_the_api_terms_once(runs: dict) -> None:
    _, result = runs["refuse_async_measgd"]
    err = result.stdout + result.stderr
    assert result.returncode != 0
    line = ("AsyncMEASGDStrategy adds EAMSGD Nesterov momentum to SGD steps, but configure_optimizers "
            "returned Adam")
    assert err.count(line) == 1, err[-4000:]
    assert err.count("Traceback (most recent call last)") == 1, err[-4000:]
    assert "optim.optimizer" not in err and "strategy.momentum" not in err


@pytest.mark.slow
def test_test_and_predict_run_once_and_msgd_warns_once(runs: dict) -> None:
    out, result = runs["evaluate_async_msgd"]
    assert result.returncode == 0, result.stderr[-4000:]
    recs = {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(3)}
    assert sorted(recs[0]["tested"]) == list(range(N_EVAL))  # every sample once, on rank 0
    assert sorted(recs[0]["predicted"]) == list(range(N_EVAL)) and recs[0]["n_predictions"] == N_EVAL
    assert "test_loss" in recs[0]["results"][0]
    for r in (1, 2):  # the other worker and the server: nothing
        assert recs[r]["tested"] == [] and recs[r]["predicted"] == [] and recs[r]["n_predictions"] == 0
    err = result.stdout + result.stderr
    warning = "async_msgd applies heavy-ball momentum 0.9 at the server (AsyncMSGDStrategy's momentum)"
    assert err.count(warning) == 1, err[-4000:]


@pytest.mark.slow
def test_five_runs_side_by_side_with_a_scheduler_exit_cleanly(tmp_path: Path) -> None:
    specs = []
    for i in range(5):
        (tmp_path / str(i)).mkdir()
        specs.append((SCRIPT, ["steplr", "async_sgd", str(tmp_path / str(i))], tmp_path / str(i)))
    results = run_pythons(specs, timeout=580)
    for i, result in enumerate(results):
        text = result.stdout + result.stderr
        assert result.returncode == 0 and "terminate called" not in text, (i, result.returncode, text[-3000:])
        steps = [int((tmp_path / str(i) / f"done{r}").read_text()) for r in range(3)]
        assert steps[0] > 0 and steps[1] > 0 and steps[2] == 0, steps  # two workers trained, the server not
