"""``easgd-report DIR``: a comparison table and plots from every summary.json under DIR.

Writes ``DIR/report.md`` (one row per run), ``DIR/report.csv`` (the same rows, raw
numbers) and PNG plots: validation accuracy vs wall time, accuracy vs bytes sent,
communication share per run. The communication share is the *exposed* fraction of wall
time (``comm.exposed_fraction``: the time the training loop waited on communication;
overlapped communication is not counted), falling back to ``comm.time_fraction`` for
summaries written before it existed. When DIR holds a ``costmodel.json`` written by
``python -m bench.costmodel`` (the fitted alpha-beta cost model), the report adds its
weak-scaling projection: a table of parallel efficiency at 64 / 512 / 4096 workers per
strategy and layout, and the plot ``costmodel_projection.png`` (model projections, not
measurements; SC17's 91.5% marked). Works on a sweep directory, a single run directory, and on
runs that failed (marked as failed, with the reason; a job that died before writing its
summary.json is found by its Hydra ``.hydra/`` or ``ranks/`` directory).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from easgd_lightning.utils.atomic import atomic_write_text

__all__ = [
    "collect",
    "rows",
    "markdown_table",
    "plot_projection",
    "projection_markdown",
    "write_report",
    "main",
]

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


def _rank_errors(run_dir: Path) -> dict[str, str]:
    """Errors recorded in ``ranks/rank<R>.json`` by ranks that failed."""
    errors: dict[str, str] = {}
    for path in sorted((run_dir / "ranks").glob("rank*.json")):
        try:
            rep = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if rep.get("status") != "ok":
            errors[path.stem.removeprefix("rank")] = str(rep.get("error"))
    return errors


def _without_summary(run_dir: Path) -> dict:
    """A failed placeholder for a job directory that never got a summary.json."""
    summary: dict[str, Any] = {
        "status": "failed",
        "error": "no summary.json: the job stopped before writing it",
        "rank_errors": _rank_errors(run_dir),
    }
    overrides = run_dir / ".hydra" / "overrides.yaml"
    config = run_dir / ".hydra" / "config.yaml"
    try:
        import yaml

        if config.is_file():
            cfg = yaml.safe_load(config.read_text()) or {}
            summary["strategy"] = (cfg.get("strategy") or {}).get("name")
            summary["compression"] = (cfg.get("compression") or {}).get("name")
        if overrides.is_file():
            summary["overrides"] = list(yaml.safe_load(overrides.read_text()) or [])
    except Exception:  # noqa: BLE001 - a broken job dir is still reported as failed
        pass
    return summary


def collect(root: str | Path) -> list[tuple[Path, dict]]:
    """Every (run dir, summary) under ``root``, sorted by path.

    A run directory is one with a ``summary.json``; a Hydra job directory (``.hydra/``) or
    a directory with rank reports (``ranks/``) but no summary is a run that died before
    writing one, and is returned as failed, with the errors its ranks recorded.
    """
    root = Path(root)
    found: dict[Path, dict] = {}
    for path in sorted(root.rglob("summary.json")):
        try:
            found[path.parent] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            found[path.parent] = {"status": "failed", "error": f"unreadable summary: {err}"}
    for marker in [*root.rglob(".hydra"), *root.rglob("ranks")]:
        run_dir = marker.parent
        if marker.is_dir() and run_dir not in found:
            found[run_dir] = _without_summary(run_dir)
    return sorted(found.items(), key=lambda item: str(item[0]))


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
                "comm_share": comm.get("exposed_fraction", comm.get("time_fraction")),
                "val_history": s.get("val_history") or [],
                "bytes_sent_total": sum(comm.get("bytes_sent") or [0]),
                "error": _failure_reason(s),
            }
        )
    return out


def _failure_reason(s: dict) -> str | None:
    """The run's error, with the first failing rank's own error when there is one."""
    error = s.get("error")
    rank_errors = s.get("rank_errors") or {}
    if rank_errors:
        rank, message = next(iter(sorted(rank_errors.items())))
        detail = f"rank {rank}: {message}"
        error = f"{error} ({detail})" if error else detail
    if s.get("status", "ok") != "ok" and not error:
        error = "failed (no error recorded)"
    return error


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


def _finish_figure(plt, fig, ax, path: Path, *, xlabel: str, ylabel: str, title: str, legend: bool) -> Path:
    """Label, save and close one figure."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:  # no legend for a plot without labelled lines
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


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
    written.append(_finish_figure(
        plt, fig, ax, out / "val_acc_vs_time.png", xlabel="wall time (s)",
        ylabel="validation accuracy (center / averaged model)",
        title="Validation accuracy vs wall time", legend=bool(ok),
    ))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in ok:
        if r["val_acc"] is not None:
            ax.scatter([max(r["bytes_sent_total"], 1)], [r["val_acc"]], label=_label(r))
    ax.set_xscale("log")
    written.append(_finish_figure(
        plt, fig, ax, out / "acc_vs_bytes.png", xlabel="bytes sent, all ranks (log)",
        ylabel="final validation accuracy", title="Accuracy vs bytes sent", legend=bool(ok),
    ))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = [_label(r) for r in ok]
    ax.bar(range(len(ok)), [r["comm_share"] or 0.0 for r in ok])
    ax.set_xticks(range(len(ok)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("exposed communication share of wall time")
    ax.set_title("Communication share per run (time waited on communication)")
    ax.grid(alpha=0.3, axis="y")
    path = out / "comm_share.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


def projection_markdown(projection: dict) -> str:
    """The cost model's weak-scaling projection (``costmodel.json``'s ``projection``) as
    markdown: one table per layout, parallel efficiency at 64 / 512 / 4096 workers."""
    lines = ["## Weak-scaling projection (cost model)", "", f"**{projection['note']}**", ""]
    sc17 = projection.get("sc17") or {}
    if sc17:
        lines += [f"Reference (marked on the plot): {sc17['what']}.", ""]
    for layout, table in projection["table"].items():
        cols = sorted({int(p) for row in table.values() for p in row})
        lines += [
            f"### {layout}: {projection['layouts'].get(layout, '')}",
            "",
            "| strategy | " + " | ".join(f"E({p})" for p in cols) + " |",
            "|---|" + "---:|" * len(cols),
        ]
        for label, effs in table.items():
            cells = [f"{100 * effs[str(p)]:.1f}%" if str(p) in effs else "-" for p in cols]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_projection(projection: dict, path: Path) -> Path:
    """One panel per layout, one efficiency curve per strategy, SC17's point marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(projection["curves"])
    fig, axes = plt.subplots(1, len(layouts), figsize=(6.5 * len(layouts), 5), squeeze=False)
    sc17 = projection.get("sc17") or {}
    for ax, layout in zip(axes[0], layouts):
        for label, effs in projection["curves"][layout].items():
            ax.plot(projection["workers"], effs, marker="o", ms=3, label=label)
        if sc17 and layout == "knl":
            ax.scatter([sc17["workers"]], [sc17["efficiency"]], marker="*", s=180, c="k", zorder=5,
                       label=f"SC17 measured: Sync EASGD {100 * sc17['efficiency']:.1f}% "
                       f"on {sc17['workers']} KNL cores")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("workers (weak scaling)")
        ax.set_ylabel("parallel efficiency t_compute / t_step")
        ax.set_title(f"{layout}: model projection, not measured", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(projection["note"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _costmodel(root: Path, out: Path) -> list[str]:
    """The projection section when ``root`` holds a ``costmodel.json`` (``python -m bench.costmodel``)."""
    found = sorted(root.rglob("costmodel.json"))
    if not found:
        return []
    try:
        projection = json.loads(found[0].read_text())["projection"]
        png = plot_projection(projection, out / "costmodel_projection.png")
    except (OSError, KeyError, ValueError, TypeError) as err:
        return ["## Weak-scaling projection (cost model)", "", f"not added: {found[0]}: {err}", ""]
    return [projection_markdown(projection), f"![{png.stem}]({png.name})", ""]


def _trial_label(summary: dict) -> str:
    """``compression knob=value tau=T`` of a search trial, from its resolved config."""
    from easgd_lightning.cli.search import knob

    cfg = summary.get("config") or {}
    comp, strategy = cfg.get("compression") or {}, cfg.get("strategy") or {}
    name = comp.get("name", summary.get("compression"))
    parts = [str(name)]
    key = knob(name)
    if key is not None and comp.get(key) is not None:
        value = comp[key]
        parts.append(f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}")
    if strategy.get("tau") is not None:
        parts.append(f"tau={strategy['tau']}")
    return " ".join(parts)


def plot_pareto(points: list[tuple[float, float]], labels: list[str], front: list[int], chosen: int | None,
                path: Path, budget: float | None) -> Path:
    """val_acc against bytes sent per worker for every trial, the Pareto front joined, the
    chosen trial starred and the budget drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([max(p[1], 1) for p in points], [p[0] for p in points], color="0.6", label="trials")
    ax.plot([max(points[i][1], 1) for i in front], [points[i][0] for i in front], "o-", color="tab:red",
            label="Pareto front")
    for i in front:
        ax.annotate(labels[i], (max(points[i][1], 1), points[i][0]), fontsize=7, xytext=(4, -10),
                    textcoords="offset points")
    if chosen is not None:
        ax.scatter([max(points[chosen][1], 1)], [points[chosen][0]], marker="*", s=220, color="tab:green",
                   zorder=5, label=f"chosen: {labels[chosen]}")
    if budget is not None:
        ax.axvline(budget, color="tab:blue", ls="--", lw=1, label="bytes budget")
    ax.set_xscale("log")
    return _finish_figure(plt, fig, ax, path, xlabel="bytes sent per worker (log)",
                          ylabel="final validation accuracy", title="Compression search: accuracy vs bytes",
                          legend=True)


def _search(root: Path, runs: list[tuple[Path, dict]], out: Path) -> list[str]:
    """The search section when ``root`` is an Optuna sweep (``optimization_results.yaml``):
    the Pareto front of val_acc vs bytes sent per worker, the chosen trial, the plot."""
    from easgd_lightning.cli.search import bytes_per_worker, chosen_run, pareto_front

    if not (root / "optimization_results.yaml").is_file():
        return []
    done = [(d, s) for d, s in runs if s.get("status") == "ok" and s.get("val_acc") is not None
            and bytes_per_worker(s) is not None]
    if not done:
        return ["## Compression search", "", "no trial finished", ""]
    points = [(float(s["val_acc"]), float(bytes_per_worker(s))) for _, s in done]
    labels = [_trial_label(s) for _, s in done]
    budget = ((done[0][1].get("config") or {}).get("search") or {}).get("bytes_budget")
    front, chosen = pareto_front(points), chosen_run(points, budget)
    png = plot_pareto(points, labels, front, chosen, out / "pareto.png", budget)
    lines = ["## Compression search (Optuna)", "",
             f"{len(done)} trials finished; Pareto front of val_acc vs bytes sent per worker"
             + (f" (budget {budget:,.0f} bytes)" if budget is not None else "") + ":", "",
             "| trial | val_acc | bytes / worker | chosen |", "|---|---:|---:|---|"]
    for i in front:
        lines.append(f"| {labels[i]} | {points[i][0]:.4f} | {points[i][1]:,.0f} | {'yes' if i == chosen else ''} |")
    if chosen is not None and chosen not in front:  # cannot happen: the best within a budget is on the front
        lines.append(f"| {labels[chosen]} | {points[chosen][0]:.4f} | {points[chosen][1]:,.0f} | yes |")
    if chosen is None:
        lines += ["", "no trial fits the bytes budget"]
    return lines + ["", f"![{png.stem}]({png.name})", ""]


def write_report(root: str | Path, out: str | Path | None = None) -> tuple[Path, list[dict]]:
    """Write report.md and the plots; returns (report path, rows)."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist")
    out = Path(out) if out else root
    out.mkdir(parents=True, exist_ok=True)
    runs = collect(root)
    table = rows(runs, root)
    pngs = _plots(table, out)
    failed = [r for r in table if r["status"] != "ok"]
    text = [f"# Run report: {root}", "", markdown_table(table), ""]
    if failed:
        text += ["## Failed runs", ""] + [f"- {r['run']}: {r['error']}" for r in failed] + [""]
    text += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in pngs] + [""]
    text += _costmodel(root, out)
    text += _search(root, runs, out)
    path = out / "report.md"
    atomic_write_text(path, "\n".join(text))
    atomic_write_text(out / "report.csv", _csv(table))
    return path, table


def _csv(table: list[dict[str, Any]]) -> str:
    """The table as CSV (raw numbers, one row per run), for further analysis."""
    import csv
    import io

    keys = [k for _, k in COLUMNS] + ["bytes_sent_total", "error"]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in table:
        writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in keys})
    return buf.getvalue()


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
