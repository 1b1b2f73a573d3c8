"""The asynchronous family's update rules against plain-Python references (lists of floats)."""

from __future__ import annotations

import random

import pytest
import torch

from easgd_lightning.strategies.ps import rules as async_rules
from easgd_lightning.strategies.ps.async_easgd import (
    AsyncEASGDStrategy,
    AsyncMEASGDStrategy,
    AsyncMSGDStrategy,
    AsyncSGDStrategy,
)
from easgd_lightning.strategies.ps.hogwild import HogwildEASGDStrategy, HogwildSGDStrategy
from easgd_lightning.strategies.ps.shared import SharedCenter
from easgd_lightning.strategies.ps.strategy import _GradOnlyOptimizer


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


# ------------------------------------------------------------------ the user's optimizer
def _model_params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g)),
            torch.nn.Parameter(torch.randn(5, generator=g))]


def test_optimizer_step_on_views_moves_the_flat_center_like_the_optimizer_itself() -> None:
    """AdamW over views of a flat center, fed flat gradients, equals AdamW on the tensors."""
    ref, mine = _model_params(), _model_params()
    flat = torch.cat([p.detach().reshape(-1) for p in mine]).clone()
    async_rules.bind_views(mine, flat)
    groups = lambda ps: [{"params": ps[:2], "lr": 0.1, "weight_decay": 0.1}, {"params": ps[2:], "lr": 0.0}]  # noqa: E731
    opt_ref, opt_mine = torch.optim.AdamW(groups(ref)), torch.optim.AdamW(groups(mine))
    start = flat.clone()
    for k in range(4):
        grads = [torch.full_like(p, 0.3 * (k + 1) - i) for i, p in enumerate(ref)]
        for p, gr in zip(ref, grads):
            p.grad = gr
        ref[1].grad = None  # no gradient this step: skipped (no decoupled decay either)
        opt_ref.step()
        async_rules.optimizer_step_on(opt_mine, mine, torch.cat([gr.reshape(-1) for gr in grads]),
                                      [True, False, True], [0.1, 0.0])
    torch.testing.assert_close(flat, torch.cat([p.detach().reshape(-1) for p in ref]), rtol=0, atol=0)
    assert torch.equal(flat[12:15], start[12:15])  # never had a gradient
    assert torch.equal(flat[15:], start[15:])  # lr 0
    assert all(p.grad is None for p in mine)


def test_optimizer_displacement_skips_parameters_without_gradient() -> None:
    params = _model_params()
    before = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    opt = torch.optim.SGD(params, lr=0.5, weight_decay=0.1)
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    moves = async_rules.optimizer_displacement(before, params)
    assert moves[1] is None and moves[2] is None
    torch.testing.assert_close(moves[0], -0.5 * (1.0 + 0.1 * before[:12]))


def test_sgd_momentum_rule_sets_zero_momenta_and_refuses_others() -> None:
    sgd = torch.optim.SGD([{"params": _model_params()[:1]}, {"params": _model_params()[1:], "momentum": 0.9}], lr=0.1)
    assert async_rules.check_sgd_momentum(sgd, 0.9, "async_msgd") is None
    assert [g["momentum"] for g in sgd.param_groups] == [0.9, 0.9]
    other = torch.optim.SGD(_model_params(), lr=0.1, momentum=0.5)
    line = async_rules.check_sgd_momentum(other, 0.9, "async_msgd")
    assert "strategy.momentum=0.9" in line and "optim.momentum" in line and "\n" not in line
    line = async_rules.check_sgd_momentum(torch.optim.Adam(_model_params()), 0.9, "async_msgd")
    assert "needs torch.optim.SGD, got Adam" in line
    mixed = torch.optim.SGD([{"params": _model_params()[:1], "lr": 0.1}, {"params": _model_params()[1:], "lr": 0.0}])
    assert "strategy.lr=0.5" in async_rules.check_fixed_lr(mixed, 0.5, "async_sgd")
    assert async_rules.check_fixed_lr(mixed, None, "async_sgd") is None


@pytest.mark.parametrize("cls,hint,key", [
    (AsyncMEASGDStrategy, {"optimizer": "adamw", "lr": 0.01}, "optim.optimizer"),
    (AsyncMSGDStrategy, {"optimizer": "adamw", "lr": 0.01}, "strategy.momentum"),
    (AsyncMSGDStrategy, {"optimizer": "sgd", "lr": 0.01, "momentum": 0.5}, "optim.momentum"),
])
def test_strategies_refuse_an_optimizer_they_would_not_run_as_given(cls, hint: dict, key: str) -> None:
    with pytest.raises(ValueError) as err:
        cls(optim_hint=hint)
    assert key in str(err.value) and "\n" not in str(err.value)
    for ok in (AsyncEASGDStrategy, AsyncSGDStrategy, HogwildSGDStrategy):  # any optimizer runs there
        ok(optim_hint=hint)


def test_local_metrics_switch_off_every_torchmetrics_sync() -> None:
    import torchmetrics

    from easgd_lightning.strategies.ps.strategy import local_metrics

    module = torch.nn.Module()
    module.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
    module.group = torchmetrics.MetricCollection({"mean": torchmetrics.MeanMetric()})
    assert local_metrics(module) == 2
    for metric in (module.acc, module.group["mean"]):
        assert metric.distributed_available_fn() is False


def test_a_server_that_lost_every_worker_fails_naming_them() -> None:
    from easgd_lightning.strategies.ps.server import check_served_a_worker

    lost = [{"rank": 0, "cause": "heartbeat stopped"}, {"rank": 2, "cause": "connection reset"}]
    with pytest.raises(RuntimeError, match=r"parameter server \(rank 3\): every worker was lost before "
                                           r"finishing \(worker 0: heartbeat stopped, worker 2: connection reset\)"):
        check_served_a_worker([], lost, 3)
    check_served_a_worker([1], lost, 3)  # one worker finished: the others' losses are recorded, not fatal
    check_served_a_worker([0, 1, 2], [], 3)  # the ordinary end
