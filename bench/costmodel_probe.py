"""One rank of the cost model's collective probe (``bench/costmodel.py --measure``).

``bench/costmodel.py`` starts this script once per network namespace of the emulated
cluster (rendezvous in the environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``GLOO_SOCKET_IFNAME``) and times, through :mod:`easgd_lightning.comm.ops`
(the wrappers every strategy uses), each collective the strategies use at several message
sizes:

- ``ring``: ``ops.all_reduce`` (gloo's ring all-reduce);
- ``tree``: a binomial-tree reduce to rank 0 followed by a binomial-tree broadcast, both
  from ``ops.send`` / ``ops.recv`` (SC17's tree all-reduce);
- ``allgather``: ``ops.all_gather_varlen`` of one message per rank (the sparse
  compressors' all-gather, with its header);
- ``broadcast``: ``ops.broadcast`` from rank 0;
- ``ps``: every rank but the last sends its message to the last rank (the parameter
  server), which serves them first come first served (``recv`` from any source) and
  sends each one a reply of the same size (the asynchronous strategies' exchange).

Between link rates (``--phases``) rank 0 writes ``OUT/phase<K>.ready`` and waits for the
harness, which reshapes the links and writes ``OUT/phase<K>.go``. Each rank writes its
per-repeat times to ``OUT/rank<R>.json``; a collective's time is the slowest rank's
(the harness takes the maximum over ranks per repeat, then the median over repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from easgd_lightning.comm import ops
from easgd_lightning.utils.atomic import atomic_write_text

__all__ = ["OPS", "main"]

OPS = ("ring", "tree", "allgather", "broadcast", "ps")
_KIND = "probe"


def _tree_allreduce(t: torch.Tensor, rank: int, world: int, scratch: torch.Tensor) -> None:
    """Binomial-tree reduce to rank 0, then binomial-tree broadcast from rank 0."""
    mask = 1
    while mask < world:
        if rank & mask:
            ops.send(t, rank - mask, kind=_KIND)
            break
        if rank + mask < world:
            ops.recv(scratch, rank + mask, kind=_KIND)
            t.add_(scratch)
        mask <<= 1
    # broadcast back down the same tree: rank r receives from r - lowbit(r)
    top = 1
    while top < world:
        top <<= 1
    mask = top >> 1
    low = rank & -rank if rank else top
    while mask >= 1:
        if mask < low and rank + mask < world:
            ops.send(t, rank + mask, kind=_KIND)
        elif mask == low and rank:
            ops.recv(t, rank - mask, kind=_KIND)
        mask >>= 1


def _ps(t: torch.Tensor, rank: int, world: int, reply: torch.Tensor) -> None:
    server = world - 1
    if rank != server:
        ops.send(t, server, kind=_KIND)
        ops.recv(reply, server, kind=_KIND)
        return
    for _ in range(world - 1):
        src = ops.recv(reply, None, kind=_KIND)
        ops.send(t, src, kind=_KIND)


def _run(op: str, t: torch.Tensor, rank: int, world: int, scratch: torch.Tensor, slot: dict) -> None:
    if op == "ring":
        ops.all_reduce(t, kind=_KIND)
    elif op == "tree":
        _tree_allreduce(t, rank, world, scratch)
    elif op == "allgather":
        ops.all_gather_varlen([t], kind=_KIND, slot=slot)
    elif op == "broadcast":
        ops.broadcast(t, 0, kind=_KIND)
    elif op == "ps":
        _ps(t, rank, world, scratch)
    else:  # pragma: no cover - guarded by argparse
        raise ValueError(op)


def _wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} from the harness within {timeout_s:.0f} s")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    """Run one rank of the probe; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phases", required=True, help="comma-separated link rates (labels)")
    parser.add_argument(
        "--sizes", required=True,
        help="per phase, sizes in bytes: 'a:b:c,d:e:f' (one colon-list per phase)",
    )
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout_s))
    phases = args.phases.split(",")
    sizes = [[int(s) for s in part.split(":")] for part in args.sizes.split(",")]
    wanted = [o for o in args.ops.split(",") if o]
    records = []
    try:
        for k, (label, phase_sizes) in enumerate(zip(phases, sizes)):
            if rank == 0:
                (args.out / f"phase{k}.ready").write_text(label)
                _wait_for(args.out / f"phase{k}.go", args.timeout_s)
            ops.barrier()
            for nbytes in phase_sizes:
                numel = max(2, nbytes // 4)
                t = torch.ones(numel)
                scratch = torch.empty(numel)
                slot: dict = {}
                for op in wanted:
                    if op == "ps" and world < 2:
                        continue
                    times = []
                    for i in range(args.repeats + 1):  # the first is a warm-up
                        ops.barrier()
                        start = time.perf_counter()
                        _run(op, t, rank, world, scratch, slot)
                        if i:
                            times.append(time.perf_counter() - start)
                        t.fill_(1.0)
                    records.append({"phase": label, "op": op, "bytes": numel * 4, "times_s": times})
        atomic_write_text(
            args.out / f"rank{rank}.json",
            json.dumps({"rank": rank, "world_size": world, "records": records}),
        )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
