"""One rank of the exposed-communication checks (launched torchrun-style by the tests).

Usage: exposed_time_run.py OUT SLEEP_S

Three kinds, each arranged so that rank 0's collective takes about SLEEP_S / 2 or more
of wall time because rank 1 arrives late:

* ``blocking``: a blocking all-reduce; rank 0 waits inside it (all exposed).
* ``hidden``: a non-blocking all-reduce that rank 0 launches, then computes (sleeps
  SLEEP_S) and only then waits for (hidden: little exposed).
* ``data_parallel``: the metered dense DDP hook; rank 0 launches its first bucket, then
  its backward computes for SLEEP_S before the last bucket; rank 1 computes SLEEP_S
  before its first bucket. Rank 0's first bucket is hidden behind its own backward
  (``ddp_hidden``); in a second metered iteration rank 0 does not compute after its first
  bucket and waits for it at the end of backward (``ddp_exposed``).

Writes OUT/rank{r}.json with the meter's per-kind totals.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from easgd_lightning.comm import get_meter, ops
from easgd_lightning.hooks import register_compression_hook


class SleepInBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps (stands in for a known compute interval)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.seconds > 0:
            time.sleep(ctx.seconds)
        return grad, None


class Net(nn.Module):
    """Two linear layers with a known backward compute interval around the first bucket."""

    def __init__(self, after_first_bucket: float, before_first_bucket: float) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 600), nn.Linear(600, 600)
        self.after, self.before = after_first_bucket, before_first_bucket

    def forward(self, x):
        h = SleepInBackward.apply(self.l1(x), self.after)  # runs after l2's grads
        return SleepInBackward.apply(self.l2(h), self.before)  # runs before l2's grads


def main() -> None:
    out, sleep_s = sys.argv[1], float(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    meter = get_meter()

    # blocking: rank 1 is late, rank 0 waits inside the call
    dist.barrier()
    if rank == 1:
        time.sleep(sleep_s / 2)
    ops.all_reduce(torch.ones(1000), kind="blocking")

    # hidden: rank 0 launches, computes, then waits; rank 1 launches late
    dist.barrier()
    if rank == 1:
        time.sleep(sleep_s / 2)
    fut = ops.all_reduce_async(torch.ones(1000), kind="hidden")
    if rank == 0:
        time.sleep(sleep_s)
    ops.wait(fut, kind="hidden")

    # the DDP dense hook: first bucket (layer 2, > 1 MB) early on rank 0, late on rank 1
    model = Net(after_first_bucket=sleep_s if rank == 0 else 0.0,
                before_first_bucket=sleep_s if rank == 1 else 0.0)
    ddp = DistributedDataParallel(model, bucket_cap_mb=1)
    register_compression_hook(ddp, None)
    x = torch.randn(4, 16)
    ddp_runs = {}
    for it in range(3):  # the first iteration rebuilds DDP's buckets; meter the others
        if it == 2:  # rank 0 no longer computes behind its first bucket: it waits exposed
            model.after = 0.0
        meter.by_kind.pop("data_parallel", None)
        dist.barrier()
        ddp(x).pow(2).mean().backward()
        ddp_runs[("warmup", "ddp_hidden", "ddp_exposed")[it]] = meter.by_kind.pop("data_parallel").as_dict()
    grads_equal = [p.grad.clone() for p in ddp.parameters()]
    gathered = [torch.cat([g.reshape(-1) for g in grads_equal])]
    other = [torch.empty_like(gathered[0]) for _ in range(2)]
    dist.all_gather(other, gathered[0])
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "by_kind": {k: v.as_dict() for k, v in meter.by_kind.items()},
                "grads_agree": bool(torch.equal(other[0], other[1])),
                "ddp": ddp_runs,
            },
            f,
        )


if __name__ == "__main__":
    main()
