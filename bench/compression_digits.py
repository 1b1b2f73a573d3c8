"""Digits + ``ddp``, 2 workers: one real ``easgd-train`` run per compressor, tabulated.

Per compressor: validation accuracy, compression ratio (data-parallel dense bytes / bytes
sent, from summary.json), the codec's share of the step time (compress + decompress time
inside the hook, without the wire, over wall time) and communication's share of wall time:
``comm.exposed_fraction`` (the time the training loop waited on communication; overlapped
transfers do not count, so it stays under 100%), or ``comm.time_fraction`` (all
communication time) where a summary has no exposed figure; the table header says which.
Every run has the same seed, data, epochs and batch size; the model is the default MLP
(9610 parameters), so every tensor is compressed (``compression.min_numel=0``). DGC runs
with the default ``optim.momentum=0.9``: it owns the momentum and sets the optimizer's to 0
with a warning, so the row is the default command plus a short warm-up (20 steps).

Beside one row per compressor, ``VARIANTS`` adds rows of the same workload under other
settings: the new schemes at the densities digits can show (sparse_gc at 0.1% and 1%, sgc at the
similarity digits gradients reach) and Adam with one-way and two-way top-k
(``compression.two_way``, Zhong et al. 2021) beside dense Adam, on the ring (``ddp``) and
through the asynchronous parameter server (``async_sgd``, 2 workers + the server rank; its
ratio: rank 0's dense push + reply bytes over its compressed ones; its codec share is not
measured and shows 0).

Usage::

    .venv/bin/python -m bench.compression_digits                 # all compressors
    .venv/bin/python -m bench.compression_digits --names none,dgc --epochs 5
    .venv/bin/python -m bench.compression_digits --epochs 5 --batch-size 32 --variants
    .venv/bin/python -m bench.compression_digits --names none --adam-ratios 0.001,0.0001

Writes bench/results/compression_digits.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench._scenarios import REPO
from bench._tables import comm_share_of
from easgd_lightning.hooks.compressors import compressor_names

EXTRA = {
    # DGC's momentum correction replaces the optimizer's momentum: it sets optim.momentum to
    # 0 itself (with a warning), so the default command needs no override for it
    "dgc": ["compression.warmup_ratio_steps=20"],
    # random-k with residuals and heavy-ball momentum 0.9 diverges here (val acc 0.10):
    # a coordinate is sent once per ~100 steps with its whole residual, and momentum
    # amplifies that jump ten-fold
    "randomk": ["optim.momentum=0"],
}

ADAM = ["optim.optimizer=adamw", "optim.lr=0.003"]
#: label -> (compression name, overrides): extra rows of the same workload
VARIANTS = {
    "sparse_gc@0.001": ("sparse_gc", ["compression.ratio=0.001"]),
    "sparse_gc@0.01": ("sparse_gc", ["compression.ratio=0.01"]),
    "sgc@0.75": ("sgc", ["compression.threshold=0.75"]),
    "none+adam": ("none", ADAM),
    "topk@0.01+adam one-way": ("topk", ["compression.ratio=0.01", *ADAM]),
    "topk@0.01+adam two-way": ("topk", ["compression.ratio=0.01", "compression.two_way=true", *ADAM]),
    "signsgd+adam one-way": ("signsgd", ADAM),
    "signsgd+adam two-way": ("signsgd", ["compression.two_way=true", *ADAM]),
}
#: the asynchronous parameter server (``strategy=async_sgd``: 2 workers + the server rank,
#: which steps AdamW), dense, one-way and two-way (the server keeps the second residual)
PS = ["strategy=async_sgd", "trainer.devices=3"]
VARIANTS.update({
    "async_sgd none+adam": ("none", [*PS, *ADAM]),
    "async_sgd topk@0.01+adam one-way": ("topk", [*PS, "compression.ratio=0.01", *ADAM]),
    "async_sgd topk@0.01+adam two-way": ("topk", [*PS, "compression.ratio=0.01", "compression.two_way=true", *ADAM]),
})


def run_one(label: str, out: Path, args: argparse.Namespace) -> dict:
    name, variant = VARIANTS.get(label, (label, []))
    run_dir = out / "runs" / label.replace(" ", "_").replace("@", "_").replace("+", "_")
    base = {"strategy": "ddp", "trainer.devices": "2"}
    for item in variant:  # a variant may name another strategy / world size
        key, _, value = item.partition("=")
        if key in base:
            base[key] = value
    variant = [v for v in variant if v.partition("=")[0] not in base]
    cmd = [
        sys.executable, "-m", "easgd_lightning.cli.train",
        f"hydra.run.dir={run_dir}", "logger=csv", "trainer.enable_progress_bar=false",
        f"strategy={base['strategy']}", f"compression={name}", f"trainer.devices={base['trainer.devices']}",
        f"seed={args.seed}", f"data.batch_size={args.batch_size}", f"trainer.max_epochs={args.epochs}",
        "checkpoint.enabled=false",
    ]
    if name != "none":
        cmd.append("compression.min_numel=0")
    cmd += EXTRA.get(name, []) + variant
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONPATH=str(REPO))
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not (run_dir / "summary.json").exists():
        return {"compressor": label, "status": "failed", "error": proc.stderr[-2000:]}
    s = json.loads((run_dir / "summary.json").read_text())
    dp = s["comm"]["by_kind"].get("data_parallel", {})
    extras0 = (s.get("extras") or [{}])[0]
    stats = extras0.get("compression_stats", {})
    wall = s["wall_time_s"] or float("nan")
    ratio = dp.get("dense_bytes", 0) / max(1, dp.get("bytes_sent", 1))
    comm_share, comm_source = comm_share_of(s)
    if base["strategy"] != "ddp":  # parameter server: rank 0's pushes and replies vs dense ones
        push = extras0.get("compressed_pushes")
        ratio = 1.0 if push is None else (
            2 * push["pushes"] * push["dense_bytes_per_direction"] / max(1, push["bytes_up"] + push["bytes_down"]))
    return {
        "compressor": label,
        "status": s["status"],
        "val_acc": s["val_acc"],
        "ratio": ratio,
        "codec_share": stats.get("codec_time_s", 0.0) / wall,
        "comm_share": comm_share,
        # "exposed" (comm.exposed_fraction) or "total" (comm.time_fraction, overlapped time too)
        "comm_share_source": comm_source,
        "wall_time_s": wall,
        "steps": s["steps_per_rank"][0],
        # lgc: the share of exchanges in its learned phase (codes), the rest top-k
        "learned_fraction": stats.get("lgc_learned_fraction"),
        "command": " ".join(cmd[1:]),
        "extra": " ".join(EXTRA.get(name, []) + variant),
        "elapsed_s": time.perf_counter() - start,
    }


def comm_share_header(rows: list[dict]) -> tuple[str, str]:
    """(the comm-share column's header, its legend), from the sources the rows' summaries had:
    ``exposed`` (comm.exposed_fraction) or ``total`` (comm.time_fraction); rows marked * in a
    mixed table are total."""
    sources = {r.get("comm_share_source") for r in rows if r.get("status") == "ok"}
    if sources <= {"exposed"}:
        return "comm share (exposed)", "comm share = time the training loop waited on communication / wall time (comm.exposed_fraction)"
    if sources == {"total"}:
        return "comm share (total)", "comm share = all time in communication, overlapped or not / wall time (comm.time_fraction; these summaries have no exposed figure)"
    return "comm share (exposed; * total)", (
        "comm share = time the training loop waited on communication / wall time "
        "(comm.exposed_fraction); * rows: all communication time (comm.time_fraction), their summaries have no exposed figure"
    )


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    header, legend = comm_share_header(rows)
    mixed = "*" in header
    lines = [
        "# Compressors on digits, strategy=ddp, 2 workers (CPU, gloo)",
        "",
        f"seed {args.seed}, batch {args.batch_size} per worker, {args.epochs} epochs; "
        "ratio = data-parallel dense bytes / bytes sent; codec share = compress + decompress "
        f"time in the hook / wall time; {legend}.",
        "",
        f"| compressor | val acc | ratio | codec share | {header} | wall s | extra overrides |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['compressor']} | failed | | | | | |")
            continue
        mark = "*" if mixed and r.get("comm_share_source") == "total" else ""
        share = "" if r["comm_share"] is None else f"{100 * r['comm_share']:.1f}%{mark}"
        lines.append(
            f"| {r['compressor']} | {r['val_acc']:.4f} | {r['ratio']:.1f} | "
            f"{100 * r['codec_share']:.1f}% | {share} | "
            f"{r['wall_time_s']:.1f} | {r.get('extra', '')} |"
        )
    ok = [r for r in rows if "command" in r]
    lines += ["", "Command per row (with compression=NAME): `python " + (ok[0]["command"] if ok else "") + "`", ""]
    for r in rows:
        if r.get("learned_fraction") is not None:
            lines.append(f"{r['compressor']}: {100 * r['learned_fraction']:.1f}% of the exchanges in the learned phase (codes).")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--names", default=None, help="comma-separated compressors (default: all)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--variants", action="store_true", help="add the VARIANTS rows")
    p.add_argument("--adam-ratios", default="",
                   help="comma-separated top-k ratios: add AdamW one-way and two-way rows at each (ddp)")
    args = p.parse_args(argv)
    for r in filter(None, args.adam_ratios.split(",")):
        for way, extra in (("one-way", []), ("two-way", ["compression.two_way=true"])):
            VARIANTS[f"topk@{r}+adam {way}"] = ("topk", [f"compression.ratio={r}", *extra, *ADAM])
    # optimus_cc is the pipeline (3D) compressor: see bench/nlp3d_optimus.py
    names = args.names.split(",") if args.names else [n for n in compressor_names() if n != "optimus_cc"]
    if args.variants:
        names += list(VARIANTS)
    elif args.adam_ratios:
        names += [k for k in VARIANTS if k.startswith("topk@") and k.split("@")[1].split("+")[0]
                  in args.adam_ratios.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in names:
        row = run_one(name, args.out, args)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("command", "error")}), flush=True)
        (args.out / "compression_digits.json").write_text(json.dumps(rows, indent=2))
    md = markdown(rows, args)
    (args.out / "compression_digits.md").write_text(md)
    print(md)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
