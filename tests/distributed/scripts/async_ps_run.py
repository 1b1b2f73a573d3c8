"""One rank of the parameter-server protocol runs (no Lightning): ``python async_ps_run.py MODES OUT``.

``MODES`` is a comma-separated list run in turn by the same processes (imports paid once);
``dead`` must come last (a worker dies in it).

World 4: rank 3 is the server, ranks 0-2 are workers. Every rank saves what it sent and
received to ``OUT/MODE/rank<R>.pt``; the tests replay the server's service order with a
reference computed there.

Modes:
    fcfs: elastic rule, 12 requests per worker, worker 1 sleeps 40 ms before each request.
    sgd: SGD rule with server momentum and weight decay, 8 gradient pushes per worker.
    lockfree: elastic rule on a Hogwild server (updates applied on a thread pool, no lock).
    dead: elastic rule; worker 2 exits abruptly (no "done") after 3 requests.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from easgd_lightning.strategies.async_easgd import (
    OP_ELASTIC,
    OP_GRAD,
    Liveness,
    ParameterServer,
    ServerClient,
)

N = 257
SERVER = 3
ALPHA = 0.25
LR, MOMENTUM, WD = 0.1, 0.5, 0.01


def x_of(rank: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + k)
    return torch.randn(N, generator=g) + rank


def main(modes: str, out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    names = modes.split(",")
    for i, mode in enumerate(names):
        run(mode, out)
        if i + 1 < len(names):
            dist.barrier()


def run(mode: str, out: Path) -> None:
    rank = int(os.environ["RANK"])
    live = Liveness(f"test/{mode}", rank, interval_s=0.2, dead_after_s=2.0).start()
    dist.barrier()
    record: dict = {"rank": rank}
    if rank == SERVER:
        server = ParameterServer(
            rank=SERVER, workers=[0, 1, 2], center=torch.zeros(N), n_params=N - 1,
            rule="sgd" if mode == "sgd" else "elastic", alpha=ALPHA,
            momentum=MOMENTUM if mode == "sgd" else 0.0, liveness=live, stop_policy="all",
            lockfree=mode == "lockfree",
        )
        start = time.monotonic()
        server.serve()
        record.update(order=list(server.service_log), center=server.center.clone(), done=server.done,
                      dead=server.dead, updates=server.updates, seconds=time.monotonic() - start,
                      state=server.state_dict())
    else:
        client = ServerClient(SERVER, torch.zeros(N), 4, n_params=N - 1, liveness=live)
        count = {"fcfs": 12, "sgd": 8, "lockfree": 12, "dead": 10}[mode]
        sent, got, times = [], [], []
        for k in range(count):
            if mode == "dead" and rank == 2 and k == 3:
                os._exit(0)  # dies without "done"
            if mode == "fcfs":
                time.sleep(0.04 if rank == 1 else 0.001)
            x = x_of(rank, k)
            if mode == "sgd":
                got.append(client.call(OP_GRAD, x, k + 1, LR, WD).clone())
            else:
                got.append(client.call(OP_ELASTIC, x, k + 1, 0.0).clone())
            sent.append(x)
            times.append(time.monotonic())
        final = client.finish(count)
        record.update(sent=sent, got=got, final=final.clone(), times=times)
    live.stop()
    (out / mode).mkdir(parents=True, exist_ok=True)
    torch.save(record, out / mode / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
