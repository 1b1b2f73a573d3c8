"""The vocabulary of option checks (easgd_lightning/utils/checks.py): what each accepts,
what it returns, and the exact line it refuses with."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from easgd_lightning.utils.checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_int_list,
    check_int_or_fraction,
    check_interval,
    check_momentum,
    check_number_list,
    check_positive,
    check_ratio,
    is_int,
    is_number,
)


def _refused(check, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as err:
        check(*args, **kwargs)
    return str(err.value)


@pytest.mark.parametrize(
    "args,kwargs,value,expected",
    [
        ((), {}, 1, 1),
        ((0,), {}, 0, 0),
        ((0, 52), {}, 52, 52),
        ((None,), {}, -7, -7),
        ((), {}, np.int64(3), 3),
        ((), {"nullable": True}, None, None),
        ((), {"also": (-1,)}, -1, -1),  # a sentinel outside the range ("no limit")
    ],
)
def test_check_int_accepts(args, kwargs, value, expected) -> None:
    out = check_int("k", value, *args, **kwargs)
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize(
    "args,kwargs,value,line",
    [
        ((), {}, 0, "strategy.tau must be an integer >= 1, got 0"),
        ((), {}, True, "strategy.tau must be an integer >= 1, got True"),  # a bool is not a number
        ((), {}, 2.0, "strategy.tau must be an integer >= 1, got 2.0"),  # nor an integral float
        ((), {}, "3", "strategy.tau must be an integer >= 1, got '3'"),  # nor a string
        ((), {}, None, "strategy.tau must be an integer >= 1, got None"),
        ((0, 52), {}, 53, "strategy.tau must be an integer in [0, 52], got 53"),
        ((None, 4), {}, 5, "strategy.tau must be an integer <= 4, got 5"),
        ((None,), {}, 1.5, "strategy.tau must be an integer, got 1.5"),
        ((), {"nullable": True}, -1, "strategy.tau must be an integer >= 1 or null, got -1"),
        ((), {"also": (-1,)}, 0, "strategy.tau must be an integer >= 1 or -1, got 0"),
        ((), {"also": (-1,), "nullable": True}, True, "strategy.tau must be an integer >= 1 or -1 or null, got True"),
    ],
)
def test_check_int_refuses(args, kwargs, value, line) -> None:
    assert _refused(check_int, "strategy.tau", value, *args, **kwargs) == line


def test_check_float_accepts_and_returns_float() -> None:
    assert check_float("k", 1, 0.0, 1.0) == 1.0 and type(check_float("k", 1)) is float
    assert check_float("k", np.float32(0.25), 0.0, 1.0) == 0.25
    assert check_float("k", 0, 0.0, 1.0, hi_open=True) == 0.0
    assert check_float("k", math.inf, 0.0, lo_open=True) == math.inf  # the bounds decide infinity
    assert check_float("k", None, 0.0, nullable=True) is None


@pytest.mark.parametrize(
    "bounds,value,line",
    [
        ({"lo": 0.0, "hi": 1.0, "hi_open": True}, 1.0, "x must be a number in [0, 1), got 1.0"),
        ({"lo": 0.0, "hi": 1.0, "lo_open": True}, 0, "x must be a number in (0, 1], got 0"),
        ({"lo": 0.0, "hi": math.inf, "lo_open": True, "hi_open": True}, math.inf,
         "x must be a number in (0, inf), got inf"),
        ({"lo": 1.0}, 0.5, "x must be a number >= 1, got 0.5"),
        ({"lo": 1.0, "lo_open": True}, 1, "x must be a number > 1, got 1"),
        ({"hi": 2.0, "hi_open": True}, 2, "x must be a number < 2, got 2"),
        ({}, float("nan"), "x must be a number, got nan"),
        ({}, False, "x must be a number, got False"),
        ({}, "0.5", "x must be a number, got '0.5'"),  # a numeric string is refused
        ({"lo": 0.0, "nullable": True}, -1, "x must be a number >= 0 or null, got -1"),
        ({"lo": 0.0, "lo_open": True, "unit": "seconds"}, 0, "x must be a number of seconds > 0, got 0"),
    ],
)
def test_check_float_refuses(bounds, value, line) -> None:
    assert _refused(check_float, "x", value, **bounds) == line


def test_positive_ratio_momentum_are_check_float_with_their_bounds() -> None:
    assert check_positive("k", 3) == 3.0 and check_positive("k", 0, allow_zero=True) == 0.0
    assert _refused(check_positive, "optim.lr", 0) == "optim.lr must be a number > 0, got 0"
    assert _refused(check_positive, "k", -1, allow_zero=True) == "k must be a number >= 0, got -1"
    assert check_ratio("k", 1) == 1.0 and check_ratio("k", 0.01) == 0.01
    assert _refused(check_ratio, "compression.ratio", 1.5) == "compression.ratio must be a number in (0, 1], got 1.5"
    assert _refused(check_ratio, "k", 1.0, allow_one=False) == "k must be a number in (0, 1), got 1.0"
    assert _refused(check_ratio, "k", True) == "k must be a number in (0, 1], got True"  # True is not 1.0
    assert check_momentum("k", 0) == 0.0 and check_momentum("k", 0.99) == 0.99


@pytest.mark.parametrize("value", [1.0, -0.1, True, False, "0.9", None, float("nan")])
def test_one_momentum_rule(value) -> None:
    """Compressors' and strategies' momentum: a number in [0, 1); bools and strings refused."""
    line = _refused(check_momentum, "strategy.momentum", value)
    assert line == f"strategy.momentum must be a number in [0, 1), got {value!r}"


def test_check_bool() -> None:
    assert check_bool("k", True) is True and check_bool("k", False) is False
    for value in (1, 0, "true", "yes", None):
        assert _refused(check_bool, "compression.nesterov", value) == (
            f"compression.nesterov must be true or false, got {value!r}"
        )


def test_check_choice() -> None:
    assert check_choice("k", "b", ("a", "b")) == "b"
    assert check_choice("k", None, [None, "a"]) is None
    assert check_choice("k", None, ["a"], nullable=True) is None
    line = _refused(check_choice, "compression.plan", "x", ("none", "secopa"))
    assert line == "compression.plan must be one of ['none', 'secopa'], got 'x'"
    line = _refused(check_choice, "k", "x", ("norm", "value"), nullable=True)
    assert line == "k must be one of ['norm', 'value'] or null, got 'x'"


def test_check_int_or_fraction() -> None:
    """Lightning's limit_*_batches: an int counts batches, a float in (0, 1] is a fraction."""
    assert check_int_or_fraction("k", 3) == 3 and check_int_or_fraction("k", 0.5) == 0.5
    assert check_int_or_fraction("k", 1.0) == 1.0 and check_int_or_fraction("k", 0, 0) == 0
    assert check_int_or_fraction("k", None, nullable=True) is None
    for value in (0, 1.5, 0.0, True, "0.5"):
        assert _refused(check_int_or_fraction, "trainer.limit_train_batches", value) == (
            f"trainer.limit_train_batches must be an integer >= 1 or a fraction in (0, 1], got {value!r}"
        )
    assert _refused(check_int_or_fraction, "k", -1, 0, nullable=True) == (
        "k must be an integer >= 0 or a fraction in (0, 1] or null, got -1"
    )


def test_check_lists() -> None:
    assert check_int_list("k", (1, np.int64(4))) == [1, 4] and check_int_list("k", None, nullable=True) is None
    assert check_number_list("k", [], 0, allow_empty=True) == [] and check_number_list("k", [0, 2.5], 0) == [0.0, 2.5]
    for value in ([], [0, 4], ["a"], [True], 3, "12", {"a": 1}):
        assert _refused(check_int_list, "search.taus", value) == (
            f"search.taus must be a non-empty list of integers >= 1, got {value!r}"
        )
    assert _refused(check_number_list, "optim.milestones", [1, -1], 0, nullable=True, allow_empty=True) == (
        "optim.milestones must be a list of numbers >= 0 or null, got [1, -1]"
    )


def test_check_interval() -> None:
    assert check_interval("k", [0.001, 0.3], 0.0, 1.0, lo_open=True) == (0.001, 0.3)
    assert check_interval("k", (0.5, 1), 0.0, 1.0, lo_open=True) == (0.5, 1.0)
    for value in ([0.3, 0.1], [0.0, 0.1], [0.1, 1.5], [0.1], [0.1, "a"], [0.1, True], None):
        assert _refused(check_interval, "search.ratio", value, 0.0, 1.0, lo_open=True) == (
            f"search.ratio must be [low, high] with 0 < low < high <= 1, got {value!r}"
        )


def test_predicates() -> None:
    assert is_int(3) and is_int(np.int32(3)) and not is_int(True) and not is_int(3.0)
    assert is_number(3) and is_number(0.5) and not is_number(True) and not is_number("1")
    assert not is_number(float("nan")) and is_number(math.inf)


def test_every_message_has_the_one_shape() -> None:
    """``<key> must be <allowed>, got <value!r>``, on one line, for every check."""
    shape = re.compile(r"^a\.b must be [^\n]+, got .+$")
    lines = [
        _refused(check_int, "a.b", 0), _refused(check_float, "a.b", -1, 0.0),
        _refused(check_positive, "a.b", 0), _refused(check_ratio, "a.b", 2),
        _refused(check_momentum, "a.b", 1), _refused(check_bool, "a.b", 1),
        _refused(check_choice, "a.b", "z", ["y"]), _refused(check_int_or_fraction, "a.b", 2.0),
        _refused(check_int_list, "a.b", []), _refused(check_number_list, "a.b", [-1], 0),
        _refused(check_interval, "a.b", [1, 0], 0.0, 1.0),
    ]
    assert all(shape.match(line) for line in lines), lines
