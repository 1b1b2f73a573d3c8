"""The cost model's measurement on the emulated cluster (``--measure``, root): the probe at
each rank count, the limit row (compute), the local runs, the codecs, and the held-out
training rows, into ``costmodel_inputs.json``."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench._netem import EmulatedCluster, LinkSpec, check_privileges, install_signal_handlers
from bench._runs import host_rank_env, loadavg, log_tail, run_config, wait_all
from bench._scenarios import WIDE_MLP_WORKLOAD, parse_configs
from bench._tables import steady_figures
from bench.costmodel.codec import (
    count_exchange_messages,
    measure_codecs,
    measure_exchange_codec,
    model_shapes,
)
from bench.costmodel.fit import cpu_share
from bench.costmodel.predict import LOCAL_STRATEGIES, dense_bytes, row_options
from bench.costmodel.terms import rate_bps

__all__ = [
    "DEFAULT_ROWS",
    "PROBE_RATES_MBIT",
    "PROBE_WORKERS",
    "ROWS_RATE_MBIT",
    "ROWS_WORKERS",
    "kernel_matmuls",
    "measure",
    "parse_workers",
    "probe_sizes",
    "row_meter",
    "run_probe",
]


PROBE_WORKERS = (2, 4, 8)


PROBE_RATES_MBIT = (50.0, 200.0, 1000.0)


ROWS_WORKERS = (2, 4)  # one rank per core here, and twice as many ranks as cores


ROWS_RATE_MBIT = 100.0  # not a probe rate: the rows are predicted at a rate the fit never saw


DEFAULT_ROWS = (
    "ddp/none,limit/none,ddp/powersgd,ddp/dgc;compression.warmup_ratio_steps=0;optim.momentum=0,"
    "sync_easgd/none,sync_easgd/topk,easgd_round_robin/none,async_easgd/none"
)


def parse_workers(text: str) -> list[int]:
    """``"2,4"`` -> ``[2, 4]``: rank counts of at least 2, each once, in the given order."""
    out: list[int] = []
    for item in str(text).split(","):
        w = int(item)
        if w < 2:
            raise ValueError(f"--rows-workers: {w} ranks; each needs at least 2")
        if w not in out:
            out.append(w)
    return out


def probe_sizes(rate_mbit: float, top_ms: float = 40.0) -> list[int]:
    """Message sizes for one link rate: 1 kB (fixes alpha), then a quarter of and all of
    ``top_ms`` of the link: at least 5x the token bucket's 2 ms burst, which lets shorter
    messages through faster than the rate."""
    top = int(rate_bps(rate_mbit) * top_ms / 1000.0) // 1024 * 1024
    return [1024, max(2048, top // 4), max(4096, top)]


def run_probe(cluster, out: Path, rates: Sequence[float], port: int, timeout_s: float,
              repeats: int = 3, latency_ms: float = 0.1, top_ms: float = 40.0,
              loops: bool = False, kernel_matmuls: int = 32, between_matmuls: int = 0,
              ps_bytes: int = 0) -> list[dict]:
    """Time every collective on ``cluster`` at each rate (one launch, links reshaped
    between phases); one sample per (op, bytes, rate): the slowest rank's median. With
    ``loops``, also the probe's training-shaped loops (ops ``loop_*``; with ``ps_bytes``
    the busy server's loop at that message too, marked ``"at": "workload"``)."""
    res = out / f"probe_p{cluster.workers}"
    if res.exists():
        shutil.rmtree(res)
    res.mkdir(parents=True)
    sizes = ",".join(":".join(str(s) for s in probe_sizes(r, top_ms)) for r in rates)
    cmd = [sys.executable, "-m", "bench.costmodel.probe", "--phases", ",".join(f"{r:g}" for r in rates),
           "--sizes", sizes, "--repeats", str(repeats), "--out", str(res),
           "--timeout-s", str(timeout_s), "--kernel-matmuls", str(kernel_matmuls),
           "--between-matmuls", str(between_matmuls), "--ps-bytes", str(ps_bytes),
           *(["--loops"] if loops else [])]
    cluster.shape(LinkSpec(rates[0], latency_ms))
    procs = [cluster.spawn(r, cmd, host_rank_env(cluster, r, port), res / f"rank{r}.log")
             for r in range(cluster.workers)]
    deadline = time.monotonic() + timeout_s
    for k, rate in enumerate(rates):
        while not (res / f"phase{k}.ready").exists():
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                cluster.kill_procs()
                raise RuntimeError(f"probe failed:\n{log_tail(res / 'rank0.log')}")
            time.sleep(0.05)
        cluster.shape(LinkSpec(rate, latency_ms))
        (res / f"phase{k}.go").write_text("go")
    codes, timed_out = wait_all(procs, max(1.0, deadline - time.monotonic()))
    cluster.kill_procs()
    if timed_out or any(c != 0 for c in codes):
        raise RuntimeError(f"probe failed (rc={codes}):\n{log_tail(res / 'rank0.log')}")
    ranks = [json.loads((res / f"rank{r}.json").read_text())["records"] for r in range(cluster.workers)]
    samples = []
    for recs in zip(*ranks):
        slowest = [max(ts) for ts in zip(*(r["times_s"] for r in recs))]
        samples.append({"op": recs[0]["op"], "p": cluster.workers, "bytes": recs[0]["bytes"],
                        "rate_mbit": float(recs[0]["phase"]), "time_s": statistics.median(slowest),
                        **({"at": recs[0]["at"]} if "at" in recs[0] else {})})
    return samples


def measure(args: argparse.Namespace) -> dict:
    """The whole measurement, in this order: a limit row (its compute sizes the probe
    loops' kernel), the local runs, the codecs, the probe at each rank count, the rows;
    ``costmodel_inputs.partial.json`` holds what is done after the probe and each row."""
    check_privileges()
    install_signal_handlers()
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / "costmodel_inputs.partial.json"  # what a timed-out batch leaves
    inputs: dict = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["python -m bench.costmodel", *args.argv]),
        "loadavg_before": loadavg(), "cpus": os.cpu_count() or 1,
        "probe": [], "probe_loops": [], "rows": [], "codec": {}, "timings_s": {},
    }
    t0 = time.monotonic()
    configs = parse_configs(args.rows)
    limit_k = next((k for k, c in enumerate(configs) if c.strategy == "limit"), None)
    if limit_k is None:
        raise ValueError("--rows needs the limit row (limit/none): it measures the compute")
    link = LinkSpec(args.rows_rate, args.latency_ms)
    rows_workers = parse_workers(args.rows_workers)
    matmuls, mm_s = _kernel_limit_row(args, configs[limit_k], 60 + limit_k, link, rows_workers, inputs)
    inputs["local_rows"] = _local_rows(args, configs, link, rows_workers, inputs["cpus"])
    inputs["probe_kernel"] = {"matmuls": matmuls, "matmul_s": mm_s,
                              "what": "256x256 float32 products per loop iteration, sized "
                              "to the limit row's compute per step (one worker per core)"}
    print(f"[costmodel] probe kernel: {matmuls} matmuls ({mm_s} s each)", flush=True)
    t2 = time.monotonic()
    shapes = model_shapes(WIDE_MLP_WORKLOAD)
    inputs["model_shapes"] = shapes
    inputs["codec"] = measure_codecs(sorted({c.compression for c in configs}),
                                     sum(math.prod(s) for s in shapes))
    inputs["codec_exchange"] = _codec_exchanges(configs, rows_workers, shapes)
    inputs["timings_s"]["codec"] = time.monotonic() - t2
    inputs["probe_kernel"]["between_matmuls"] = _between_matmuls(inputs["codec_exchange"], mm_s)
    _probe_every_rank_count(args, inputs, shapes)
    inputs["timings_s"]["probe"] = time.monotonic() - t0
    partial.write_text(json.dumps(inputs, indent=2))
    t1 = time.monotonic()
    _training_rows(args, configs, link, rows_workers, inputs, t0, partial)
    inputs["timings_s"]["rows"] = time.monotonic() - t1
    inputs["dense_bytes"] = dense_bytes(inputs)  # float32 parameters of the model
    for row in inputs["rows"]:
        row["bytes_per_exchange"] = _bytes_per_exchange(row, inputs["dense_bytes"])
    inputs["loadavg_after"] = loadavg()
    return inputs


def _kernel_limit_row(args: argparse.Namespace, limit, k: int, link: LinkSpec, rows_workers: list[int],
                      inputs: dict) -> tuple[int, float | None]:
    """The limit row ``limit`` first (``k``: its port offset), on the rows' first rank
    count (``inputs["kernel_limit_row"]``): the probe loops' kernel, (matmuls, seconds of
    one), computes what it computes per step; (32, None) where it failed. The predictions take the limit measured again
    beside the rows (batch K's first one read 7.2 ms per step, twice the 3.4-3.7 ms of
    H-J and of the rows' own compute, right after the lock)."""
    with EmulatedCluster(rows_workers[0], link, subnet=args.subnet, fork_ranks=args.fork_ranks) as cluster:
        limit_row = _run_row(cluster, limit, k, args, rows_workers[0], where="kernel")
    inputs["kernel_limit_row"] = limit_row
    if limit_row["status"] == "ok" and limit_row["step_time_s"]:
        return kernel_matmuls(limit_row["step_time_s"] / cpu_share(rows_workers[0], inputs["cpus"]))
    return 32, None


def _local_rows(args: argparse.Namespace, configs: list, link: LinkSpec, rows_workers: list[int],
                cpus: int) -> list[dict]:
    """The configurations of the all-reduce / all-gather family and the limit on one host
    (loopback, no shaped link), at most one rank per core (:func:`~bench.costmodel.predict.local_cost`;
    more ranks than cores would measure again the waits that the loops' s and the network
    model charge); none with ``--no-local-runs``."""
    runs: list[dict] = []
    if not args.local_runs or not any(c.strategy in LOCAL_STRATEGIES for c in configs):
        return runs
    for j, workers in enumerate(sorted({min(w, cpus) for w in rows_workers})):
        with EmulatedCluster(1, link, subnet=args.subnet, procs_per_host=workers,
                             fork_ranks=args.fork_ranks) as cluster:
            for k, config in enumerate(configs):
                if config.strategy == "limit" or config.strategy in LOCAL_STRATEGIES:
                    runs.append(_run_row(cluster, config, 40 + 10 * j + k, args, workers, where="local"))
    return runs


def _codec_exchanges(configs: list, rows_workers: list[int], shapes: list[tuple]) -> dict[str, dict]:
    """Per compressor of the rows: the codec seconds of one exchange at each world size
    (1 and the rows'), and the messages and bytes of one exchange."""
    out: dict[str, dict] = {}
    for config in configs:
        if config.compression != "none" and config.compression not in out:
            out[config.compression] = {
                "overrides": [o for o in config.overrides if o.startswith("compression.")],
                "seconds_by_world": {
                    str(w): measure_exchange_codec(config.compression, config.overrides, shapes, w)
                    for w in sorted({1, *rows_workers})
                },
                **count_exchange_messages(config.compression, config.overrides, shapes),
            }
    return out


def _between_matmuls(exchanges: dict[str, dict], mm_s: float | None) -> int:
    """The kernel between two blocking rounds of the probe's ``loop_serial_ring_codec``:
    (k - 1)/k of a multi-round exchange's codec at one rank (k its messages), the largest
    over the compressors, in kernel products; 0 without one or without a kernel size."""
    between = 0
    if mm_s:
        for exchange in exchanges.values():
            k_msgs = exchange.get("messages", 1)
            if k_msgs > 1:
                t_between = exchange["seconds_by_world"]["1"] * (k_msgs - 1) / k_msgs
                between = max(between, max(1, round(t_between / mm_s)))
    return between


def _probe_every_rank_count(args: argparse.Namespace, inputs: dict, shapes: list[tuple]) -> None:
    """The probe on a cluster of each ``--probe-workers`` count, at every ``--probe-rates``:
    the collectives into ``inputs["probe"]``, the loops into ``inputs["probe_loops"]``."""
    rates = [float(r) for r in args.probe_rates.split(",")]
    kernel = inputs["probe_kernel"]
    for k, p in enumerate(int(w) for w in args.probe_workers.split(",")):
        with EmulatedCluster(p, LinkSpec(rates[0], args.latency_ms), subnet=args.subnet) as cluster:
            print(f"[costmodel] probe: {p} ranks at {rates} Mbit/s", flush=True)
            samples = run_probe(
                cluster, args.out, rates, args.port + 10 * k, args.timeout_s,
                repeats=args.probe_repeats, latency_ms=args.latency_ms, top_ms=args.probe_top_ms,
                loops=args.probe_loops, kernel_matmuls=kernel["matmuls"],
                between_matmuls=kernel["between_matmuls"],
                ps_bytes=int(4 * sum(math.prod(s) for s in shapes)),
            )
            inputs["probe"] += [s for s in samples if not s["op"].startswith("loop_")]
            inputs["probe_loops"] += [s for s in samples if s["op"].startswith("loop_")]


def _training_rows(args: argparse.Namespace, configs: list, link: LinkSpec, rows_workers: list[int],
                   inputs: dict, t0: float, partial: Path) -> None:
    """Every row at each of its rank counts into ``inputs["rows"]`` (``partial`` rewritten
    after each); skipped: the server strategies below 3 ranks, and with ``--budget-s`` a
    row that would end past the budget (judged by the longest row so far)."""
    longest = 0.0
    for j, workers in enumerate(rows_workers):
        with EmulatedCluster(workers, link, subnet=args.subnet, fork_ranks=args.fork_ranks) as cluster:
            for k, config in enumerate(configs):
                started = time.monotonic()
                if config.strategy.startswith("async_") and workers < 3:
                    inputs["rows"].append(_skipped(config, workers, "a server and two workers need 3 ranks"))
                    continue
                if args.budget_s and started - t0 + longest > args.budget_s:
                    print(f"[costmodel] row {config.label} on {workers} ranks: skipped "
                          f"(--budget-s {args.budget_s:g})", flush=True)
                    inputs["rows"].append(_skipped(config, workers, "budget"))
                    continue
                inputs["rows"].append(_run_row(cluster, config, k + 20 * j, args, workers))
                longest = max(longest, time.monotonic() - started)
                partial.write_text(json.dumps(inputs, indent=2))


def _skipped(config, workers: int, why: str) -> dict:
    """The record of a row that did not run."""
    return {"strategy": config.strategy, "compression": config.compression,
            "overrides": list(config.overrides), "workers": workers, "status": f"skipped ({why})"}


def _run_row(cluster, config, k: int, args: argparse.Namespace, workers: int, where: str = "p") -> dict:
    """One training row of ``workers`` ranks on ``cluster`` (one host per rank, or with
    ``where="local"`` all on one host): its step time and meter, from the median of
    ``--repeats`` runs (on this 2-core VM a lone run's steady step time moved by up to 2x:
    the limit row read 3.3-6.3 ms in four runs back to back); every repeat's is kept."""
    print(f"[costmodel] row {config.label} {' '.join(config.overrides)} on {workers} ranks"
          + (" of one host" if where == "local" else ""), flush=True)
    runs = []
    for r in range(max(1, args.repeats)):
        res = run_config(
            cluster, config, steps=args.limit_steps if config.strategy == "limit" else args.steps,
            warmup_steps=args.warmup_steps, workload=list(WIDE_MLP_WORKLOAD), extra=args.extra.split(),
            out_dir=args.out / "runs" / f"{where}{workers}" / f"repeat{r}",
            port=args.port + 100 + k + 200 * r, timeout_s=args.timeout_s,
        )
        runs.append(res)
        print(f"[costmodel]   {res.status}: step {res.figures.get('step_time_s')}", flush=True)
    timed = sorted((res for res in runs if res.status == "ok" and res.figures.get("step_time_s")),
                   key=lambda res: res.figures["step_time_s"])
    res = timed[(len(timed) - 1) // 2] if timed else runs[-1]  # the median run (lower middle)
    fig = res.figures
    steps = [x.figures["step_time_s"] for x in timed]
    return {
        "strategy": config.strategy, "compression": config.compression,
        "overrides": list(config.overrides), "workers": workers,
        "rate_mbit": args.rows_rate, "status": res.status,
        "step_time_s": fig.get("step_time_s"), "measured": fig.get("measured"),
        "step_time_s_repeats": [x.figures.get("step_time_s") for x in runs],
        "spread": (steps[-1] - steps[0]) / fig["step_time_s"] if len(steps) > 1 else None,
        "bytes_per_step_per_worker": fig.get("bytes_per_step_per_worker"),
        "run_dir": res.run_dir,
        "meter": row_meter(Path(res.run_dir), args.warmup_steps) if res.status == "ok" else None,
    }


def kernel_matmuls(t_compute_1: float, repeats: int = 50) -> tuple[int, float]:
    """Products of two 256 x 256 float32 matrices (the probe loops' kernel, one thread)
    that take ``t_compute_1`` seconds here, and the median seconds of one."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    out = torch.empty(256, 256)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - start)
    mm_s = statistics.median(times[5:])
    return max(1, round(t_compute_1 / mm_s)), mm_s


def _find(tree, key: str) -> float:
    """Sum of every number stored under ``key`` anywhere in ``tree`` (dicts and lists)."""
    if isinstance(tree, dict):
        return sum(_find(v, key) for v in tree.values()) + (
            float(tree[key]) if isinstance(tree.get(key), (int, float)) else 0.0)
    if isinstance(tree, list):
        return sum(_find(v, key) for v in tree)
    return 0.0


def row_meter(run_dir: Path, warmup_steps: int) -> dict | None:
    """:func:`_row_meter`, or None where the summaries lack a figure (diagnosis only)."""
    try:
        return _row_meter(run_dir, warmup_steps)
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
        return None


def _row_meter(run_dir: Path, warmup_steps: int) -> dict | None:
    """What a row's own meter saw per steady-state step, for diagnosis only (never an
    input of a prediction): the difference of the full run and its first ``warmup_steps``
    (``run_dir/first<W>``), per step and mean over the ranks that stepped: time inside
    communication (``comm_s``), of it the time the training loop waited (``exposed_s``),
    the hooks' codec time (``codec_s``, where the strategy reports it), messages per step,
    and the step time minus the exposed communication (``rest_s``: compute, codec and
    every other local cost)."""
    try:
        long = json.loads((Path(run_dir) / "summary.json").read_text())
        short = json.loads((Path(run_dir) / f"first{warmup_steps}" / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    steady = steady_figures(long, short)
    if steady is None:
        return None
    d_steps = [int(a or 0) - int(b or 0) for a, b in zip(long["steps_per_rank"], short["steps_per_rank"])]
    stepping = [i for i, d in enumerate(d_steps) if d > 0]

    def per_step(key: str) -> float:
        a, b = long["comm"].get(key) or [], short["comm"].get(key) or []
        vals = [(float(a[i] or 0) - float(b[i] or 0)) / d_steps[i] for i in stepping if i < min(len(a), len(b))]
        return sum(vals) / len(vals) if vals else 0.0

    codec = [(_find(long["extras"][i], "codec_time_s") - _find(short["extras"][i], "codec_time_s")) / d_steps[i]
             for i in stepping]
    step = steady["step_time_s"]
    exposed = per_step("exposed_time_s")
    return {
        "step_s": step, "comm_s": per_step("time_s"), "exposed_s": exposed,
        "codec_s": sum(codec) / len(codec) if codec else 0.0,
        "messages_per_step": steady.get("messages_per_step"), "rest_s": step - exposed,
        "per_rank_exposed_s": [
            (float(long["comm"]["exposed_time_s"][i] or 0) - float(short["comm"]["exposed_time_s"][i] or 0))
            / d_steps[i] for i in stepping],
    }


def _bytes_per_exchange(row: dict, dense: float) -> float:
    """Payload a rank hands to one exchange: the row's metered bytes per step for a
    compressed row (x tau), the dense message otherwise."""
    if row["compression"] == "none" or not row.get("bytes_per_step_per_worker"):
        return dense
    return row["bytes_per_step_per_worker"] * row_options(row)["tau"]
