"""A sharded center (``strategy.servers=2``) over real gloo processes (4 ranks, no Lightning):
two workers, two servers, each server holding one contiguous shard
(tests/distributed/scripts/async_ps_shard_run.py).

The rule per shard is the rule of one server: each shard is replayed here, independently,
in its own server's service order (the two orders differ: the servers serve first come,
first served, each on its own), in float64, and every reply's shard and each server's final
shard must be bitwise the replay's. The elastic rule cuts at equal numel; the SGD rule
(the user's Adam with two groups and a frozen parameter) at a parameter boundary, and the
replay is a fresh Adam over that shard's parameters only. A worker's state pull merges the
shards (center concatenated, the optimizer's state the union of the servers').
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import launch_ranks

SCRIPT = Path(__file__).parent / "scripts" / "async_ps_shard_run.py"
WORKERS, SERVERS = (0, 1), (2, 3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("async_shards")
    launch_ranks(SCRIPT, 4, ["elastic,adam", str(out)], timeout=240)
    return out


def _load(out: Path, mode: str) -> dict[int, dict]:
    return {r: torch.load(out / mode / f"rank{r}.pt", weights_only=False) for r in WORKERS + SERVERS}


def _orders(recs: dict, count: int) -> list[list[int]]:
    orders = [recs[s]["order"] for s in SERVERS]
    for order in orders:
        assert sorted(order) == sorted([0] * count + [1] * count)
    return orders


def test_elastic_shards_replay_exactly_in_each_servers_order(runs: Path) -> None:
    recs = _load(runs, "elastic")
    bounds = recs[2]["bounds"]
    assert bounds == [(0, 128), (128, 257)]  # equal numel (the first one entry shorter: 257 // 2)
    orders = _orders(recs, 10)
    for j, (server, (lo, hi)) in enumerate(zip(SERVERS, bounds)):
        c = torch.zeros(hi - lo, dtype=torch.float64)
        k = {r: 0 for r in WORKERS}
        for sender in orders[j]:
            d = (recs[sender]["sent"][k[sender]][lo:hi] - c) * 0.25
            c = c + d
            assert torch.equal(recs[sender]["got"][k[sender]][lo:hi], d), (j, sender, k[sender])
            k[sender] += 1
        assert torch.equal(recs[server]["center"], c)
    whole = torch.cat([recs[s]["center"] for s in SERVERS])
    for r in WORKERS:
        assert torch.equal(recs[r]["final"], whole)
        assert recs[r]["state"]["center"].numel() == 257


def test_sgd_rule_steps_each_shards_parameters_as_one_server_would(runs: Path) -> None:
    from tests.distributed.scripts import async_ps_shard_run as run

    recs = _load(runs, "adam")
    bounds = recs[2]["bounds"]
    assert bounds == [(0, 128), (128, 257)]  # at the boundary after the first tensor
    orders = _orders(recs, 6)
    begin = run.start("adam")
    # shard 0: the first tensor (group 0); shard 1: the lr-0 tensor, the frozen one, the buffer
    p0 = begin[:128].clone().view(16, 8)
    p1, p2 = begin[128:192].clone(), begin[192:256].clone()
    refs = [torch.optim.Adam([{"params": [p0], "lr": run.ADAM_LR, "weight_decay": run.ADAM_WD}]),
            torch.optim.Adam([{"params": [p2], "lr": run.ADAM_LR, "weight_decay": run.ADAM_WD},
                              {"params": [p1], "lr": 0.0}])]
    for j, (lo, hi) in enumerate(bounds):
        k = {r: 0 for r in WORKERS}
        for sender in orders[j]:
            g = recs[sender]["sent"][k[sender]]
            if j == 0:
                p0.grad = g[:128].clone().view(16, 8)
            else:
                p1.grad, p2.grad = g[128:192].clone(), None
            refs[j].param_groups[0]["lr"] = run.adam_lr(k[sender])
            refs[j].step()
            w = p0.detach().reshape(-1) if j == 0 else torch.cat([p1.detach(), p2.detach(), g[256:]])
            assert torch.equal(recs[sender]["got"][k[sender]][lo:hi], w), (j, sender, k[sender])
            k[sender] += 1
        assert torch.equal(recs[SERVERS[j]]["center"], w)
    assert torch.equal(recs[3]["center"][64:128], begin[192:256])  # the frozen parameter never moved
    # a worker's state pull: the shards' centers concatenated, the optimizer's state their union
    state = recs[0]["state"]
    assert torch.equal(state["center"], torch.cat([s["center"] for s in state["shards"]]))
    # state ids in group order: 0 the first tensor (server 2), 1 the frozen one (never stepped), 2 the lr-0 one (server 3)
    assert sorted(state["optimizer"]["state"]) == [0, 2]
    assert all(int(state["optimizer"]["state"][i]["step"]) >= 1 for i in (0, 2))
