"""One worker of tests/distributed/test_ft_session.py: easgd_lightning.ft.worker.FTSession (a
torchft Manager in a replica group of one process) averaging a scalar per exchange.

``python ft_session_run.py OUT.json STEPS VICTIM KILL_STEP`` with the launcher's variables set
by the test (EASGD_FT_RANK / WORLD / ATTEMPT / LIGHTHOUSE, MASTER_ADDR / MASTER_PORT). Worker
VICTIM SIGKILLs itself inside the exchange of step KILL_STEP, after the quorum was formed and
before its all-reduce: its peers' collective of that step fails, so they must not commit it.
Each exchange: x <- sum_i x_i / n over the committed quorum. The result file holds x after
every step and the session's report.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from omegaconf import OmegaConf


def worker_args():
    """(OUT.json, STEPS, VICTIM, KILL_STEP) from the command line, and this worker's
    ``FTContext`` (collectives time out after 3 s)."""
    from easgd_lightning.ft.worker import FTContext

    out, steps, victim, kill_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    cfg = OmegaConf.create({"ft": {"name": "torchft", "min_replicas": 1, "quorum_timeout_s": 30,
                              "collective_timeout_s": 3}})
    return (out, steps, victim, kill_step), FTContext(cfg, os.path.dirname(out))


def main() -> None:
    from easgd_lightning.ft.worker import FTSession

    (out, steps, victim, kill_step), ctx = worker_args()
    rank = ctx.rank
    x = torch.tensor([float(rank + 1)], dtype=torch.float64)
    session = FTSession(ctx, lambda: {"x": x.clone(), "local_steps": 0}, lambda s: x.copy_(s["x"]))
    history = []
    for step in range(1, steps + 1):
        def payload(n: int, healing: bool, step=step) -> list[torch.Tensor]:
            if rank == victim and step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)  # in the quorum, before the all-reduce
            return [x.clone().div_(n)]

        def apply(sums: list[torch.Tensor], healed: bool) -> None:
            x.copy_(sums[0])

        x.add_(float(rank + 1))  # "local progress": each worker moves by its own amount
        session.exchange(payload, apply, step=step, kind="test")
        history.append({"step": step, "x": float(x[0]), "members": session.members(), "t": time.time()})
    with open(out, "w") as f:
        json.dump({"history": history, "report": session.report()}, f)
    session.shutdown()


if __name__ == "__main__":
    main()
