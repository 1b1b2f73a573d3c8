"""The local SGD rules as pure functions: QSR period, CoCoD merge, averaging, option checks."""

from __future__ import annotations

import math

import pytest
import torch

from easgd_lightning.strategies.local_sgd import (
    PERIOD_RULES,
    UNBOUNDED_PERIOD,
    LocalSGDStrategy,
    average_from_sum,
    cocod_merge,
    qsr_period,
    validate_local_sgd_options,
)


# ------------------------------------------------------------------ QSR
@pytest.mark.parametrize(
    ("h_base", "gamma", "lr", "expected"),
    [
        (2, 0.1, 0.1, 2),  # (0.1/0.1)^2 = 1 < H_base
        (2, 0.1, 0.05, 4),  # (0.1/0.05)^2 = 4
        (2, 0.1, 0.03, 11),  # 11.11 -> floor 11
        (4, 0.2, 0.01, 400),
        (8, 0.1, 0.2, 8),
    ],
)
def test_qsr_formula(h_base: int, gamma: float, lr: float, expected: int) -> None:
    assert qsr_period(h_base, gamma, lr) == expected
    assert expected == max(h_base, math.floor((gamma / lr) ** 2))


def test_qsr_grows_as_the_learning_rate_decays() -> None:
    lrs = [0.1 * 0.5 * (1 + math.cos(math.pi * t / 100)) for t in range(0, 100, 10)]
    hs = [qsr_period(2, 0.05, lr) for lr in lrs]
    assert hs == sorted(hs) and hs[0] == 2 and hs[-1] > 2


def test_qsr_capped_by_remaining_steps() -> None:
    assert qsr_period(2, 0.1, 0.01, remaining_steps=37) == 37
    assert qsr_period(8, 0.1, 0.5, remaining_steps=3) == 3  # the cap applies below H_base too
    assert qsr_period(2, 0.1, 0.01, remaining_steps=math.inf) == 100
    assert qsr_period(2, 0.1, 0.01, remaining_steps=0) == 1


def test_qsr_base_period_during_warmup_and_for_zero_gamma() -> None:
    assert qsr_period(3, 0.1, 0.001, warmup=True) == 3
    assert qsr_period(3, 0.0, 0.001) == 3
    assert qsr_period(3, 0.1, 0.001, remaining_steps=2, warmup=True) == 2


def test_qsr_zero_lr_is_unbounded_until_the_cap() -> None:
    assert qsr_period(2, 0.1, 0.0, remaining_steps=50) == 50
    assert qsr_period(2, 0.1, 0.0) == UNBOUNDED_PERIOD
    assert qsr_period(2, 1.0, 1e-300, remaining_steps=9) == 9  # (gamma/lr)^2 overflows


def test_qsr_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="h_base"):
        qsr_period(0, 0.1, 0.1)
    with pytest.raises(ValueError, match="gamma"):
        qsr_period(2, -0.1, 0.1)


# ------------------------------------------------------------------ CoCoD / averaging
def test_cocod_merge_adds_local_progress_to_the_average() -> None:
    g = torch.Generator().manual_seed(0)
    snaps = [torch.randn(7, generator=g, dtype=torch.float64) for _ in range(3)]
    avg = sum(snaps) / 3
    now = [s + torch.randn(7, generator=g, dtype=torch.float64) for s in snaps]
    merged = [cocod_merge(avg, s, x) for s, x in zip(snaps, now)]
    for m, s, x in zip(merged, snaps, now):
        torch.testing.assert_close(m - avg, x - s)
    # the mean of the merged workers is the mean of where they are now
    torch.testing.assert_close(sum(merged) / 3, sum(now) / 3)
    # no progress since the snapshot: exactly the average
    assert torch.equal(cocod_merge(avg, snaps[0], snaps[0].clone()), avg)
    # inputs untouched
    assert merged[0].data_ptr() not in {avg.data_ptr(), snaps[0].data_ptr(), now[0].data_ptr()}


def test_average_from_sum_of_differences_is_the_mean() -> None:
    g = torch.Generator().manual_seed(1)
    c = torch.randn(5, generator=g, dtype=torch.float64)
    xs = [torch.randn(5, generator=g, dtype=torch.float64) for _ in range(4)]
    total = sum(x - c for x in xs)
    torch.testing.assert_close(average_from_sum(c, total, 4), sum(xs) / 4)


# ------------------------------------------------------------------ options
def test_defaults() -> None:
    s = LocalSGDStrategy()
    assert s.tau_rule == "constant" and not s.cocod
    assert s.summary_extras()["tau"] == 8
    assert s.summary_extras()["tau_base"] == 8
    assert PERIOD_RULES == ("constant", "qsr")
    assert validate_local_sgd_options(4, "qsr", None, 0.1, None) == (4, "qsr", 4, 0.1, None)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"tau": 0}, "strategy.tau"),
        ({"tau": -3}, "strategy.tau"),
        ({"tau": 2.5}, "strategy.tau"),
        ({"tau": True}, "strategy.tau"),
        ({"tau_rule": "linear"}, "strategy.tau_rule"),
        ({"tau_rule": "qsr"}, "strategy.qsr_coefficient"),
        ({"tau_rule": "qsr", "qsr_coefficient": 0}, "strategy.qsr_coefficient"),
        ({"tau_rule": "qsr", "qsr_coefficient": -1.0}, "strategy.qsr_coefficient"),
        ({"tau_rule": "qsr", "qsr_coefficient": 0.1, "tau_base": 0}, "strategy.tau_base"),
        ({"qsr_warmup_steps": -1}, "strategy.qsr_warmup_steps"),
        ({"cocod": "yes"}, "strategy.cocod"),
        ({"cocod": True, "compression": object()}, "strategy.cocod"),
    ],
)
def test_bad_options_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as info:
        LocalSGDStrategy(**kwargs)
    assert "\n" not in str(info.value)


def test_unknown_tau_rule_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"^strategy\.tau_rule must be one of \['constant', 'qsr'\], got 'adaptive'$"):
        LocalSGDStrategy(tau_rule="adaptive")


def test_registered_with_lightning() -> None:
    from pytorch_lightning.strategies import StrategyRegistry

    import easgd_lightning  # noqa: F401
    from easgd_lightning.strategies.registry import strategy_spec

    assert strategy_spec("local_sgd").cls is LocalSGDStrategy
    assert StrategyRegistry["local_sgd"]["strategy"] is LocalSGDStrategy


def test_cocod_merge_in_place_is_bitwise_the_same() -> None:
    g = torch.Generator().manual_seed(2)
    avg, snap, cur = (torch.randn(1000, generator=g, dtype=torch.float32) for _ in range(3))
    expected = cocod_merge(avg, snap, cur)
    buf = cur.clone()
    assert cocod_merge(avg, snap, buf, out=buf) is buf
    assert torch.equal(buf, expected)
    other = torch.empty_like(cur)
    assert torch.equal(cocod_merge(avg, snap, cur, out=other), expected)


def test_flatten_into_fills_the_buffer_in_order() -> None:
    from easgd_lightning.strategies.local_sgd import flatten_into

    a, b = torch.arange(6.0).reshape(2, 3), torch.tensor([7.0, 8.0])
    out = torch.empty(8)
    assert flatten_into([a, b], out) is out
    assert out.tolist() == [0, 1, 2, 3, 4, 5, 7, 8]
