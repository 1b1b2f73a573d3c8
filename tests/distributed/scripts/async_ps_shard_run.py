"""One rank of a sharded parameter-server run (``strategy.servers=2``; no Lightning):
``python async_ps_shard_run.py MODES OUT``.

World 4: ranks 0 and 1 are workers, ranks 2 and 3 the servers of the center's two shards
(:func:`~easgd_lightning.strategies.ps.shards.shard_bounds`). Each worker reaches them
through a :class:`~easgd_lightning.strategies.ps.client.ShardedTransport` (both shards of a
push in flight together); worker 1 sleeps before each request, so the servers' service
orders interleave the workers. Every rank saves what it sent and received (workers) or its
service order, shard and state (servers) to ``OUT/MODE/rank<R>.pt``; the tests replay
each shard in its own server's order with a reference computed there. Float64 throughout.

Modes:
    elastic: the elastic rule (equal-numel shards), 10 requests per worker.
    adam: the SGD rule with a user's Adam at the servers (parameter-aligned shards): two
        param groups (the second with lr 0), a frozen parameter, per-request learning
        rates, a random start; 6 pushes per worker.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from easgd_lightning.comm.liveness import Liveness
from easgd_lightning.strategies.ps.client import ServerClient, ShardedTransport
from easgd_lightning.strategies.ps.protocol import request_header_size
from easgd_lightning.strategies.ps.server import ParameterServer, worker_channels
from easgd_lightning.strategies.ps.shards import shard_bounds

N = 257
WORKERS, SERVERS = [0, 1], [2, 3]
ALPHA = 0.25
ADAM_LR, ADAM_WD = 0.05, 0.01
SHAPES = [(16, 8), (64,), (64,)]  # 256 parameters + 1 buffer; the third is frozen
SIZES = [128, 64, 64]
HAS_GRAD = [1.0, 1.0, 0.0]
COUNT = {"elastic": 10, "adam": 6}


#: how long a silent heartbeat means dead: generous, since these runs have no fault and a
#: loaded machine's late heartbeats must not make a server drop a worker mid-test
LIVENESS_S = 30.0


def start(mode: str) -> torch.Tensor:
    if mode == "adam":
        return torch.randn(N, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return torch.zeros(N, dtype=torch.float64)


def bounds(mode: str) -> list[tuple[int, int]]:
    return shard_bounds("sgd" if mode == "adam" else "elastic", SIZES, N, len(SERVERS))


def param_ranges(mode: str) -> list[tuple[int, int]]:
    """Each shard's parameter tensors (the adam mode's aligned cut falls after tensor 0)."""
    return [(0, 1), (1, 3)] if mode == "adam" else [(0, 3), (0, 3)]


def adam_lr(k: int) -> float:
    return ADAM_LR * (1.0 - 0.05 * k)


def optimizer() -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """The user's optimizer, whole on every server (each steps only its shard's parameters)."""
    params = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    groups = [{"params": [params[0], params[2]], "lr": ADAM_LR, "weight_decay": ADAM_WD},
              {"params": [params[1]], "lr": 0.0}]
    return torch.optim.Adam(groups), params


def x_of(rank: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + k)
    return torch.randn(N, generator=g, dtype=torch.float64) + rank


def main(modes: str, out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    channels = [worker_channels(s, WORKERS) for s in SERVERS]
    for mode in modes.split(","):
        run(mode, out, channels)
        dist.barrier()


def run(mode: str, out: Path, channels: list[dict]) -> None:
    rank = int(os.environ["RANK"])
    live = Liveness(f"test/{mode}", rank, interval_s=0.2, dead_after_s=LIVENESS_S).start()
    dist.barrier()
    sgd = mode == "adam"
    opt, params = optimizer() if sgd else (None, [])
    cuts, ranges = bounds(mode), param_ranges(mode)
    record: dict = {"rank": rank, "bounds": cuts}
    if rank in SERVERS:
        j = SERVERS.index(rank)
        lo, hi = cuts[j]
        a, b = ranges[j]
        server = ParameterServer(
            rank=rank, workers=WORKERS, center=start(mode)[lo:hi].clone(), n_params=max(0, min(hi, N - 1) - lo),
            rule="sgd" if sgd else "elastic", alpha=ALPHA, optimizer=opt, params=params[a:b] if sgd else None,
            liveness=live, stop_policy="all", channels=channels[j],
        )
        server.serve()
        record.update(order=list(server.service_log), center=server.center.clone(), state=server.state_dict())
    else:
        clients = []
        for j, (server, (lo, hi)) in enumerate(zip(SERVERS, cuts)):
            a, b = ranges[j]
            clients.append(ServerClient(server, torch.zeros(hi - lo, dtype=torch.float64), 4,
                                        n_params=max(0, min(hi, N - 1) - lo), liveness=live,
                                        header_size=request_header_size(opt, params[a:b]),
                                        group=channels[j][rank]))
        transport = ShardedTransport(clients, cuts, ranges if sgd else None, len(opt.param_groups) if sgd else 0)
        sent, got = [], []
        for k in range(COUNT[mode]):
            time.sleep(0.03 if rank == 1 else 0.001)
            x = x_of(rank, k)
            if sgd:
                x[192:256] = 0.0  # no gradient for the frozen parameter
                got.append(transport.push_gradient(x, k + 1, [adam_lr(k), 0.0, *HAS_GRAD]).clone())
            else:
                got.append(transport.end_elastic(transport.begin_elastic(x, k + 1, 0.0)).clone())
            sent.append(x)
        record.update(sent=sent, got=got, state=transport.pull_state(COUNT[mode]),
                      final=transport.finish(COUNT[mode]).clone())
    live.stop()
    (out / mode).mkdir(parents=True, exist_ok=True)
    torch.save(record, out / mode / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
