"""The floor of one synchronous exchange per step: a bare gloo all-gather after balanced compute.

Issue 29 item 2 asks the compressed rows of the quick scenario for efficiency >= 0.7 (limit
step / row step). Whatever the codec, such a row pays one blocking collective per step. This
script times that collective alone, with nothing of the framework around it: two ranks, each
runs ``--compute-ms`` of single-threaded matrix products (the same on both, so neither waits
for a slower peer), then one ``all_gather`` of ``--sizes`` bytes, ``--repeats`` times; the
first ``--warmup`` are dropped. It reports the median, the mean and the 90th percentile of the
collective's time per call (launch to completion) and the CPU time rank 0's process spent in
it (every thread: gloo's included), on the emulated hosts (two network
namespaces at ``--rate-mbit``, as ``bench/cluster.py`` builds them) and, with ``--loopback``,
as two plain processes on 127.0.0.1. The mean is what a training step pays on average.

    sudo .venv/bin/python -m bench.collective_floor                 # emulated hosts, 100 Mbit/s
    .venv/bin/python -m bench.collective_floor --loopback           # no namespaces needed

With a limit step L and a floor mean F, no row with one blocking collective per step is more
efficient than L / (L + F).

``--mode overlap`` times the overlapped exchange of Sync EASGD instead (issue 29 item 4):
``--hosts`` ranks, each launches a non-blocking all-reduce of ``--sizes`` bytes of float32,
computes ``--compute-ms`` meanwhile, then waits; and, for reference, the same all-reduce
alone (no compute) and the compute alone. Against the ring's bandwidth bound
(``_tables.ring_bound``: max(compute, 2 (p - 1) / p x bytes x 8 / rate)) the overlapped
step's excess is what the framework cannot remove: the ring's hops and the compute sharing
the cores.

    sudo .venv/bin/python -m bench.collective_floor --mode overlap --hosts 8 --rate-mbit 150 \
        --mtu 9000 --sizes 614400 --compute-ms 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

__all__ = ["busy", "summarize", "main"]

REPO = Path(__file__).resolve().parents[1]


def busy(ms: float, a, b) -> None:
    """Matrix products of ``a`` and ``b`` for ``ms`` milliseconds of wall time."""
    start = time.perf_counter()
    while (time.perf_counter() - start) * 1e3 < ms:
        a @ b


def summarize(times_ms: list[float]) -> dict:
    """Median, mean and 90th percentile (ms) of the timed calls."""
    ordered = sorted(times_ms)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {"median_ms": statistics.median(ordered), "mean_ms": statistics.fmean(ordered),
            "p90_ms": p90, "calls": len(ordered)}


def _overlap_rows(args) -> list[dict]:
    """Per size: the all-reduce alone, the compute alone and the two overlapped, timed per step
    (the compute: small products, so a step overshoots ``--compute-ms`` by little on a shared
    core)."""
    import torch

    from easgd_lightning.comm import ops

    a, b = torch.randn(64, 64), torch.randn(64, 64)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        buf = torch.randn(max(1, size // 4))
        phases = {}
        for phase in ("allreduce", "compute", "overlapped"):
            times = []
            for i in range(args.repeats):
                if i == 0:
                    ops.barrier(kind="floor")
                start = time.perf_counter()
                fut = ops.all_reduce_async(buf, kind="floor") if phase != "compute" else None
                if phase != "allreduce" and args.idle_compute:
                    time.sleep(args.compute_ms / 1e3)  # the cores left to the exchange
                elif phase != "allreduce":
                    busy(args.compute_ms, a, b)
                if fut is not None:
                    ops.wait(fut, kind="floor")
                if i >= args.warmup:
                    times.append((time.perf_counter() - start) * 1e3)
            phases[phase] = summarize(times)
        rows.append({"bytes": buf.numel() * 4, **phases})
    return rows


def _worker(args) -> int:
    """One rank: the timed loop; rank 0 writes ``--out``/floor.json."""
    import torch
    import torch.distributed as dist

    from easgd_lightning.comm import ops

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    if args.compute_nice:  # this thread only: gloo's threads, started above, keep theirs
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), args.compute_nice)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    rows = _overlap_rows(args) if args.mode == "overlap" else []
    for size in [int(s) for s in args.sizes.split(",")] if args.mode == "gather" else []:
        send = torch.zeros(size, dtype=torch.uint8)
        times, cpu = [], 0.0
        for i in range(args.repeats):
            busy(args.compute_ms, a, b)
            start, start_cpu = time.perf_counter(), time.process_time()
            ops.all_gather(send, kind="floor")  # the framework's blocking all-gather, metered
            if i >= args.warmup:
                times.append((time.perf_counter() - start) * 1e3)
                cpu += time.process_time() - start_cpu
        rows.append({"bytes": size, **summarize(times), "cpu_ms": 1e3 * cpu / len(times)})
    if dist.get_rank() == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "floor.json").write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()
    return 0


def _spawn_loopback(argv: list[str], port: int, timeout_s: float) -> list:
    from bench._runs import wait_all
    from easgd_lightning.utils.rank_env import clean_env, rank_env

    env = clean_env(repo=REPO)
    procs = [subprocess.Popen([sys.executable, "-m", "bench.collective_floor", "--worker", *argv],
                              env=rank_env(env, r, 2, port), cwd=REPO) for r in range(2)]
    try:
        codes, _ = wait_all(procs, timeout_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return codes


def _spawn_emulated(argv: list[str], rate: float, port: int, timeout_s: float, log_dir: Path,
                    hosts: int = 2, mtu: int = 1500) -> list:
    from bench._netem import EmulatedCluster, LinkSpec, install_signal_handlers
    from bench._runs import host_rank_env, wait_all

    install_signal_handlers()
    log_dir.mkdir(parents=True, exist_ok=True)
    with EmulatedCluster(hosts, LinkSpec(rate_mbit=rate, latency_ms=0.0), mtu=mtu) as cluster:
        procs = [cluster.spawn(r, [sys.executable, "-m", "bench.collective_floor", "--worker", *argv],
                               host_rank_env(cluster, r, port), log_dir / f"rank{r}.log") for r in range(hosts)]
        codes, _ = wait_all(procs, timeout_s)
    return codes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loopback", action="store_true", help="two plain processes on 127.0.0.1")
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--compute-ms", type=float, default=7.0, help="compute before each call (the limit step)")
    p.add_argument("--sizes", default="40,12000", help="bytes per rank, comma-separated")
    p.add_argument("--repeats", type=int, default=320)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--port", type=int, default=29731)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "collective_floor")
    p.add_argument("--mode", choices=("gather", "overlap"), default="gather",
                   help="gather: a blocking all-gather after compute; overlap: Sync EASGD's overlapped all-reduce")
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts, one rank each (overlap mode)")
    p.add_argument("--mtu", type=int, default=1500, help="frame size of the emulated links (bytes)")
    p.add_argument("--compute-nice", type=int, default=0,
                   help="nice value of each rank's main (computing) thread; gloo's threads keep 0")
    p.add_argument("--idle-compute", action="store_true",
                   help="overlap mode: sleep instead of computing (does the exchange slow for want of cores?)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.hosts < 2 or (args.hosts != 2 and (args.mode != "overlap" or args.loopback)):
        p.error("--hosts: at least 2, and other than 2 only with --mode overlap on emulated hosts")
    load = os.getloadavg()
    passed = ["--compute-ms", str(args.compute_ms), "--sizes", args.sizes, "--repeats", str(args.repeats),
              "--warmup", str(args.warmup), "--timeout-s", str(args.timeout_s), "--out", str(args.out),
              "--mode", args.mode, "--compute-nice", str(args.compute_nice)] + (
                  ["--idle-compute"] if args.idle_compute else [])
    if args.loopback:
        codes, where = _spawn_loopback(passed, args.port, args.timeout_s), "loopback (127.0.0.1)"
    else:
        codes = _spawn_emulated(passed, args.rate_mbit, args.port, args.timeout_s, args.out, args.hosts, args.mtu)
        where = f"{args.hosts} emulated hosts at {args.rate_mbit:g} Mbit/s, {args.mtu}-byte frames"
    where += f", compute at nice {args.compute_nice}" if args.compute_nice else ""
    where += ", sleeping instead of computing" if args.idle_compute else ""
    if any(c != 0 for c in codes):
        print(f"[floor] a rank failed: {codes}", file=sys.stderr)
        return 1
    rows = json.loads((args.out / "floor.json").read_text())
    if args.mode == "overlap":
        return _print_overlap(rows, args, where, load)
    print(f"# gloo all-gather after {args.compute_ms:g} ms of compute, {where}; "
          f"load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| bytes per rank | median (ms) | mean (ms) | p90 (ms) | CPU of rank 0 per call (ms, all its threads) | calls |\n"
          "|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['bytes']} | {r['median_ms']:.3f} | {r['mean_ms']:.3f} | {r['p90_ms']:.3f} | {r['cpu_ms']:.3f} "
              f"| {r['calls']} |")
    best = args.compute_ms / (args.compute_ms + rows[0]["mean_ms"])
    print(f"Efficiency bound of one blocking collective per step at a {args.compute_ms:g} ms limit "
          f"step: {best:.2f} (compute / (compute + mean of the smallest message)).")
    return 0


def _print_overlap(rows: list[dict], args, where: str, load) -> int:
    """The overlap mode's table: each phase's mean and median per step, the bound, the share."""
    from bench._tables import ring_bound

    print(f"# Sync EASGD's overlapped all-reduce, {where}, {args.compute_ms:g} ms of compute per step; "
          f"load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| bytes | all-reduce alone (ms) | compute alone (ms) | overlapped (ms) | bound (ms) | excess (ms) "
          "| bound / overlapped |\n|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        bound = ring_bound(args.hosts, r["bytes"], args.rate_mbit, r["compute"]["mean_ms"] / 1e3, 1.0)["best_step_s"] * 1e3
        over = r["overlapped"]["mean_ms"]
        print(f"| {r['bytes']} | {r['allreduce']['mean_ms']:.2f} (median {r['allreduce']['median_ms']:.2f}) "
              f"| {r['compute']['mean_ms']:.2f} | {over:.2f} (median {r['overlapped']['median_ms']:.2f}) "
              f"| {bound:.2f} | {over - bound:.2f} | {bound / over:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
