"""One worker of tests/distributed/test_ft_session.py::test_rejoin_not_committed_is_received_again:
easgd_lightning.ft.worker.FTSession averaging a scalar, with a worker that rejoins and whose
first rejoin exchange nobody commits.

``python ft_heal_retry_run.py OUT.json STEPS WAIT_AT`` with the launcher's variables set by the
test. Workers 0 and 1 (attempt 0): every step ``x += rank + 1`` then ``x <- sum_i x_i / n``
over the quorum's contributors; at step WAIT_AT they wait (bounded) until worker 2's Manager
heartbeats at the lighthouse and its first quorum request is pending there (the lighthouse's
status page counts the requests of the next quorum: while 0 and 1 wait, only 2's), so the
next quorum holds it -- a heartbeat alone left a loaded machine's restart too slow to ask
before the two had finished every step in fast quorums of their own. Worker 2 (attempt 1, a restart) starts with its first exchange
as the strategies' is -- the set-up broadcast: zeros unless it is healing, and ``x <- sum``
-- then trains as the others from the step it received. In the first quorum that holds a
healing worker every worker reports an error before its commit vote (``Manager.report_error``),
so nobody commits that exchange: the rejoin must be received again, not turned into a set-up
broadcast. The result file holds x after every step and the session's report.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from omegaconf import OmegaConf


def _fail_first_healing_vote(session) -> None:
    """Every worker: an error before the vote of the first quorum with a healing worker."""
    m = session.manager
    vote, done = m.should_commit, []

    def should_commit(*args, **kwargs):
        if not done and m.num_participants() < len(session.members()):
            done.append(True)
            m.report_error(RuntimeError("injected: the rejoin exchange is not committed"))
        return vote(*args, **kwargs)

    m.should_commit = should_commit


def _joiner_waiting(lighthouse: str) -> bool:
    """Worker 2 heartbeats and a quorum request is pending at the lighthouse (only 2 asks
    while 0 and 1 wait)."""
    from easgd_lightning.compat.torchft import live_replicas, pending_quorum_requests

    return "r00002" in (live_replicas(lighthouse) or set()) and (pending_quorum_requests(lighthouse) or 0) >= 1


def main() -> None:
    out, steps, wait_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from easgd_lightning.ft.worker import FTContext, FTSession

    cfg = OmegaConf.create({"ft": {"name": "torchft", "min_replicas": 1, "quorum_timeout_s": 30,
                              "collective_timeout_s": 5}})
    ctx = FTContext(cfg, os.path.dirname(out))
    rank = ctx.rank
    x = torch.tensor([float(rank + 1)], dtype=torch.float64)
    at = {"step": 0}
    session = FTSession(ctx, lambda: {"x": x.clone(), "local_steps": at["step"]},
                        lambda s: (x.copy_(s["x"]), at.update(step=int(s["local_steps"]))))
    _fail_first_healing_vote(session)
    history = []

    def average(n: int, healing: bool) -> list[torch.Tensor]:
        return [x.clone().div_(n)]

    def take(sums: list[torch.Tensor], healed: bool) -> None:
        x.copy_(sums[0])

    if ctx.attempt > 0:  # the set-up exchange, as the strategies' _init_center
        session.exchange(lambda n, healing: [x.clone() if healing else torch.zeros_like(x)], take, step=0, kind="test")
        history.append({"step": at["step"], "x": float(x[0]), "joined": True})
    while at["step"] < steps:
        at["step"] += 1
        if rank < 2 and at["step"] == wait_at:
            deadline = time.monotonic() + 60
            while not _joiner_waiting(ctx.lighthouse) and time.monotonic() < deadline:
                time.sleep(0.05)
        x.add_(float(rank + 1))
        session.exchange(average, take, step=at["step"], kind="test")
        history.append({"step": at["step"], "x": float(x[0]), "members": session.members()})
    with open(out, "w") as f:
        json.dump({"history": history, "report": session.report()}, f)
    session.shutdown()


if __name__ == "__main__":
    main()
