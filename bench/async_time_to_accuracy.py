"""Time to a target validation accuracy for the asynchronous family vs the synchronous ones.

Runs the real CLI once per strategy (per repeat) on the digits default (MLP, batch 32 per
worker, SGD lr 0.05 momentum 0.9, ``trainer.max_epochs`` epochs) with ``--workers``
training processes and a straggler (``faults.slow_rank=1 faults.slow_ms=--slow-ms``).
Strategies with a parameter server (``async_*``) get one more process (the server, the
last rank). Reads each ``summary.json``: ``val_history`` holds, per epoch of rank 0 (a
worker), the seconds since the start of fit and the val accuracy of the center.

Prints one markdown row per strategy: steps per rank, the first time the center reached
``--target`` (median over repeats; "never" when most repeats never reached it), that time as a ratio to ``sync_easgd`` measured in the
same invocation and as a ratio to the best dense row (the soonest of ``ddp``, ``ddp/bf16``
and ``ddp/fp16``, 16-bit gradients cast whole by DDP's overlapped hook; the line under the
table names it), the final val accuracy and the bytes sent. A name ``strategy/compression``
runs that compression (``compression.min_numel=0``). Nothing is asserted: it is a
measurement, on whatever machine runs it.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.async_time_to_accuracy
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.async_time_to_accuracy --repeats 3 --slow-ms 50
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.async_time_to_accuracy --strategies async_easgd,sync_easgd
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

__all__ = ["main", "time_to", "summarise"]

DEFAULT = ("async_easgd", "async_measgd", "hogwild_easgd", "async_sgd", "async_msgd",
           "hogwild_sgd", "sync_easgd", "ddp", "ddp/bf16", "ddp/fp16")

#: the dense rows "vs best dense" is taken against (fp32 DDP and its 16-bit casts)
DENSE = ("ddp", "ddp/bf16", "ddp/fp16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default=",".join(DEFAULT), help="comma-separated names")
    p.add_argument("--workers", type=int, default=3, help="training processes (default 3)")
    p.add_argument("--slow-ms", type=float, default=20.0, help="sleep per step on rank 1 (default 20)")
    p.add_argument("--target", type=float, default=0.90, help="val accuracy to reach (default 0.90)")
    p.add_argument("--epochs", type=int, default=10, help="trainer.max_epochs (default 10)")
    p.add_argument("--repeats", type=int, default=1, help="runs per strategy (default 1)")
    p.add_argument("--out", default=None, help="run directories (default: a temporary directory)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    p.add_argument("--table-only", default=None, metavar="JSON",
                   help="print the table of a saved results file instead of running")
    return p.parse_args(argv)


def time_to(history: list[dict], target: float) -> float | None:
    """Seconds since fit start of the first validation with val_acc >= target (None: never)."""
    for entry in history:
        if entry.get("val_acc") is not None and entry["val_acc"] >= target:
            return float(entry["time_s"])
    return None


def run_one(name: str, args: argparse.Namespace, run_dir: Path) -> dict:
    strategy, _, compression = name.partition("/")
    devices = args.workers + 1 if strategy.startswith("async_") else args.workers
    codec = [f"compression={compression}", "compression.min_numel=0"] if compression else []
    cmd = [
        sys.executable, "-m", "easgd_lightning.cli.train", f"strategy={strategy}", *codec,
        f"trainer.devices={devices}", f"trainer.max_epochs={args.epochs}",
        "faults.slow_rank=1", f"faults.slow_ms={args.slow_ms}", "logger=csv",
        "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    summary_path = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.exists():
        return {"strategy": name, "error": (proc.stderr or "")[-500:]}
    s = json.loads(summary_path.read_text())
    return {
        "strategy": name,
        "roles": s["roles"],
        "steps": s["steps_per_rank"],
        "time_to_target": time_to(s["val_history"], args.target),
        "val_acc": s["val_acc"],
        "bytes_sent": sum(b or 0 for b in s["comm"]["bytes_sent"]),
        "history": [(round(h["time_s"], 3), h["val_acc"]) for h in s["val_history"]],
    }


def summarise(results: dict[str, list[dict]], target: float) -> str:
    """The markdown table (median over repeats; ratio to sync_easgd of the same invocation)."""

    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def time_of(runs):  # median time; None when most runs never reached the target
        times = [r["time_to_target"] for r in runs if "error" not in r]
        reached = sum(t is not None for t in times)
        return med(times) if times and reached * 2 > len(times) else None

    base = med([r.get("time_to_target") for r in results.get("sync_easgd", [])])
    dense = {n: time_of(results[n]) for n in DENSE if n in results and time_of(results[n]) is not None}
    best = min(dense, key=dense.get, default=None)
    lines = [
        f"| strategy | processes | steps per rank (last run) | time to {target:.2f} (s) | vs sync_easgd "
        "| vs best dense | final val_acc | MB sent |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            lines.append(f"| {name} | - | failed | - | - | - | - | - |")
            continue
        times = [r["time_to_target"] for r in ok]
        reached = sum(t is not None for t in times)
        # a run that never reached the target counts as slower than any that did
        t = time_of(runs)
        ratio = f"{t / base:.2f}" if t is not None and base else "-"
        vs_dense = f"{t / dense[best]:.2f}" if t is not None and best else "-"
        shown = "never" if t is None else f"{t:.2f}"
        if reached < len(times):
            shown += f" ({reached}/{len(times)} runs reached it)"
        last = ok[-1]
        roles = "+".join(["server"] if "server" in last["roles"] else [])
        procs = f"{len(last['roles'])}" + (f" ({roles})" if roles else "")
        lines.append(
            f"| {name} | {procs} | {last['steps']} | {shown} | {ratio} | {vs_dense} | "
            f"{med([r['val_acc'] for r in ok]):.3f} | {med([r['bytes_sent'] for r in ok]) / 1e6:.1f} |"
        )
    lines.append("")
    lines.append(f"reference: {best} (best dense: the soonest of {', '.join(n for n in DENSE if n in results)})"
                 if best else "reference: none (no dense row reached the target)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table_only:
        print(summarise(json.loads(Path(args.table_only).read_text()), args.target))
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="easgd-async-bench-"))
    results: dict[str, list[dict]] = {}
    for name in args.strategies.split(","):
        for rep in range(args.repeats):
            res = run_one(name, args, out / f"{name}-{rep}")
            results.setdefault(name, []).append(res)
            print(f"{name} #{rep}: {res.get('time_to_target', res.get('error'))}", file=sys.stderr, flush=True)
    table = summarise(results, args.target)
    print(table)
    results_dir = REPO / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / "async_time_to_accuracy.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
