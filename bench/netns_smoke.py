"""One rank of the emulated-network smoke test: a timed all-reduce over gloo.

``python -m bench.cluster --smoke`` starts this script once per network namespace, with the
rendezvous in the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``GLOO_SOCKET_IFNAME``), to prove that the namespaces, the bridge and the ``tc`` shaping
carry real gloo traffic at the configured rate. Each rank all-reduces a float32 tensor of
``--mbytes`` megabytes ``--repeats`` times (after one warm-up) through
:mod:`easgd_lightning.comm.ops`, checks the sum against the closed form, and writes its
timings to ``--out``/rank<RANK>.json, with the machine's CPU time by kind over the timed
all-reduces (/proc/stat: every emulated host's kernel work for the packets shares it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from easgd_lightning.comm import get_meter, ops
from easgd_lightning.utils.cputime import cpu_reading, cpu_spent

__all__ = ["expected_sum", "main"]


def expected_sum(world_size: int) -> float:
    """Value of every element after summing ``rank + 1`` over all ranks.

    Args:
        world_size: number of ranks.

    Returns:
        ``world_size * (world_size + 1) / 2``.
    """
    return world_size * (world_size + 1) / 2.0


def main(argv: list[str] | None = None) -> int:
    """Run one rank of the smoke test; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbytes", type=float, default=10.0, help="tensor size in MB (1e6)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=args.timeout_s)
    )
    try:
        numel = max(1, int(args.mbytes * 1e6) // 4)
        tensor = torch.empty(numel, dtype=torch.float32)
        want = expected_sum(world_size)
        times: list[float] = []
        timed: list[tuple[dict, dict]] = []  # CPU readings around each timed all-reduce
        for i in range(args.repeats + 1):  # the first one is a warm-up
            tensor.fill_(float(rank + 1))
            ops.barrier()
            before = cpu_reading()
            start = time.perf_counter()
            ops.all_reduce(tensor, kind="smoke")
            elapsed = time.perf_counter() - start
            after = cpu_reading()
            if not torch.all(tensor == want):
                raise RuntimeError(f"rank {rank}: all-reduce sum wrong (want {want})")
            if i > 0:
                times.append(elapsed)
                timed.append((before, after))
        snap = get_meter().snapshot()
        result = {
            "rank": rank,
            "world_size": world_size,
            "bytes": numel * 4,
            "times_s": times,
            "median_s": statistics.median(times),
            "meter_bytes_sent": snap["bytes_sent"],
            "cpu": cpu_spent(timed),
        }
        args.out.mkdir(parents=True, exist_ok=True)
        tmp = args.out / f"rank{rank}.json.tmp"
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(args.out / f"rank{rank}.json")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
