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
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
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


def _worker(args) -> int:
    """One rank: the timed loop; rank 0 writes ``--out``/floor.json."""
    import torch
    import torch.distributed as dist

    from easgd_lightning.comm import ops

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
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


def _spawn_emulated(argv: list[str], rate: float, port: int, timeout_s: float, log_dir: Path) -> list:
    from bench._netem import EmulatedCluster, LinkSpec, install_signal_handlers
    from bench._runs import host_rank_env, wait_all

    install_signal_handlers()
    with EmulatedCluster(2, LinkSpec(rate_mbit=rate, latency_ms=0.0)) as cluster:
        procs = [cluster.spawn(r, [sys.executable, "-m", "bench.collective_floor", "--worker", *argv],
                               host_rank_env(cluster, r, port), log_dir / f"rank{r}.log") for r in range(2)]
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
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    load = os.getloadavg()
    passed = ["--compute-ms", str(args.compute_ms), "--sizes", args.sizes, "--repeats", str(args.repeats),
              "--warmup", str(args.warmup), "--timeout-s", str(args.timeout_s), "--out", str(args.out)]
    if args.loopback:
        codes, where = _spawn_loopback(passed, args.port, args.timeout_s), "loopback (127.0.0.1)"
    else:
        codes = _spawn_emulated(passed, args.rate_mbit, args.port, args.timeout_s, args.out)
        where = f"2 emulated hosts at {args.rate_mbit:g} Mbit/s"
    if any(c != 0 for c in codes):
        print(f"[floor] a rank failed: {codes}", file=sys.stderr)
        return 1
    rows = json.loads((args.out / "floor.json").read_text())
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


if __name__ == "__main__":
    raise SystemExit(main())
