"""local_sgd through the real CLI: convergence on digits (slow) and bad input (fast)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.helpers import train_summary

N_PARAMS = 64 * 128 + 128 + 128 * 10 + 10  # the default MLP, float32

CONVERGENCE = {
    "h8": ["strategy=local_sgd", "strategy.tau=8"],
    "qsr": [  # H = 8 while the cosine lr is high, longer rounds as it decays
        "strategy=local_sgd",
        "strategy.tau_rule=qsr",
        "strategy.tau_base=8",
        "strategy.qsr_coefficient=0.1",
        "optim.schedule=cosine",
        "optim.total_steps=230",
    ],
    "overlap": ["strategy=local_sgd", "strategy.tau=8", "strategy.cocod=true"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CONVERGENCE))
def test_local_sgd_converges_on_digits(tmp_path: Path, case: str) -> None:
    s = train_summary(
        tmp_path / case, *CONVERGENCE[case], "trainer.devices=2", "checkpoint.enabled=false"
    )
    assert s["status"] == "ok", s.get("error")
    assert s["strategy"] == "local_sgd" and s["world_size"] == 2
    assert s["val_acc"] >= 0.90, s["val_acc"]
    extras = s["extras"][0]
    periods = extras["taus"]
    steps = s["steps_per_rank"][0]
    assert s["steps_per_rank"] == [steps, steps]
    assert sum(periods) >= steps and sum(periods[:-1]) < steps
    # bytes: one flat float32 vector per averaging round (+ rank 0's initial broadcast)
    rounds = extras["rounds"]
    assert s["comm"]["by_kind"]["model_averaging"]["bytes_sent"] == 2 * rounds * N_PARAMS * 4
    assert s["comm"]["bytes_sent"][1] == rounds * N_PARAMS * 4
    if case == "qsr":
        assert periods[0] == 8 and max(periods) > 8  # the cosine decay lengthened the rounds
        assert rounds < 230 / 8  # fewer averages than constant H = 8
        with open(tmp_path / case / "csv" / "metrics.csv") as f:
            logged = [
                int(float(r["local_sgd/tau"]))
                for r in csv.DictReader(f)
                if r.get("local_sgd/tau")
            ]
        assert logged == periods
    else:
        assert set(periods[:-1]) == {8}
    if case == "overlap":
        assert extras["cocod"] is True
        assert s["comm"]["by_kind"]["model_averaging"]["time_s"] > 0


# bad options: on the constructor in tests/unit/strategies/test_local_sgd_rules.py, through the config
# in tests/unit/cli/test_validation.py (in-process, as the CLI checks them before any process)


@pytest.mark.slow
def test_resume_mid_round_with_overlap_is_exact(tmp_path: Path) -> None:
    """Epochs of 8 steps, H = 3: the checkpoint (after epoch 2, step 16) falls inside a round
    with an average pending; one more epoch after it."""
    common = [
        "strategy=local_sgd",
        "strategy.tau=3",
        "strategy.cocod=true",
        "trainer.precision=64-true",
        "trainer.limit_train_batches=8",
    ]
    full = train_summary(tmp_path / "full", *common, "trainer.max_epochs=3")
    train_summary(tmp_path / "half", *common, "trainer.max_epochs=2")
    ckpt = tmp_path / "half" / "checkpoints" / "last.ckpt"
    resumed = train_summary(
        tmp_path / "resumed", *common, "trainer.max_epochs=3", f"checkpoint.resume={ckpt}"
    )
    assert resumed["steps_per_rank"] == full["steps_per_rank"] == [24, 24]
    assert resumed["extras"][0]["taus"] == full["extras"][0]["taus"]
    assert resumed["train_loss"] == pytest.approx(full["train_loss"], rel=1e-12)
    assert resumed["val_acc"] == full["val_acc"]
