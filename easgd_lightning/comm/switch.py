"""NetReduce-style in-network aggregation, emulated (Liu et al., ASPLOS 2023).

NetReduce sums the workers' gradients inside the network: each worker sends its tensor
once, an FPGA beside the switch adds the packets of every worker as they stream through,
and each worker receives the sum once (1.5-1.7x training speedup over ring all-reduce).
Here the switch's adder is an *aggregator process* and the wire is the same process-group
engine as everything else (gloo point-to-point):

    worker r:   send(x_r) to the aggregator;  recv(sum) from it          (one pass each way)
    aggregator: recv x_0 .. x_{N-1};  s = x_0 + x_1 + ... (rank order);  send s to each

Like the switch, the aggregator streams: a tensor travels as up to :data:`STREAM_BLOCKS`
blocks (of at least :data:`STREAM_NUMEL` elements), and the aggregator sends block j's sum back as soon as
every worker's block j is in, while the workers' later blocks are still arriving. So the
upload and the download overlap (full duplex) and an exchange takes about one pass of the
tensor over the link plus one block, not an upload followed by a download.

A worker's link carries its tensor once up and the sum once down (a ring all-reduce sends
and receives 2 (N - 1) / N of it, in 2 (N - 1) latency-bound steps), and no worker host
reduces anything. The sum is in rank order, the same bits on every worker.

The switch group is a gloo process group of N + 1 ranks (workers 0 .. N - 1 with their
default-group ranks, the aggregator N) rendezvoused in the default group's store under
the prefix ``easgd_switch/<n>`` (n: the how-many-th switch client of the run). The
aggregator is a process of its own,
``python -m easgd_lightning.comm.switch --addr MASTER_ADDR --port MASTER_PORT --workers N``:
with ``aggregator="rank0"`` global rank 0 starts it beside itself (same host; on a real
network its traffic then shares host 0's link), with ``aggregator="external"`` someone
else does (``bench/cluster.py --aggregator switch`` starts it at the emulated switch, its
port unshaped as a switch backplane is).

Messages per exchange and worker: a header (3 int64: sequence number, numel, dtype code;
numel -1 closes), the tensor's blocks, and the sum's blocks back (messages of one tag
between two ranks are matched in the order they were posted). Every call is metered here (bytes sent =
tensor + header, received = the sum) under the caller's kind.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import os
import queue
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from easgd_lightning.comm.layout import AGGREGATORS
from easgd_lightning.comm.meter import get_meter
from easgd_lightning.utils.checks import check_choice

__all__ = [
    "AGGREGATORS",
    "STREAM_BLOCKS",
    "STREAM_NUMEL",
    "SWITCH_PREFIX",
    "SwitchClient",
    "aggregator_loop",
    "connect_group",
    "main",
    "stream_blocks",
]

SWITCH_PREFIX = "easgd_switch"

_TAG_HEADER, _TAG_DATA, _TAG_SUM = 11, 12, 13

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]

#: most blocks a tensor streams in: the download lags the upload by one block (1/8 of the
#: tensor), while every block costs each worker two messages and the aggregator 2N
STREAM_BLOCKS = 8
#: fewest elements per block (64 KiB of float32): smaller tensors travel in one block
STREAM_NUMEL = 16384


def stream_blocks(numel: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` ranges a tensor of ``numel`` elements streams in: blocks of
    max(STREAM_NUMEL, ceil(numel / STREAM_BLOCKS)) elements, the last may be shorter; none
    for an empty tensor."""
    block = max(STREAM_NUMEL, -(-numel // STREAM_BLOCKS))
    return [(a, min(a + block, numel)) for a in range(0, numel, block)]


def connect_group(store, rank: int, workers: int, timeout_s: float, session: int = 0) -> dist.ProcessGroup:
    """The switch group (``workers`` + 1 gloo ranks; the aggregator is rank ``workers``) of
    ``session`` (the how-many-th switch client of the workers' processes: every rank creates
    them in the same order). Blocks until every member has joined."""
    return dist.ProcessGroupGloo(
        dist.PrefixStore(f"{SWITCH_PREFIX}/{session}", store), rank, workers + 1,
        datetime.timedelta(seconds=timeout_s),
    )


def aggregator_loop(pg: dist.ProcessGroup, workers: int) -> int:
    """Serve exchanges until every worker closed; returns the number of sums sent.

    Raises:
        RuntimeError: the workers disagree on an exchange's size or type (a protocol error).
    """
    done = 0
    while True:
        headers = [torch.empty(3, dtype=torch.int64) for _ in range(workers)]
        for w in [pg.recv([h], r, _TAG_HEADER) for r, h in enumerate(headers)]:
            w.wait()
        rows = [tuple(h.tolist()) for h in headers]
        if all(r[1] < 0 for r in rows):
            return done
        if len(set(rows)) != 1:
            raise RuntimeError(f"switch aggregator: workers disagree on exchange (seq, numel, dtype): {rows}")
        _, numel, code = rows[0]
        bufs = [torch.empty(numel, dtype=_DTYPES[code]) for _ in range(workers)]
        blocks = stream_blocks(numel)
        recvs = [[pg.recv([b[i:j]], r, _TAG_DATA) for i, j in blocks] for r, b in enumerate(bufs)]
        sends = []
        for k, (i, j) in enumerate(blocks):  # block k's sum leaves while block k + 1 arrives
            for r in range(workers):
                recvs[r][k].wait()
            total = bufs[0][i:j]
            for b in bufs[1:]:
                total.add_(b[i:j])
            sends.extend(pg.send([total], r, _TAG_SUM) for r in range(workers))
        for w in sends:
            w.wait()
        done += 1


_sessions = 0  # switch clients created in this process


class SwitchClient:
    """A worker's end of the switch: :meth:`all_reduce_async` sums a tensor over the
    workers through the aggregator (module docstring).

    Args:
        aggregator: ``rank0`` (global rank 0 starts the aggregator process, from
            ``MASTER_ADDR`` / ``MASTER_PORT``) or ``external``.
        timeout_s: how long a member waits for the others.
        store: the rendezvous store (default: the default process group's).
    """

    def __init__(self, aggregator: str = "rank0", *, timeout_s: float = 300.0, store=None) -> None:
        check_choice("comm.aggregator", aggregator, AGGREGATORS)
        if store is None:
            from easgd_lightning.compat.lightning import default_store

            store = default_store()
            # the rendezvous server's own key space (init_process_group prefixes its store
            # with "default_pg"): the aggregator process connects to that server directly
            while isinstance(store, dist.PrefixStore):
                store = store.underlying_store
        global _sessions
        self.session, _sessions = _sessions, _sessions + 1
        self.rank = dist.get_rank()
        self.workers = dist.get_world_size()
        self._proc: subprocess.Popen | None = None
        if aggregator == "rank0" and self.rank == 0:
            self._proc = _start_aggregator(self.workers, self.session, timeout_s)
        self.pg = connect_group(store, self.rank, self.workers, timeout_s, self.session)
        self._seq = 0
        self._closed = False
        self._queue: queue.Queue = queue.Queue()
        self._waiter = threading.Thread(target=self._complete, name="easgd-switch-waiter", daemon=True)
        self._waiter.start()
        atexit.register(self.close)

    def _launch(self, tensor: torch.Tensor, numel: int, code: int) -> list:
        self._seq += 1
        header = torch.tensor([self._seq, numel, code], dtype=torch.int64)
        works = [self.pg.send([header], self.workers, _TAG_HEADER)]
        if numel >= 0:
            works.extend(self.pg.send([tensor[i:j]], self.workers, _TAG_DATA) for i, j in stream_blocks(numel))
        return works

    def all_reduce_async(self, tensor: torch.Tensor, *, kind: str, dense_bytes: int | None = None) -> torch.futures.Future:
        """Sum ``tensor`` (contiguous, CPU) over the workers in place; the future resolves to
        ``[tensor]`` (metered when it completes, no exposed time: the caller waits)."""
        if self._closed:
            raise RuntimeError("switch client is closed")
        start = time.perf_counter()
        flat = tensor.reshape(-1)
        sends = self._launch(flat, flat.numel(), _DTYPES.index(tensor.dtype))
        out = torch.empty_like(flat)
        recv = [self.pg.recv([out[i:j]], self.workers, _TAG_SUM) for i, j in stream_blocks(flat.numel())]
        fut: torch.futures.Future = torch.futures.Future()
        self._queue.put((sends, recv, out, flat, tensor, fut, start, kind, dense_bytes))
        return fut

    def all_reduce(self, tensor: torch.Tensor, *, kind: str) -> torch.Tensor:
        """Blocking :meth:`all_reduce_async`."""
        start = time.perf_counter()
        self.all_reduce_async(tensor, kind=kind).wait()
        get_meter().add_exposed(kind, time.perf_counter() - start)
        return tensor

    def _complete(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            sends, recv, out, flat, tensor, fut, start, kind, dense = item
            try:
                for w in (*recv, *sends):
                    w.wait()
                flat.copy_(out)
                size = flat.numel() * flat.element_size()
                get_meter().record(
                    kind, sent=size + 24, recv=size, dense=size if dense is None else dense,
                    seconds=time.perf_counter() - start, exposed=0.0,
                )
                fut.set_result([tensor])
            except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(err)

    def close(self, timeout_s: float = 60.0) -> None:
        """Tell the aggregator this worker is done (once); rank 0 waits for the aggregator
        process it started (killed after ``timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._waiter.join(timeout_s)
        try:
            for w in self._launch(torch.empty(0), -1, 0):
                w.wait()
        except RuntimeError:  # the group is gone already (a peer died): nothing to close
            pass
        if self._proc is not None:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _start_aggregator(workers: int, session: int, timeout_s: float) -> subprocess.Popen:
    """Rank 0's aggregator process (``aggregator="rank0"``), on the rendezvous address."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise RuntimeError(
            "comm.aggregator=rank0 starts the switch's aggregator at MASTER_ADDR:MASTER_PORT, "
            "which are not set (initialise the process group from the environment, env://)"
        )
    cmd = [
        sys.executable, "-m", "easgd_lightning.comm.switch", "--addr", addr, "--port", port,
        "--workers", str(workers), "--session", str(session), "--timeout-s", str(timeout_s),
    ]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))


def main(argv: list[str] | None = None) -> int:
    """The aggregator as a process of its own (``--aggregator switch`` of bench/cluster.py)."""
    p = argparse.ArgumentParser(description="NetReduce-style aggregator (easgd_lightning.comm.switch)")
    p.add_argument("--addr", required=True, help="the rendezvous store's host (MASTER_ADDR)")
    p.add_argument("--port", type=int, required=True, help="the rendezvous store's port (MASTER_PORT)")
    p.add_argument("--workers", type=int, required=True, help="number of workers (the world size)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--session", type=int, default=0, help="the workers' switch client it serves (0: their first)")
    args = p.parse_args(argv)
    store = dist.TCPStore(
        args.addr, args.port, None, False, timeout=datetime.timedelta(seconds=args.timeout_s)
    )
    pg = connect_group(store, args.workers, args.workers, args.timeout_s, args.session)
    n = aggregator_loop(pg, args.workers)
    print(f"[switch] served {n} exchanges for {args.workers} workers", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
