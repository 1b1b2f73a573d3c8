"""``easgd-report DIR``: a comparison table and plots from every summary.json under DIR.

Writes ``DIR/report.md`` (one row per run) and PNG plots: validation accuracy vs wall
time, accuracy vs bytes sent, communication share per run. Works on a sweep directory,
a single run directory, and on runs that failed (marked as failed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from easgd_lightning.utils.atomic import atomic_write_text

__all__ = ["collect", "rows", "markdown_table", "write_report", "main"]

COLUMNS = [
    ("run", "run"),
    ("status", "status"),
    ("strategy", "strategy"),
    ("compression", "compression"),
    ("world", "world_size"),
    ("val acc", "val_acc"),
    ("train loss", "train_loss"),
    ("wall s", "wall_time_s"),
    ("samples/s", "samples_per_s"),
    ("MB sent/rank", "mb_sent"),
    ("compression x", "ratio"),
    ("comm share", "comm_share"),
]


def collect(root: str | Path) -> list[tuple[Path, dict]]:
    """Every (run dir, summary) under ``root``, sorted by path."""
    root = Path(root)
    found = []
    for path in sorted(root.rglob("summary.json")):
        try:
            found.append((path.parent, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as err:
            found.append((path.parent, {"status": "failed", "error": f"unreadable summary: {err}"}))
    return found


def _mean(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def rows(runs: list[tuple[Path, dict]], root: Path) -> list[dict[str, Any]]:
    """One flat row per run."""
    out = []
    for run_dir, s in runs:
        comm = s.get("comm") or {}
        sent = _mean(comm.get("bytes_sent") or [])
        dense = _mean(comm.get("dense_bytes") or [])
        try:
            name = str(run_dir.relative_to(root)) or run_dir.name
        except ValueError:
            name = run_dir.name
        out.append(
            {
                "run": name if name != "." else run_dir.name,
                "status": s.get("status", "unknown"),
                "strategy": s.get("strategy"),
                "compression": s.get("compression"),
                "world_size": s.get("world_size"),
                "val_acc": s.get("val_acc"),
                "train_loss": s.get("train_loss"),
                "wall_time_s": s.get("wall_time_s"),
                "samples_per_s": s.get("samples_per_s"),
                "mb_sent": sent / 1e6 if sent is not None else None,
                "ratio": (dense / sent) if sent and dense else None,
                "comm_share": comm.get("time_fraction"),
                "val_history": s.get("val_history") or [],
                "bytes_sent_total": sum(comm.get("bytes_sent") or [0]),
                "error": s.get("error"),
            }
        )
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}" if abs(value) < 1 else f"{value:.3f}"
    return str(value)


def markdown_table(table: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(h for h, _ in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    lines = [head, sep]
    for r in table:
        lines.append("| " + " | ".join(_fmt(r.get(k)) for _, k in COLUMNS) + " |")
    return "\n".join(lines)


def _label(r: dict) -> str:
    return f"{r['strategy']}/{r['compression']}" if r.get("strategy") else r["run"]


def _plots(table: list[dict[str, Any]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    ok = [r for r in table if r["status"] == "ok"]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in ok:
        hist = [h for h in r["val_history"] if h.get("val_acc") is not None]
        if hist:
            ax.plot([h["time_s"] for h in hist], [h["val_acc"] for h in hist], marker="o", ms=3, label=_label(r))
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("validation accuracy (center / averaged model)")
    ax.set_title("Validation accuracy vs wall time")
    ax.grid(alpha=0.3)
    if ok:
        ax.legend(fontsize=8)
    path = out / "val_acc_vs_time.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in ok:
        if r["val_acc"] is not None:
            ax.scatter([max(r["bytes_sent_total"], 1)], [r["val_acc"]], label=_label(r))
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent, all ranks (log)")
    ax.set_ylabel("final validation accuracy")
    ax.set_title("Accuracy vs bytes sent")
    ax.grid(alpha=0.3)
    if ok:
        ax.legend(fontsize=8)
    path = out / "acc_vs_bytes.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [_label(r) for r in ok]
    ax.bar(range(len(ok)), [r["comm_share"] or 0.0 for r in ok])
    ax.set_xticks(range(len(ok)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("communication share of wall time")
    ax.set_title("Communication share per run")
    ax.grid(alpha=0.3, axis="y")
    path = out / "comm_share.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def write_report(root: str | Path, out: str | Path | None = None) -> tuple[Path, list[dict]]:
    """Write report.md and the plots; returns (report path, rows)."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist")
    out = Path(out) if out else root
    out.mkdir(parents=True, exist_ok=True)
    table = rows(collect(root), root)
    pngs = _plots(table, out)
    failed = [r for r in table if r["status"] != "ok"]
    text = [f"# Run report: {root}", "", markdown_table(table), ""]
    if failed:
        text += ["## Failed runs", ""] + [f"- {r['run']}: {r['error']}" for r in failed] + [""]
    text += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs] + [""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(text))
    return path, table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="easgd-report", description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="a run or sweep directory containing summary.json files")
    parser.add_argument("--out", default=None, help="where to write report.md and PNGs (default: DIR)")
    args = parser.parse_args(argv)
    try:
        path, table = write_report(args.dir, args.out)
    except FileNotFoundError as err:
        print(f"easgd-report: error: {err}", file=sys.stderr)
        return 2
    if not table:
        print(f"easgd-report: no summary.json under {args.dir}", file=sys.stderr)
        return 1
    print(markdown_table(table))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
