"""The asynchronous family through the real CLI: convergence on the center, real asynchrony
under a slow worker, bad input. (The synchronous contrast, sync_easgd waiting for the slow
worker, is a time measurement: bench/async_time_to_accuracy.py, as a ratio to sync_easgd.)

Async strategies with a server use ``trainer.devices=4`` (3 workers + the server, the last
rank); Hogwild on one node uses ``trainer.devices=3`` (3 workers, shared memory).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import train_summary

SERVER_STRATEGIES = ("async_easgd", "async_measgd", "async_sgd", "async_msgd")
SLOW_MS = 100  # per step on rank 1: a fast step is ~5-30 ms even on a loaded machine


def _devices(strategy: str) -> int:
    return 4 if strategy in SERVER_STRATEGIES else 3


def _workers(s: dict) -> list[int]:
    return [r for r, role in enumerate(s["roles"]) if role == "worker"]


def _check_center_run(s: dict, strategy: str) -> None:
    assert s["status"] == "ok", s.get("error")
    assert s["strategy"] == strategy
    if strategy in SERVER_STRATEGIES:
        assert s["roles"] == ["worker", "worker", "worker", "server"]
        assert s["trained_ranks"] == [0, 1, 2] and s["steps_per_rank"][3] == 0
        assert s["comm"]["by_kind"]["parameter_server"]["bytes_sent"] > 0
        server = s["extras"][3]
        assert sorted(server["done_workers"]) == [0, 1, 2] and server["dead_workers"] == []
        # every push the server served came from a worker's step (no lost or invented updates)
        assert server["updates"] == sum(server["served_per_rank"]) > 0
    else:
        assert s["roles"] == ["worker"] * 3 and s["trained_ranks"] == [0, 1, 2]
        assert s["comm"]["by_kind"]["shared_memory"]["bytes_sent"] > 0
    assert s["val_acc"] >= 0.88, (strategy, s["val_acc"], s["steps_per_rank"])
    assert s["train_loss"] is not None and s["train_loss"] < 1.0
    assert s["val_history"] and all(h["val_acc"] is not None for h in s["val_history"])


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["async_easgd", "async_measgd", "hogwild_easgd"])
def test_elastic_async_converges_and_does_not_wait_for_a_slow_worker(tmp_path: Path, strategy: str) -> None:
    """Fast workers run their epochs while rank 1 sleeps; the center still converges."""
    s = train_summary(
        tmp_path / strategy, f"strategy={strategy}", f"trainer.devices={_devices(strategy)}",
        "faults.slow_rank=1", f"faults.slow_ms={SLOW_MS}", "checkpoint.enabled=false",
    )
    _check_center_run(s, strategy)
    steps = s["steps_per_rank"]
    fast = [r for r in _workers(s) if r != 1]
    assert all(steps[r] >= 2 * steps[1] for r in fast), steps
    assert max(steps[r] for r in fast) == 10 * 15  # the fastest did its 10 epochs (1437/3/32 -> 15)
    stop = [s["extras"][r]["stop_reason"] for r in _workers(s)]
    assert any("stop_policy=first" in reason for reason in stop), stop


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["async_sgd", "async_msgd", "hogwild_sgd"])
def test_sgd_baselines_converge_on_the_center(tmp_path: Path, strategy: str) -> None:
    """Plain (momentum-free) SGD baselines need every worker's epochs: stop_policy=all."""
    s = train_summary(
        tmp_path / strategy, f"strategy={strategy}", f"trainer.devices={_devices(strategy)}",
        "checkpoint.enabled=false", "strategy.stop_policy=all",
    )
    _check_center_run(s, strategy)
    assert all(s["steps_per_rank"][r] == 10 * 15 for r in _workers(s))  # everyone did its epochs


# bad and good async configs: in-process in tests/unit/cli/test_validation.py


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["async_easgd", "async_msgd"])
def test_a_sharded_center_trains_with_two_servers(tmp_path: Path, strategy: str) -> None:
    """``strategy.servers=2``: ranks 2 and 3 serve one shard each (equal numel for the
    elastic rule, at a parameter boundary for the SGD rule), every worker exchange reached
    both (each server served every push), the center converges, and rank 0's checkpoint
    holds the whole center (both shards, pulled at the last validation)."""
    import torch

    s = train_summary(
        tmp_path / strategy, f"strategy={strategy}", "trainer.devices=4", "strategy.servers=2",
        "trainer.max_epochs=4", "strategy.stop_policy=all",
    )
    assert s["status"] == "ok", s.get("error")
    assert s["roles"] == ["worker", "worker", "server", "server"] and s["trained_ranks"] == [0, 1]
    extras = s["extras"]
    assert all(e["server_ranks"] == [2, 3] and e["server_rank"] == 3 for e in extras)
    (lo0, hi0), (lo1, hi1) = extras[2]["shard"], extras[3]["shard"]
    sizes = [128 * 64, 128, 10 * 128, 10]  # the digits MLP (model.hidden=128): weight, bias, weight, bias
    n = sum(sizes)
    assert lo0 == 0 and hi0 == lo1 and hi1 == n
    # elastic: equal numel; SGD rule: the parameter boundary nearest the middle (after the first weight)
    assert hi0 == (sizes[0] if strategy == "async_msgd" else n // 2)
    ckpt = torch.load(tmp_path / strategy / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["easgd"]["center"].numel() == n and ckpt["easgd"]["server_ranks"] == [2, 3]
    assert sum(v.numel() for v in ckpt["state_dict"].values()) == n
    pushes = sum(s["steps_per_rank"][:2])
    assert extras[2]["updates"] == extras[3]["updates"] == pushes  # stop_policy=all: every push served
    assert extras[2]["done_workers"] and sorted(extras[3]["done_workers"]) == [0, 1]
    assert s["val_acc"] >= 0.8, s["val_acc"]  # 4 epochs of 2 workers (chance: 0.1)
    if strategy != "async_msgd":
        return
    # the SGD rule's state merged from both servers (momentum buffers of both shards), and a
    # resume of 1 more epoch restores it into both servers, which go on counting from it
    momentum = ckpt["easgd"]["server"]["momentum"]
    assert momentum.numel() == n and momentum[:hi0].abs().sum() > 0 and momentum[hi0:].abs().sum() > 0
    again = train_summary(
        tmp_path / "resumed", f"strategy={strategy}", "trainer.devices=4", "strategy.servers=2",
        "trainer.max_epochs=5", "strategy.stop_policy=all",
        f"checkpoint.resume={tmp_path / strategy / 'checkpoints' / 'last.ckpt'}",
    )
    assert again["status"] == "ok", again.get("error")
    for server in (2, 3):
        resumed = again["extras"][server]["resumed"]
        assert resumed["updates"] == ckpt["easgd"]["server"]["updates"]
        assert resumed["center_sum"] == pytest.approx(float(ckpt["easgd"]["center"].double().sum()), rel=1e-9)
        assert resumed["momentum_sum"] == pytest.approx(float(momentum.double().sum()), rel=1e-9)
        assert again["extras"][server]["updates"] > resumed["updates"]
