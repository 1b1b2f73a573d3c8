"""Re-admission of a restarted parameter-server worker, the pure parts (the protocol over real
processes: tests/distributed/test_async_server.py; through the CLI: tests/e2e/test_ft_torchft.py):
compressed-message state reset at both ends, the rejoined worker's schedule, the launcher's
rule for stopped processes, and what ``ft=torchft`` accepts and refuses for this family."""

from __future__ import annotations

import pytest
import torch

from easgd_lightning.ft.launch import _ServerRun, _stopped_too_long
from easgd_lightning.hooks import build_compressor
from easgd_lightning.strategies.ps.compressed import (
    ElasticPush,
    ElasticReplies,
    ServerReplies,
    WorkerPush,
)
from easgd_lightning.strategies.ps.strategy import _advance_step_schedulers
from tests.helpers import compose

SIZES = [128, 64, 5]
N = sum(SIZES) + 1  # one float buffer
ALPHA = 0.3


def _elastic_round(push: ElasticPush, replies: ElasticReplies, x: torch.Tensor, center: torch.Tensor,
                   target: torch.Tensor) -> torch.Tensor:
    """One local step toward ``target``, then one compressed elastic exchange; returns x."""
    x = x - 0.3 * (x - target)
    d = replies.serve(0, push.encode(x), center)
    push.apply(d)
    return x - d


def test_a_restarted_worker_and_the_server_reset_the_elastic_estimate_to_the_same_center() -> None:
    """x~ is kept at both ends and must agree bitwise. A restarted worker starts a fresh
    ElasticPush from the center it pulled; the server's reset(worker, that center) makes the
    two agree again (without it they would not: the server's x~ is the dead process's)."""
    comp = build_compressor("topk", ratio=0.1, exact=True, min_numel=10)
    g = torch.Generator().manual_seed(3)
    center = torch.randn(N, generator=g, dtype=torch.float64)
    target = torch.randn(N, generator=g, dtype=torch.float64)
    replies = ElasticReplies(comp, SIZES, center, [0], ALPHA)
    push, x = ElasticPush(comp, SIZES, center, ALPHA), center.clone()
    for _ in range(3):
        x = _elastic_round(push, replies, x, center, target)
        assert torch.equal(push.estimate, replies.estimates[0])
    # the worker's process dies; its new one starts at the center, with a fresh push state
    stale = replies.estimates[0].clone()
    fresh, x = ElasticPush(comp, SIZES, center.clone(), ALPHA), center.clone()
    assert not torch.equal(stale, fresh.estimate)
    replies.reset(0, center)
    for _ in range(3):
        x = _elastic_round(fresh, replies, x, center, target)
        assert torch.equal(fresh.estimate, replies.estimates[0])


def test_a_restarted_worker_and_the_server_reset_the_two_way_replica() -> None:
    """Two-way pushes: the worker's weights equal the server's replica r_i after every reply;
    after a restart both start again from the center the worker pulled."""
    comp = build_compressor("topk", ratio=0.1, exact=True, min_numel=10, two_way=True)
    inner = comp.inner
    g = torch.Generator().manual_seed(5)
    center = torch.randn(N, generator=g)
    replies = ServerReplies(inner, SIZES, center, [0], True)

    def round_trip(push: WorkerPush) -> None:
        grad = torch.randn(N, generator=g)
        replies.decode_push(push.encode(grad), center.dtype)
        center[: N - 1] -= 0.1 * torch.randn(N - 1, generator=g)  # the center moves (other workers)
        push.apply(replies.reply(0, center))
        assert torch.equal(push.weights, replies.replicas[0])

    push = WorkerPush(inner, SIZES, center, True)
    for _ in range(2):
        round_trip(push)
    fresh = WorkerPush(inner, SIZES, center.clone(), True)  # the restarted process
    replies.reset(0, center)
    for _ in range(2):
        round_trip(fresh)


def test_a_rejoined_worker_continues_its_step_schedule() -> None:
    """Step-interval schedulers advance to the continued step count (frequency respected);
    epoch-interval ones restart with the loop's epochs."""
    from pytorch_lightning.utilities.types import LRSchedulerConfig as Config

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    per_step = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    opt2 = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    per_epoch = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    _advance_step_schedulers([Config(per_step, interval="step", frequency=2), Config(per_epoch, interval="epoch")], 10)
    assert per_step.last_epoch == 5 and opt.param_groups[0]["lr"] == pytest.approx(1.0 / 6)
    assert per_epoch.last_epoch == 0 and opt2.param_groups[0]["lr"] == 1.0


def test_the_launcher_kills_a_stopped_worker_once_the_server_dropped_it() -> None:
    """Under torchft a stopped worker is killed after ft.quorum_timeout_s; in a parameter-server
    run a worker once the server declared it lost, the server itself after timeout_s."""
    assert not _stopped_too_long(1, 59.0, 60.0, None, set()) and _stopped_too_long(1, 60.0, 60.0, None, set())
    ps = _ServerRun(server=3, store=None, timeout_s=120.0)
    assert not _stopped_too_long(1, 1000.0, 60.0, ps, set())  # not dropped yet: the server decides
    assert _stopped_too_long(1, 0.5, 60.0, ps, {1})
    assert not _stopped_too_long(3, 119.0, 60.0, ps, {3}) and _stopped_too_long(3, 120.0, 60.0, ps, set())


def _check(overrides: list[str]) -> None:
    from easgd_lightning.ft.config import check_ft

    cfg = compose(["ft=torchft", *overrides])
    check_ft(cfg, int(cfg.trainer.devices))


@pytest.mark.parametrize("overrides", [
    ["strategy=async_easgd", "trainer.devices=4"],
    ["strategy=async_msgd", "trainer.devices=3", "compression=topk", "ft.min_replicas=2"],
    ["strategy=hogwild_sgd", "strategy.server=dedicated", "trainer.devices=3"],
])
def test_ft_torchft_accepts_the_parameter_server_family(overrides: list[str]) -> None:
    _check(overrides)


@pytest.mark.parametrize("overrides,expected", [
    (["strategy=hogwild_easgd", "trainer.devices=3"],
     "ft=torchft: strategy=hogwild_easgd cannot survive a lost worker (Hogwild workers on shared memory"),
    (["strategy=async_easgd", "trainer.devices=4", "ft.min_replicas=4"],
     "ft.min_replicas must be an integer in [1, 3], got 4"),
    (["strategy=async_easgd", "trainer.devices=4", "ft.lighthouse=localhost:29510"],
     "ft.lighthouse: strategy=async_easgd uses no torchft lighthouse"),
    (["strategy=async_sgd", "trainer.devices=4", "checkpoint.resume=x.ckpt"],
     "ft=torchft: checkpoint.resume is not supported"),
])
def test_ft_torchft_refusals_for_the_parameter_server_family(overrides: list[str], expected: str) -> None:
    from easgd_lightning.cli.build import ConfigError

    with pytest.raises(ConfigError) as err:
        _check(overrides)
    assert str(err.value).startswith(expected), str(err.value)


def test_a_worker_restarted_after_its_last_step_still_runs_the_loops_end():
    """The fit loop of a worker restarted after its last step (it died before telling the
    server it was done: q4's hang) begins at the last epoch, not at max_epochs -- where
    Lightning skips the loop, its end with it, and the server and the other workers wait for
    that worker's "done" forever; mid-run restarts begin at the epoch of their step."""
    from easgd_lightning.strategies.ps.strategy import restart_epoch

    assert restart_epoch(150, 15, 10) == 9  # all 150 steps done: the last epoch, not 10
    assert restart_epoch(149, 15, 10) == 9 and restart_epoch(39, 15, 10) == 2
    assert restart_epoch(150, 15, None) == 10 and restart_epoch(150, 15, -1) == 10  # no epoch limit
