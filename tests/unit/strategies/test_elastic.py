"""The elastic-averaging functions against a plain-Python reference, and alpha resolution."""

from __future__ import annotations

import pytest
import torch

from easgd_lightning.strategies import elastic


def _plain_python_rounds(xs, c, grads, lr, alpha, tau, steps):
    """ALGORITHMS.md section 1 with Python floats only (no tensors)."""
    xs = [list(x) for x in xs]
    c = list(c)
    for t in range(1, steps + 1):
        g = [[gf(t, i, j) for j in range(len(c))] for i, gf in enumerate(grads)]
        if t % tau == 0:
            d = [[alpha * (xs[i][j] - c[j]) for j in range(len(c))] for i in range(len(xs))]
            xs = [[xs[i][j] - lr * g[i][j] - d[i][j] for j in range(len(c))] for i in range(len(xs))]
            c = [c[j] + sum(d[i][j] for i in range(len(xs))) for j in range(len(c))]
        else:
            xs = [[xs[i][j] - lr * g[i][j] for j in range(len(c))] for i in range(len(xs))]
    return xs, c


@pytest.mark.parametrize("tau", [1, 3])
def test_simultaneous_rule_matches_plain_loop(tau: int) -> None:
    p, n, lr, alpha, steps = 3, 4, 0.1, 0.25, 9
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(n, generator=gen, dtype=torch.float64)
    table = torch.randn(steps + 1, p, n, generator=gen, dtype=torch.float64)

    def grad_fn(i):
        return lambda t, _i, j: float(table[t, i, j])

    grads = [grad_fn(i) for i in range(p)]
    ref_xs, ref_c = _plain_python_rounds([x0.tolist()] * p, x0.tolist(), grads, lr, alpha, tau, steps)

    xs = [x0.clone() for _ in range(p)]
    c = x0.clone()
    for t in range(1, steps + 1):
        if elastic.is_exchange_step(t, tau):
            diffs = [elastic.elastic_difference(x, c, alpha) for x in xs]
            xs = [elastic.apply_elastic_pull(x - lr * table[t, i], d) for i, (x, d) in enumerate(zip(xs, diffs))]
            elastic.apply_center_update(c, torch.stack(diffs).sum(0))
        else:
            xs = [x - lr * table[t, i] for i, x in enumerate(xs)]
    torch.testing.assert_close(c, torch.tensor(ref_c, dtype=torch.float64), rtol=0, atol=1e-14)
    for x, rx in zip(xs, ref_xs):
        torch.testing.assert_close(x, torch.tensor(rx, dtype=torch.float64), rtol=0, atol=1e-14)


def test_center_update_is_moving_average_of_workers() -> None:
    """c + sum_i alpha (x_i - c) == (1 - beta) c + beta mean_i x_i."""
    p, alpha = 4, 0.2
    xs = [torch.full((3,), float(i)) for i in range(p)]
    c = torch.full((3,), 10.0)
    total = sum(elastic.elastic_difference(x, c, alpha) for x in xs)
    beta = p * alpha
    expected = (1 - beta) * c + beta * torch.stack(xs).mean(0)
    torch.testing.assert_close(elastic.apply_center_update(c.clone(), total), expected)


def test_resolve_alpha() -> None:
    assert elastic.resolve_alpha(world_size=2) == pytest.approx(0.45)
    assert elastic.resolve_alpha(world_size=4, beta=0.8) == pytest.approx(0.2)
    assert elastic.resolve_alpha(world_size=2, rho=2.0, lr=0.1) == pytest.approx(0.2)
    assert elastic.resolve_alpha(world_size=2, alpha=0.3) == pytest.approx(0.3)


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"alpha": 1.2}, "alpha"),
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": 0.6}, "alpha"),  # beta = 2 * 0.6 >= 1
        ({"beta": 1.0}, "beta"),
        ({"rho": -1.0, "lr": 0.1}, "rho"),
        ({"rho": 1.0}, "rho"),
        ({"alpha": 0.1, "beta": 0.2}, "only one"),
    ],
)
def test_resolve_alpha_rejects(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        elastic.resolve_alpha(world_size=2, **kwargs)
