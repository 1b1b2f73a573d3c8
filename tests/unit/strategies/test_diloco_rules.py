"""DiLoCo's pure functions (strategies/diloco.py) against independent references."""

from __future__ import annotations

import pytest
import torch

from easgd_lightning.strategies.diloco import (
    fragment_bounds,
    fragment_to_prepare,
    fragment_to_sync,
    merge_fragment,
    outer_sgd_step,
    validate_diloco_options,
)


@pytest.mark.parametrize("mu,nesterov", [(0.9, True), (0.9, False), (0.0, False), (0.5, True)])
def test_outer_step_is_pytorch_sgd(mu: float, nesterov: bool) -> None:
    """Five outer steps equal torch.optim.SGD's on the same pseudo-gradients (float64)."""
    g = torch.Generator().manual_seed(3)
    start = torch.randn(50, generator=g, dtype=torch.float64)
    grads = [torch.randn(50, generator=g, dtype=torch.float64) for _ in range(5)]
    ref = start.clone().requires_grad_(True)
    opt = torch.optim.SGD([ref], lr=0.7, momentum=mu, nesterov=nesterov)
    mine, momentum = start.clone(), torch.zeros(50, dtype=torch.float64)
    for grad in grads:
        ref.grad = grad.clone()
        opt.step()
        outer_sgd_step(mine, momentum, grad, 0.7, mu, nesterov)
    torch.testing.assert_close(mine, ref.detach(), rtol=0, atol=1e-14)
    assert (mine - start).abs().max() > 1.0


def test_merge_is_the_convex_mix() -> None:
    glob = torch.tensor([1.0, 2.0, -4.0], dtype=torch.float64)
    local = torch.tensor([3.0, 0.0, 4.0], dtype=torch.float64)
    assert torch.equal(merge_fragment(glob, local.clone(), 0.0), glob)
    assert torch.equal(merge_fragment(glob, local.clone(), 1.0), local)
    torch.testing.assert_close(merge_fragment(glob, local.clone(), 0.25), 0.75 * glob + 0.25 * local)


def test_fragments_are_contiguous_whole_tensors_of_about_equal_size() -> None:
    sizes = [100, 10, 300, 10, 200, 5, 300, 5]  # total 930
    for count in range(1, len(sizes) + 1):
        bounds = fragment_bounds(sizes, count)
        assert len(bounds) == count and bounds[0][0] == 0 and bounds[-1][1] == len(sizes)
        assert all(a < b for a, b in bounds)  # none empty
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(count - 1))  # contiguous
    two = fragment_bounds(sizes, 2)
    assert two == [(0, 4), (4, 8)]  # 420 | 510: the cut nearest to 465
    assert fragment_bounds([8, 8, 8, 8], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match=r"^strategy.fragments=5 is more than the model's 4 tensors"):
        fragment_bounds([1, 2, 3, 4], 5)


def test_schedule_one_fragment_every_tau_over_f_steps_in_turn() -> None:
    tau, count = 8, 4
    synced = {t: fragment_to_sync(t, tau, count) for t in range(1, 25)}
    assert {t: f for t, f in synced.items() if f is not None} == {
        2: 0, 4: 1, 6: 2, 8: 3, 10: 0, 12: 1, 14: 2, 16: 3, 18: 0, 20: 1, 22: 2, 24: 3,
    }
    # every fragment every tau steps
    for f in range(count):
        steps = [t for t, g in synced.items() if g == f]
        assert all(b - a == tau for a, b in zip(steps, steps[1:]))
    # prepared delay steps before its sync
    assert [t for t in range(1, 12) if fragment_to_prepare(t, tau, count, 1) is not None] == [1, 3, 5, 7, 9, 11]
    assert fragment_to_prepare(5, tau, count, 1) == fragment_to_sync(6, tau, count) == 2
    # plain DiLoCo: every tau steps
    assert [t for t in range(1, 40) if fragment_to_sync(t, 16, 1) is not None] == [16, 32]


@pytest.mark.parametrize(
    "change,message",
    [
        ({"tau": 0}, "strategy.tau must be an integer >= 1"),
        ({"outer": "adam"}, "strategy.outer must be one of ['nesterov', 'average', 'elastic'], got 'adam'"),
        ({"outer_lr": -1.0}, "strategy.outer_lr must be a number in (0, inf)"),
        ({"outer_lr": float("nan")}, "strategy.outer_lr must be a number in (0, inf)"),
        ({"outer_momentum": True}, "strategy.outer_momentum must be a number in [0, 1)"),
        ({"outer_nesterov": "yes"}, "strategy.outer_nesterov must be true or false"),
        ({"fragments": 3}, "strategy.tau=16 must be a multiple of strategy.fragments=3"),
        ({"fragments": 4, "fragment_sync_delay": 4}, "strategy.fragment_sync_delay must be an integer in [0, tau / fragments = 4)"),
        ({"fragment_update_alpha": -0.1}, "strategy.fragment_update_alpha must be a number in [0, 1]"),
    ],
)
def test_bad_options_are_one_line(change: dict, message: str) -> None:
    options = {"tau": 16, "outer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9, "outer_nesterov": True,
               "fragments": 1, "fragment_sync_delay": 0, "fragment_update_alpha": 0.0}
    options.update(change)
    with pytest.raises(ValueError) as err:
        validate_diloco_options(**options)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
