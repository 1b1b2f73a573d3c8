"""A restarted worker re-admitted by the parameter server (no Lightning):
``python async_ps_rejoin_run.py OUT``, as 4 ranks plus one late process.

World 4: rank 3 is the server, ranks 0-2 are workers, every rank joins the process group and
the set-up channels (``worker_channels``). Elastic rule in float64, ``stop_policy=all``.
Worker 2 sends ``FIRST`` requests, says so in the store and SIGKILLs itself; workers 0 and 1
send ``OTHERS`` each and say they are done. Only then does the late process (``LATE=1``,
``RANK=2``: worker 2's second start, joining no process group) start its heartbeat, ask for
admission (``rejoin.request_admission``: a pair group of its own with the server), pull the
state (``OP_STATE``) and send ``AFTER`` more requests from the step the server recorded for
it: the server, with no worker active, must have waited for it. Every process saves what it
sent, received and saw to ``OUT/rank<R>[-late].pt``; the test replays the server's service
order.
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

from easgd_lightning.comm.liveness import Liveness
from easgd_lightning.strategies.ps import rejoin
from easgd_lightning.strategies.ps.client import ServerClient
from easgd_lightning.strategies.ps.protocol import OP_ELASTIC
from easgd_lightning.strategies.ps.server import ParameterServer, worker_channels

N, SERVER, ALPHA = 257, 3, 0.25
FIRST, AFTER, OTHERS = 3, 6, 12  # worker 2's requests before its death and after its rejoin; 0's and 1's
PREFIX = "test/rejoin"
WAIT = timedelta(seconds=60)


def x_of(rank: int, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + k)
    return torch.randn(N, generator=g, dtype=torch.float64) + rank


def store_client() -> dist.TCPStore:
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=WAIT)


def exchange(client: ServerClient, rank: int, k: int, step: int, record: dict) -> None:
    x = x_of(rank, k)
    record["got"].append(client.call(OP_ELASTIC, x, step, 0.0).clone())
    record["sent"].append(x)


def late(out: Path) -> None:
    """The restarted worker 2 (module docstring)."""
    store = store_client()
    store.wait(["w2/dead", "w0/done", "w1/done"], WAIT)
    time.sleep(0.5)  # the server has taken their "done": no worker is active
    live = Liveness(PREFIX, 2, interval_s=0.2, dead_after_s=2.0).start()
    session = rejoin.read_session(store, 60)
    group = rejoin.request_admission(store, 2, 1, WAIT)
    client = ServerClient(SERVER, torch.zeros(N, dtype=torch.float64), 4, n_params=N - 1, liveness=live,
                          group=group, peer=1)
    state = client.pull_state(0)
    record = {"session": session, "state": state, "state_bytes": client.last_state_bytes, "sent": [], "got": []}
    step = int(state["worker_steps"][2])
    for k in range(AFTER):
        exchange(client, 2, 100 + k, step + k + 1, record)
    record["final"] = client.finish(step + AFTER).clone()
    live.stop()
    torch.save(record, out / "rank2-late.pt")


def main(out: Path) -> None:
    if os.environ.get("LATE") == "1":
        return late(out)
    dist.init_process_group("gloo", timeout=WAIT)
    rank = int(os.environ["RANK"])
    channels = worker_channels(SERVER, [0, 1, 2])
    live = Liveness(PREFIX, rank, interval_s=0.2, dead_after_s=2.0).start()
    store = store_client()
    dist.barrier()
    record: dict = {"sent": [], "got": []}
    if rank == SERVER:
        rejoin.publish_session(store, PREFIX, SERVER, 4)
        server = ParameterServer(rank=SERVER, workers=[0, 1, 2], center=torch.zeros(N, dtype=torch.float64),
                                 n_params=N - 1, rule="elastic", alpha=ALPHA, liveness=live, stop_policy="all",
                                 channels=channels, rejoin_store=store_client, rejoin_timeout=WAIT, rejoin_wait_s=60)
        server.serve()
        record = {"order": list(server.service_log), "center": server.center.clone(), "lost": server.lost,
                  "dead": server.dead, "done": server.done, "rejoins": server.rejoins, "served": server.served,
                  "membership": server.membership, "worker_steps": server.worker_steps, "updates": server.updates}
    else:
        client = ServerClient(SERVER, torch.zeros(N, dtype=torch.float64), 4, n_params=N - 1, liveness=live,
                              group=channels[rank])
        count = FIRST if rank == 2 else OTHERS
        for k in range(count):
            exchange(client, rank, k, k + 1, record)
            time.sleep(0.02)
        if rank == 2:  # its first start dies here, without "done"
            store.set("w2/dead", "1")
            os.kill(os.getpid(), signal.SIGKILL)
        store.set(f"w{rank}/done", "1")
        record["final"] = client.finish(count).clone()
    live.stop()
    torch.save(record, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
