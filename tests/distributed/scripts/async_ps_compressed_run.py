"""One rank of compressed parameter-server pushes (no Lightning): ``python async_ps_compressed_run.py MODES OUT``.

World 3: rank 2 is the server (the user's Adam steps there), ranks 0 and 1 are workers that
push 8 compressed gradients each (:mod:`easgd_lightning.strategies.ps.compressed`). A
gradient depends on the weights the worker holds (g = x(rank, k) + 0.5 w), so a reply that
left the worker's weights off the server's replica would change every later push. The model
is three parameter tensors (128, 64 and 5 entries; the last below ``min_numel``, so dense)
and one float buffer. Every rank saves what it sent and received to ``OUT/MODE/rank<R>.pt``;
the test replays the server's service order with its own implementation of the rule.

Modes: ``twoway_topk`` (top-k 10%, exact, two-way), ``twoway_signsgd``, ``oneway_topk``;
``elastic_topk`` and ``elastic_signsgd``: compressed elastic differences (the EASGD rule,
``alpha`` = :data:`ALPHA`, in float64): each worker takes PUSHES local steps
``x <- x - 0.3 (x - target(rank))`` and after each one pushes C(x - x~), receives the
dense d and sets ``x <- x - d``; a wrong d or estimate x~ changes every later push.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from easgd_lightning.comm.liveness import Liveness
from easgd_lightning.hooks import build_compressor
from easgd_lightning.strategies.ps.client import ServerClient, ServerTransport
from easgd_lightning.strategies.ps.compressed import (
    ElasticPush,
    ElasticReplies,
    ServerReplies,
    WorkerPush,
    unwrap,
)
from easgd_lightning.strategies.ps.protocol import request_header_size
from easgd_lightning.strategies.ps.server import ParameterServer, worker_channels

SHAPES = [(16, 8), (64,), (5,)]
SIZES = [128, 64, 5]
N_PARAMS = sum(SIZES)
N = N_PARAMS + 1  # one float buffer
SERVER, WORKERS, PUSHES = 2, [0, 1], 8
LR = 0.05
MIN_NUMEL = 10
ALPHA = 0.3


#: how long a silent heartbeat means dead: generous, since these runs have no fault and a
#: loaded machine's late heartbeats must not make a server drop a worker mid-test
LIVENESS_S = 30.0


def compressor_of(mode: str):
    two_way = mode.startswith("twoway")
    if mode.startswith("elastic"):
        name = "topk" if mode.endswith("topk") else "signsgd"
        options = {"ratio": 0.1, "exact": True} if name == "topk" else {}
        return build_compressor(name, min_numel=MIN_NUMEL, **options)
    if mode.endswith("topk"):
        return build_compressor("topk", ratio=0.1, exact=True, min_numel=MIN_NUMEL, two_way=two_way)
    return build_compressor("signsgd", min_numel=MIN_NUMEL, two_way=two_way)


def start() -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(11))


def x_of(rank: int, k: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(100 * rank + k)) + rank


def optimizer() -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    params = [torch.zeros(s) for s in SHAPES]
    return torch.optim.Adam(params, lr=LR), params


def target(rank: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(500 + rank), dtype=torch.float64) * (1 + rank)


def run_elastic(mode: str, out: Path, channels: dict, live: Liveness) -> None:
    """Compressed elastic exchanges in float64 (module docstring)."""
    rank = int(os.environ["RANK"])
    inner, _ = unwrap(compressor_of(mode), "test")
    w0 = start().double()
    record: dict = {"rank": rank}
    if rank == SERVER:
        replies = ElasticReplies(inner, SIZES, w0, WORKERS, ALPHA)
        server = ParameterServer(rank=SERVER, workers=WORKERS, center=w0.clone(), n_params=N_PARAMS, rule="elastic",
                                 alpha=ALPHA, liveness=live, stop_policy="all", replies=replies, channels=channels)
        server.serve()
        record.update(order=list(server.service_log), center=server.center.clone(), updates=server.updates,
                      estimates={w: r.clone() for w, r in replies.estimates.items()})
    else:
        push = ElasticPush(inner, SIZES, w0, ALPHA)
        transport = ServerTransport(
            ServerClient(SERVER, w0, 3, n_params=N_PARAMS, liveness=live, group=channels[rank]), push=push)
        x, goal = w0.clone(), target(rank)
        sent, got, nbytes, residuals = [], [], [], []
        for k in range(PUSHES):
            x = x - 0.3 * (x - goal)
            pending = transport.begin_elastic(x, k + 1, 0.1)
            sent.append(x.clone())
            nbytes.append(push.last_message_bytes)
            residuals.append(push.residual.clone())
            d = transport.end_elastic(pending).clone()
            got.append(d)
            x = x - d
        final = transport.finish(PUSHES)
        record.update(sent=sent, got=got, final=final.clone(), residuals=residuals, bytes=nbytes,
                      estimate=push.estimate.clone(), traffic=dict(push.traffic))
    live.stop()
    (out / mode).mkdir(parents=True, exist_ok=True)
    torch.save(record, out / mode / f"rank{rank}.pt")


def run(mode: str, out: Path, channels: dict) -> None:
    rank = int(os.environ["RANK"])
    live = Liveness(f"test/{mode}", rank, interval_s=0.2, dead_after_s=LIVENESS_S).start()
    dist.barrier()
    if mode.startswith("elastic"):
        return run_elastic(mode, out, channels, live)
    inner, two_way = unwrap(compressor_of(mode), "test")
    opt, params = optimizer()
    record: dict = {"rank": rank}
    if rank == SERVER:
        replies = ServerReplies(inner, SIZES, start(), WORKERS, two_way)
        server = ParameterServer(rank=SERVER, workers=WORKERS, center=start(), n_params=N_PARAMS, rule="sgd",
                                 optimizer=opt, params=params, liveness=live, stop_policy="all", replies=replies,
                                 channels=channels)
        server.serve()
        record.update(order=list(server.service_log), center=server.center.clone(), updates=server.updates,
                      residuals={w: replies.residual(w, server.center) for w in WORKERS} if two_way else None,
                      state=server.state_dict())
    else:
        push = WorkerPush(inner, SIZES, start(), two_way)
        transport = ServerTransport(
            ServerClient(SERVER, start(), 3, n_params=N_PARAMS, liveness=live,
                         header_size=request_header_size(opt, params), group=channels[rank]),
            push=push,
        )
        w = start()
        sent, got, nbytes = [], [], []
        for k in range(PUSHES):
            g = x_of(rank, k)
            g[:N_PARAMS] += 0.5 * w[:N_PARAMS]
            g[N_PARAMS:] = 10.0 * rank + k  # the buffer: overwritten at the server
            w = transport.push_gradient(g, k + 1, [LR, 1.0, 1.0, 1.0]).clone()
            sent.append(g)
            got.append(w)
            nbytes.append(push.last_message_bytes)
        final = transport.finish(PUSHES)
        record.update(sent=sent, got=got, final=final.clone(), residual=push.residual.clone(), bytes=nbytes)
    live.stop()
    (out / mode).mkdir(parents=True, exist_ok=True)
    torch.save(record, out / mode / f"rank{rank}.pt")


def main(modes: str, out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    names = modes.split(",")
    channels = worker_channels(SERVER, WORKERS)  # each worker's group with the server
    for i, mode in enumerate(names):
        run(mode, out, channels)
        if i + 1 < len(names):
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
