"""The compression search's rules (cli/search.py): its space check, objective, Pareto front."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from easgd_lightning.cli.search import check_search, chosen_run, objective, pareto_front

GOOD = {"objective": "val_acc", "bytes_budget": None, "compressions": ["none", "topk"], "ratio": [0.001, 0.3],
        "ranks": [1, 2], "levels": [1, 7], "taus": [1, 4]}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"objective": "loss"}, "search.objective must be one of ['val_acc', 'pareto'], got 'loss'"),
        ({"compressions": ["topk", "bogus"]}, "search.compressions must name compressors, got 'bogus'"),
        ({"compressions": []}, "search.compressions must name compressors"),
        ({"ratio": [0.3, 0.1]}, "search.ratio must be [low, high] with 0 < low < high <= 1"),
        ({"ratio": [0.0, 0.1]}, "search.ratio must be [low, high]"),
        ({"bytes_budget": -5}, "search.bytes_budget must be a number of bytes > 0 or null"),
        ({"taus": [0, 4]}, "search.taus must be a non-empty list of integers >= 1"),
        ({"levels": ["a"]}, "search.levels must be a non-empty list of integers >= 1"),
    ],
)
def test_a_bad_space_is_one_line(change: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        check_search(OmegaConf.create({**GOOD, **change}))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    check_search(OmegaConf.create(GOOD))


def test_objective_budget_and_pareto() -> None:
    ok = {"status": "ok", "val_acc": 0.9, "comm": {"bytes_sent": [1000, 3000]}}
    assert objective(OmegaConf.create(GOOD), ok) == 0.9
    assert objective(OmegaConf.create({**GOOD, "bytes_budget": 2500}), ok) == 0.9  # mean 2000 fits
    assert objective(OmegaConf.create({**GOOD, "bytes_budget": 1500}), ok) == 0.0  # over the budget
    assert objective(OmegaConf.create({**GOOD, "objective": "pareto"}), ok) == (0.9, 2000.0)
    failed = {"status": "failed", "val_acc": None}
    assert objective(OmegaConf.create(GOOD), failed) == 0.0
    assert objective(OmegaConf.create({**GOOD, "objective": "pareto"}), failed) == (0.0, math.inf)
    assert objective(None, ok) == 0.9  # no search: the run's val_acc, as before


def test_pareto_front_and_the_chosen_trial() -> None:
    points = [(0.90, 400.0), (0.85, 100.0), (0.80, 150.0), (0.95, 900.0), (0.90, 500.0), (0.60, 20.0)]
    assert pareto_front(points) == [5, 1, 0, 3]  # by bytes; (0.80, 150) and (0.90, 500) dominated
    assert chosen_run(points, None) == 3
    assert chosen_run(points, 450.0) == 0
    assert chosen_run(points, 10.0) is None
