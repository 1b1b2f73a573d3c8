"""One rank of the parameter-server protocol runs (no Lightning): ``python async_ps_run.py MODES OUT``.

``MODES`` is a comma-separated list run in turn by the same processes (imports paid once);
``dead`` or ``frozen`` must come last (a worker dies in it).

World 4: rank 3 is the server, ranks 0-2 are workers. Every rank saves what it sent and
received to ``OUT/MODE/rank<R>.pt``; the tests replay the server's service order with a
reference computed there.

Modes:
    fcfs: elastic rule, 12 requests per worker, worker 1 sleeps 40 ms before each request.
    sgd: SGD rule (torch.optim.SGD with momentum and weight decay at the server), 8 pushes each.
    adam: SGD rule with a user's Adam at the server: two param groups (the second with lr 0),
        one parameter the workers never have a gradient for (frozen), per-request learning
        rates (a schedule on the workers), a random start; 8 pushes per worker.
    lockfree: elastic rule on a Hogwild server (updates applied on a thread pool, no lock).
    adamfree: the adam mode on a Hogwild server (hogwild_sgd with server=dedicated).
    overlap: elastic rule, 4 requests per worker: 2 sent before COMPUTE_S of (simulated)
        computation and collected after it, as the strategy overlaps them, then 2 blocking;
        each worker records its meter's parameter_server totals over each half.
    dead: elastic rule; worker 2 exits abruptly (no "done") after 3 requests.
    frozen: elastic rule; worker 2 starts a 4th request and stops itself (SIGSTOP) right
        after; workers 0 and 1 keep sending requests until FROZEN_FOR_S after that. After
        serving, the server SIGKILLs the frozen process (as the launcher does at the end of a
        run) and records when it froze.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from easgd_lightning.comm import get_meter
from easgd_lightning.comm.liveness import Liveness
from easgd_lightning.strategies.ps.client import ServerClient
from easgd_lightning.strategies.ps.protocol import OP_ELASTIC, OP_GRAD, request_header_size
from easgd_lightning.strategies.ps.server import ParameterServer, worker_channels

N = 257
SERVER = 3
ALPHA = 0.25
LR, MOMENTUM, WD = 0.1, 0.5, 0.01
ADAM_LR, ADAM_WD = 0.05, 0.01
SHAPES = [(16, 8), (64,), (64,)]  # adam mode: 256 parameters + 1 buffer; the third is frozen
HAS_GRAD = [1.0, 1.0, 0.0]
COMPUTE_S = 0.6  # overlap mode: the computation a worker does while its request travels
FROZEN_FOR_S = 4.0  # frozen mode: how long workers 0 and 1 go on after worker 2 froze


def adam_start() -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(7))


def adam_lr(k: int) -> float:
    """The workers' schedule: request k carries this lr for the first group."""
    return ADAM_LR * (1.0 - 0.05 * k)


def server_optimizer(mode: str) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    """The optimizer the server steps (its parameters get bound to the center)."""
    if mode == "sgd":
        params = [torch.zeros(N - 1)]
        return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WD), params
    params = [torch.zeros(s) for s in SHAPES]
    groups = [
        {"params": [params[0], params[2]], "lr": ADAM_LR, "weight_decay": ADAM_WD},
        {"params": [params[1]], "lr": 0.0},
    ]
    return torch.optim.Adam(groups), params


def extras_of(mode: str, k: int) -> list[float]:
    """The header extras a worker sends: group lrs, then which parameters have a gradient."""
    if mode == "sgd":
        return [LR, 1.0]
    return [adam_lr(k), 0.0, *HAS_GRAD]


def x_of(rank: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + k)
    return torch.randn(N, generator=g) + rank


def ps_totals() -> dict:
    """This process's meter totals of parameter-server traffic."""
    return dict(get_meter().snapshot()["by_kind"].get("parameter_server", {"time_s": 0.0, "exposed_s": 0.0}))


def since(before: dict) -> dict:
    now = ps_totals()
    return {k: now[k] - before[k] for k in ("time_s", "exposed_s")}


def main(modes: str, out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    names = modes.split(",")
    channels = worker_channels(SERVER, [0, 1, 2])  # each worker's group with the server
    for i, mode in enumerate(names):
        run(mode, out, channels)
        if i + 1 < len(names):
            dist.barrier()


def run(mode: str, out: Path, channels: dict) -> None:
    rank = int(os.environ["RANK"])
    live = Liveness(f"test/{mode}", rank, interval_s=0.2, dead_after_s=2.0).start()
    dist.barrier()
    record: dict = {"rank": rank}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=30))  # frozen mode: who froze, and when
    sgd_rule = mode in ("sgd", "adam", "adamfree")
    optimizer, params = server_optimizer(mode) if sgd_rule else (None, [])
    if rank == SERVER:
        server = ParameterServer(
            rank=SERVER, workers=[0, 1, 2], center=adam_start() if mode.startswith("adam") else torch.zeros(N),
            n_params=N - 1, rule="sgd" if sgd_rule else "elastic", alpha=ALPHA,
            optimizer=optimizer, params=params, liveness=live, stop_policy="all",
            lockfree=mode in ("lockfree", "adamfree"), channels=channels,
        )
        start = time.monotonic()
        server.serve()
        if mode == "frozen":  # end the frozen worker, as the launcher does at the end of a run
            os.kill(int(store.get("frozen/pid")), signal.SIGKILL)
            record.update(frozen_at=float(store.get("frozen/at")))
        record.update(order=list(server.service_log), center=server.center.clone(), done=server.done,
                      dead=server.dead, lost=server.lost, updates=server.updates, seconds=time.monotonic() - start,
                      state=server.state_dict())
    else:
        client = ServerClient(SERVER, torch.zeros(N), 4, n_params=N - 1, liveness=live,
                              header_size=request_header_size(optimizer, params), group=channels[rank])
        count = {"fcfs": 12, "sgd": 8, "adam": 8, "adamfree": 8, "lockfree": 12, "overlap": 4, "dead": 10,
                 "frozen": 10_000}[mode]
        meter_from = ps_totals()
        sent, got, times = [], [], []
        for k in range(count):
            if mode == "dead" and rank == 2 and k == 3:
                os._exit(0)  # dies without "done"
            if mode == "frozen" and rank == 2 and k == 3:
                client.begin(OP_ELASTIC, x_of(rank, k), k + 1, 0.0)  # frozen in the middle of it
                store.set("frozen/pid", str(os.getpid()))
                store.set("frozen/at", repr(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            if mode == "frozen":
                if store.check(["frozen/at"]) and time.time() - float(store.get("frozen/at")) > FROZEN_FOR_S:
                    break
                time.sleep(0.01)
            if mode == "fcfs":
                time.sleep(0.04 if rank == 1 else 0.001)
            x = x_of(rank, k)
            if mode == "overlap" and k < 2:
                pending = client.begin(OP_ELASTIC, x, k + 1, 0.0)
                time.sleep(COMPUTE_S)  # the local step, while the request travels
                got.append(client.end(pending).clone())
                if k == 1:
                    record["overlapped"], meter_from = since(meter_from), ps_totals()
            elif sgd_rule:
                if mode.startswith("adam"):
                    x[192:256] = 0.0  # no gradient for the frozen parameter: zeros, as a worker sends
                got.append(client.call(OP_GRAD, x, k + 1, extras=extras_of(mode, k)).clone())
            else:
                got.append(client.call(OP_ELASTIC, x, k + 1, 0.0).clone())
            sent.append(x)
            times.append(time.time())
        if mode == "overlap":
            record["blocking"] = since(meter_from)
        final = client.finish(count)
        record.update(sent=sent, got=got, final=final.clone(), times=times)
    live.stop()
    (out / mode).mkdir(parents=True, exist_ok=True)
    torch.save(record, out / mode / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
