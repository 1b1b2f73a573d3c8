"""One rank of the cost model's collective probe (``python -m bench.costmodel --measure``).

:func:`bench.costmodel.measure.run_probe` starts this module (``python -m
bench.costmodel.probe``) once per network namespace of the emulated cluster (rendezvous
in the environment: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``GLOO_SOCKET_IFNAME``) and times, through :mod:`easgd_lightning.comm.ops`
(the wrappers every strategy uses), each collective the strategies use at several message
sizes:

- ``ring``: ``ops.all_reduce`` (gloo's ring all-reduce);
- ``tree``: a binomial-tree reduce to rank 0 followed by a binomial-tree broadcast, both
  from ``ops.send`` / ``ops.recv`` (SC17's tree all-reduce);
- ``allgather``: ``ops.all_gather_varlen`` of one message per rank (the sparse
  compressors' all-gather, with its header);
- ``broadcast``: ``ops.broadcast`` from rank 0;
- ``ps``: every rank but the last sends a request to the last rank (the parameter
  server) in the strategies' protocol (``strategies/ps/client.py`` / ``server.py``): a
  header and the message, non-blocking, with the reply's header and payload receives
  posted at once; the server serves them first come first served (the header from any
  source, then that worker's payload) and replies with a header and a message of the
  same size by blocking sends (the asynchronous strategies' exchange).

With ``--loops`` each rank also runs, per link rate and message size, three short
training-shaped loops of ``--loop-iters`` iterations around a fixed CPU kernel
(``--kernel-matmuls`` products of two 256 x 256 float32 matrices, one thread):

- ``loop_free``: the kernel alone, no collective (the ``limit`` row's shape: every rank
  computes, the ranks share the cores);
- ``loop_serial_ring``: kernel, then a blocking all-reduce (DDP's and the blocking
  strategies' shape);
- ``loop_overlap_ring``: kernel, then wait for the previous iteration's all-reduce and
  launch the next one non-blocking (Sync EASGD's overlap);
- ``loop_serial_allgather`` / ``loop_overlap_allgather``: the same with the sparse
  compressors' all-gather (``ops.all_gather_varlen``) of the message;

at the smallest and the largest message of each rate, each timed per iteration (the loop's time over its iterations, the slowest rank's). They
measure what the idle probe cannot: how a collective behaves when the ranks that run it
also compute on the same cores. At the smallest message of each rate two more loops,
``loop_serial_ring_x2`` and ``loop_serial_ring_x4``, run the kernel then 2 or 4 blocking
all-reduces in a row: whether the synchronisation cost is paid once per exchange or once
per blocking round (an exchange of several messages, e.g. PowerSGD's P and Q rounds).
With ``--between-matmuls`` one more, ``loop_serial_ring_codec``, runs the kernel, a
blocking all-reduce, a shorter kernel of that many products (sized from the codec's
measured time between its rounds) and a second all-reduce: PowerSGD's shape, whose second
round waits for ranks that compute their codec on shared cores.
At the largest message of each rate one more, ``loop_ps``, has the asynchronous
strategies' shape: every worker runs the kernel then its exchange with the parameter
server (the ``ps`` protocol above), the server serves the requests as they come: how much
of each reply drains behind the next request once the server is kept busy by requests
arriving in turn, where the fan-in has every worker push once, at the same time.
The harness sizes the kernel (``--kernel-matmuls``) so that it takes as long as the
workload's measured compute per step.

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
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from easgd_lightning.comm import ops
from easgd_lightning.utils.atomic import atomic_write_text

__all__ = ["LOOPS", "OPS", "ROUNDS", "main"]

OPS = ("ring", "tree", "allgather", "broadcast", "ps")
LOOPS = ("loop_free", "loop_serial_ring", "loop_overlap_ring", "loop_serial_allgather",
         "loop_overlap_allgather")
#: blocking rounds per iteration of the extra serial loops (smallest message only)
ROUNDS = (2, 4)
#: two blocking all-reduces with the codec's compute between them (PowerSGD's shape)
_CODEC_ROUNDS = "loop_serial_ring_codec"
_KIND = "probe"
_KERNEL_N = 256


def _kernel(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, matmuls: int) -> None:
    """The loops' compute: ``matmuls`` products of two 256 x 256 matrices."""
    for _ in range(matmuls):
        torch.mm(a, b, out=out)


def _loop(kind: str, t: torch.Tensor, iters: int, kernel: Callable[[], None], slot: dict,
          between: Callable[[], None] | None = None) -> float:
    """One training-shaped loop (the module docstring); seconds per iteration."""
    start = time.perf_counter()
    pending = None
    gather = kind.endswith("allgather")
    rounds = int(kind.rsplit("_x", 1)[1]) if "_x" in kind else 2 if kind == _CODEC_ROUNDS else 1
    for _ in range(iters):
        kernel()
        if kind.startswith("loop_serial"):
            for r in range(rounds):
                if r and kind == _CODEC_ROUNDS:
                    between()
                if gather:
                    ops.all_gather_varlen([t], kind=_KIND, slot=slot)
                else:
                    ops.all_reduce(t, kind=_KIND)
        elif kind.startswith("loop_overlap"):
            if pending is not None:
                ops.wait(pending, kind=_KIND)
            pending = (ops.all_gather_varlen_async([t], kind=_KIND, slot=slot) if gather
                       else ops.all_reduce_async(t, kind=_KIND))
    if pending is not None:
        ops.wait(pending, kind=_KIND)
    return (time.perf_counter() - start) / iters


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


#: the request's and the reply's header and payload tags (as the strategies' protocol)
_TAG_REQ, _TAG_REQ_DATA, _TAG_REP, _TAG_REP_DATA = 11, 12, 13, 14
_HEADER = 4


def _ps_request(t: torch.Tensor, server: int, reply: torch.Tensor) -> None:
    """A worker's exchange in the parameter server's protocol: header and message sent
    non-blocking, the reply's header and payload receives posted at once; waits for all."""
    hdr, reply_hdr = torch.zeros(_HEADER, dtype=torch.float64), torch.zeros(_HEADER, dtype=torch.float64)
    works = [ops.isend(hdr, server, kind=_KIND, tag=_TAG_REQ),
             ops.isend(t, server, kind=_KIND, tag=_TAG_REQ_DATA),
             ops.irecv(reply_hdr, server, kind=_KIND, tag=_TAG_REP),
             ops.irecv(reply, server, kind=_KIND, tag=_TAG_REP_DATA)]
    for work in works:
        work.wait()


def _ps_serve(t: torch.Tensor, scratch: torch.Tensor, requests: int) -> None:
    """The server's side: ``requests`` requests first come first served (the header from
    any source, then that worker's payload), each answered by blocking sends of a header
    and a message of the same size."""
    hdr = torch.zeros(_HEADER, dtype=torch.float64)
    for _ in range(requests):
        src = ops.recv(hdr, None, kind=_KIND, tag=_TAG_REQ)
        ops.recv(scratch, src, kind=_KIND, tag=_TAG_REQ_DATA)
        ops.send(hdr, src, kind=_KIND, tag=_TAG_REP)
        ops.send(t, src, kind=_KIND, tag=_TAG_REP_DATA)


def _ps(t: torch.Tensor, rank: int, world: int, reply: torch.Tensor) -> None:
    """One fan-in in the parameter server's protocol (the module docstring)."""
    if rank != world - 1:
        _ps_request(t, world - 1, reply)
    else:
        _ps_serve(t, reply, world - 1)


def _ps_loop(t: torch.Tensor, rank: int, world: int, iters: int, kernel: Callable[[], None],
             reply: torch.Tensor) -> float:
    """``loop_ps``, the asynchronous strategies' shape: each worker runs the kernel then
    its exchange with the server, ``iters`` times; the server (the last rank, no kernel)
    serves world - 1 requests per iteration as they come. Seconds per iteration."""
    start = time.perf_counter()
    for _ in range(iters):
        if rank != world - 1:
            kernel()
            _ps_request(t, world - 1, reply)
        else:
            _ps_serve(t, reply, world - 1)
    return (time.perf_counter() - start) / iters


def _loop_record(op: str, t: torch.Tensor, scratch: torch.Tensor, slot: dict, args, label: str,
                 rank: int, world: int, kernel: Callable[[], None],
                 between: Callable[[], None] | None = None, **extra) -> dict:
    """One loop's record: ``--loop-repeats`` timed loops after a warm-up, each between
    barriers (``loop_ps`` with ``scratch`` as the server's reply buffer)."""
    times = []
    for i in range(args.loop_repeats + 1):  # the first is a warm-up
        ops.barrier()
        per_iter = (_ps_loop(t, rank, world, args.loop_iters, kernel, scratch) if op == "loop_ps"
                    else _loop(op, t, args.loop_iters, kernel, slot, between))
        if i:
            times.append(per_iter)
        t.fill_(1.0)
    return {"phase": label, "op": op, "bytes": t.numel() * 4, "times_s": times,
            "kernel_matmuls": args.kernel_matmuls, "between_matmuls": args.between_matmuls, **extra}


def _workload_ps_loops(args, label: str, rank: int, world: int, kernel: Callable[[], None]) -> list[dict]:
    """``loop_free`` and ``loop_ps`` at the workload's message (``--ps-bytes``), marked
    ``"at": "workload"``: the busy server's reply overlap at the size the rows exchange."""
    numel = max(2, args.ps_bytes // 4)
    t, reply = torch.ones(numel), torch.empty(numel)
    return [_loop_record(op, t, reply, {}, args, label, rank, world, kernel, at="workload")
            for op in ("loop_free", "loop_ps")]


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


def _parser() -> argparse.ArgumentParser:
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
    parser.add_argument("--loops", action="store_true",
                        help="also time the training-shaped loops (module docstring)")
    parser.add_argument("--loop-iters", type=int, default=4)
    parser.add_argument("--loop-repeats", type=int, default=3)
    parser.add_argument("--kernel-matmuls", type=int, default=32)
    parser.add_argument("--ps-bytes", type=int, default=0,
                        help="with --loops: also run loop_free and loop_ps at this message size "
                             "in every phase (the workload's dense message)")
    parser.add_argument("--between-matmuls", type=int, default=0,
                        help="products between the two rounds of loop_serial_ring_codec (0: no such loop)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one rank of the probe; returns the exit code."""
    args = _parser().parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout_s))
    phases = args.phases.split(",")
    sizes = [[int(s) for s in part.split(":")] for part in args.sizes.split(",")]
    wanted = [o for o in args.ops.split(",") if o]
    ka, kb = torch.randn(_KERNEL_N, _KERNEL_N), torch.randn(_KERNEL_N, _KERNEL_N)
    kout = torch.empty(_KERNEL_N, _KERNEL_N)

    def kernel() -> None:
        _kernel(ka, kb, kout, args.kernel_matmuls)

    def between() -> None:
        _kernel(ka, kb, kout, args.between_matmuls)

    records = []
    try:
        for k, (label, phase_sizes) in enumerate(zip(phases, sizes)):
            if rank == 0:
                (args.out / f"phase{k}.ready").write_text(label)
                _wait_for(args.out / f"phase{k}.go", args.timeout_s)
            ops.barrier()
            for nbytes in phase_sizes:
                records += _size_records(args, label, phase_sizes, nbytes, wanted, rank, world, kernel, between)
            if args.loops and args.ps_bytes > 0 and "ps" in wanted and world > 2:
                records += _workload_ps_loops(args, label, rank, world, kernel)
        atomic_write_text(
            args.out / f"rank{rank}.json",
            json.dumps({"rank": rank, "world_size": world, "records": records}),
        )
    finally:
        dist.destroy_process_group()
    return 0


def _size_records(args, label: str, phase_sizes: list[int], nbytes: int, wanted: list[str], rank: int,
                  world: int, kernel: Callable[[], None], between: Callable[[], None]) -> list[dict]:
    """One message size of one phase: each wanted collective, ``--repeats`` times after a
    warm-up, each between barriers; then, with ``--loops``, the loops at the phase's
    smallest and largest size (the serial rounds and the codec's at the smallest, the busy
    server at the largest)."""
    numel = max(2, nbytes // 4)
    t = torch.ones(numel)
    scratch = torch.empty(numel)
    slot: dict = {}
    records = []
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
    looped = args.loops and nbytes in (phase_sizes[0], phase_sizes[-1])
    rounds = [f"loop_serial_ring_x{r}" for r in ROUNDS] if nbytes == phase_sizes[0] else []
    if rounds and args.between_matmuls > 0:
        rounds.append(_CODEC_ROUNDS)
    served = ["loop_ps"] if "ps" in wanted and world > 1 and nbytes == phase_sizes[-1] else []
    for op in [*LOOPS, *rounds, *served] if looped else ():
        records.append(_loop_record(op, t, scratch, slot, args, label, rank, world, kernel, between))
    return records


if __name__ == "__main__":
    raise SystemExit(main())
