"""The asynchronous family's update rules against plain-Python references (lists of floats)."""

from __future__ import annotations

import random

import pytest
import torch

from easgd_lightning.strategies import async_rules
from easgd_lightning.strategies.async_easgd import (
    AsyncEASGDStrategy,
    AsyncMEASGDStrategy,
    AsyncMSGDStrategy,
    AsyncSGDStrategy,
    _GradOnlyOptimizer,
)
from easgd_lightning.strategies.hogwild import (
    HogwildEASGDStrategy,
    HogwildSGDStrategy,
    SharedCenter,
)


def _vec(seed: int, n: int = 7) -> list[float]:
    rnd = random.Random(seed)
    return [rnd.uniform(-2, 2) for _ in range(n)]


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_server_elastic_update_sequence_matches_python() -> None:
    alpha = 0.3
    center = [0.5] * 7
    c = _t(center)
    for seed in range(5):  # workers arriving one after another
        x = _vec(seed)
        d_ref = [alpha * (xi - ci) for xi, ci in zip(x, center)]
        center = [ci + di for ci, di in zip(center, d_ref)]
        d = async_rules.server_elastic_update(c, _t(x), alpha)
        assert d.tolist() == pytest.approx(d_ref, abs=1e-12)
        assert c.tolist() == pytest.approx(center, abs=1e-12)


def test_worker_and_server_move_toward_each_other() -> None:
    """x - d and c + d: the elastic force conserves x + c (one worker)."""
    x, c = _t(_vec(1)), _t(_vec(2))
    total = (x + c).clone()
    d = async_rules.server_elastic_update(c, x, 0.4)
    x = x - d
    torch.testing.assert_close(x + c, total)


def test_eamsgd_nesterov_steps_match_python() -> None:
    """v <- delta v; x <- x + v; g = grad(x); x <- x - eta g; v <- v - eta g (quadratic f)."""
    delta, eta = 0.9, 0.1
    target = _vec(3)
    grad = lambda p: [2.0 * (pi - ti) for pi, ti in zip(p, target)]  # noqa: E731
    x_ref, v_ref = _vec(4), [0.0] * 7
    x, v = _t(x_ref), torch.zeros(7, dtype=torch.float64)
    for _ in range(6):
        v_ref = [delta * vi for vi in v_ref]
        x_ref = [xi + vi for xi, vi in zip(x_ref, v_ref)]
        g = grad(x_ref)
        x_ref = [xi - eta * gi for xi, gi in zip(x_ref, g)]
        v_ref = [vi - eta * gi for vi, gi in zip(v_ref, g)]

        x_look = async_rules.nesterov_lookahead(x.clone(), v, delta)
        g_t = 2.0 * (x_look - _t(target))
        x_after = x_look - eta * g_t  # the optimizer's own step
        async_rules.nesterov_velocity_update(v, x_look, x_after)
        x = x_after
    assert x.tolist() == pytest.approx(x_ref, abs=1e-12)
    assert v.tolist() == pytest.approx(v_ref, abs=1e-12)


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.0), (0.5, 0.01)])
def test_sgd_update_matches_python_and_torch(momentum: float, wd: float) -> None:
    lr = 0.05
    w_ref, buf_ref = _vec(5), None
    w = _t(w_ref)
    buf = None
    p = torch.nn.Parameter(_t(w_ref))
    opt = torch.optim.SGD([p], lr=lr, momentum=momentum, weight_decay=wd)
    for seed in range(4):
        g = _vec(10 + seed)
        step = [gi + wd * wi for gi, wi in zip(g, w_ref)]
        if momentum:
            buf_ref = step if buf_ref is None else [momentum * b + s for b, s in zip(buf_ref, step)]
            step = buf_ref
        w_ref = [wi - lr * si for wi, si in zip(w_ref, step)]
        buf = async_rules.sgd_update(w, _t(g), lr, momentum=momentum, buffer=buf, weight_decay=wd)
        p.grad = _t(g)
        opt.step()
    assert w.tolist() == pytest.approx(w_ref, abs=1e-12)
    torch.testing.assert_close(w, p.detach())  # same semantics as torch.optim.SGD
    assert (buf is None) == (momentum == 0)


def test_grad_only_optimizer_runs_closure_without_stepping() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    calls = []

    def closure():
        calls.append(1)
        p.grad = torch.ones(3)
        return 7

    proxy = _GradOnlyOptimizer(opt)
    assert proxy.step(closure) == 7 and calls == [1]
    assert proxy.param_groups is opt.param_groups
    torch.testing.assert_close(p.detach(), torch.ones(3))


def test_shared_center_is_one_memory_for_two_mappings(tmp_path) -> None:
    a = SharedCenter(tmp_path / "c.bin", 5, torch.float32)
    b = SharedCenter(tmp_path / "c.bin", 5, torch.float32)
    a.center.copy_(torch.arange(5.0))
    b.center.add_(1.0)
    b.flag.fill_(1)
    torch.testing.assert_close(a.center, torch.arange(5.0) + 1)
    assert float(a.flag[0]) == 1.0
    a.unlink()
    assert not (tmp_path / "c.bin").exists()
    b.center.mul_(2)  # the mapping outlives the name
    torch.testing.assert_close(a.center, (torch.arange(5.0) + 1) * 2)


@pytest.mark.parametrize(
    "make,key",
    [
        (lambda: AsyncEASGDStrategy(tau=0), "strategy.tau"),
        (lambda: AsyncEASGDStrategy(tau=-3), "strategy.tau"),
        (lambda: HogwildEASGDStrategy(tau=0), "strategy.tau"),
        (lambda: AsyncMEASGDStrategy(momentum=1.0), "strategy.momentum"),
        (lambda: AsyncMEASGDStrategy(momentum=-0.1), "strategy.momentum"),
        (lambda: AsyncMSGDStrategy(momentum=1.5), "strategy.momentum"),
        (lambda: HogwildSGDStrategy(momentum=1.0), "strategy.momentum"),
        (lambda: AsyncEASGDStrategy(alpha=1.2), "strategy.alpha"),
        (lambda: AsyncSGDStrategy(lr=0), "strategy.lr"),
        (lambda: AsyncEASGDStrategy(stop_policy="never"), "strategy.stop_policy"),
        (lambda: AsyncEASGDStrategy(server="thread"), "strategy.server"),
        (lambda: AsyncEASGDStrategy(tua=2), "strategy.tua"),
        (lambda: AsyncSGDStrategy(tau=2), "strategy.tau"),
        (lambda: HogwildEASGDStrategy(num_nodes_hint=2), "strategy.server"),
        (lambda: HogwildSGDStrategy(num_nodes_hint=3), "strategy.server"),
    ],
)
def test_bad_options_name_the_key(make, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        make()


def test_hogwild_across_nodes_with_a_server_is_accepted() -> None:
    s = HogwildEASGDStrategy(server="dedicated", num_nodes_hint=2)
    assert s.uses_server and s.lockfree


def test_world_size_checks() -> None:
    with pytest.raises(ValueError, match="trainer.devices"):
        AsyncEASGDStrategy().validate_world_size(2)  # 1 worker + server is too few
    AsyncEASGDStrategy().validate_world_size(3)
    HogwildEASGDStrategy().validate_world_size(2)
    with pytest.raises(ValueError, match="strategy.alpha"):
        AsyncEASGDStrategy(alpha=0.5).validate_world_size(4)  # beta = 3 * 0.5 >= 1
