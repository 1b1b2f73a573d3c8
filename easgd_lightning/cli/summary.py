"""Merge per-rank reports into ``summary.json`` (DESIGN.md section 4.2); read the rank
reports (``ranks/rank<R>.json``) of a run directory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from easgd_lightning.utils.atomic import atomic_write_json

__all__ = ["build_summary", "write_summary", "SWEEP_JOBS", "rank_file", "current_run_id", "report_run_id",
           "read_rank_reports"]

#: Output directories of this process's multirun jobs (the local sweep's own, or those a
#: launcher plugin such as hydra/launcher=slurm submitted); easgd-train checks their
#: summaries after the sweep. Here, not in cli/train.py, so that ``python -m
#: easgd_lightning.cli.train`` (module ``__main__``) and the plugin share one list.
SWEEP_JOBS: list[Path] = []


def _sum_kinds(reports: list[dict]) -> dict:
    kinds: dict[str, dict[str, Any]] = {}
    for rep in reports:
        for kind, tot in rep["comm"].get("by_kind", {}).items():
            acc = kinds.setdefault(
                kind, {"bytes_sent": 0, "bytes_recv": 0, "dense_bytes": 0, "time_s": 0.0, "exposed_s": 0.0, "calls": 0}
            )
            for key in acc:
                acc[key] += tot.get(key, 0)
    return kinds


def build_summary(
    cfg: dict,
    reports: list[dict | None],
    *,
    status: str = "ok",
    error: str | None = None,
    lost: list[int] | tuple = (),
) -> dict:
    """A summary dict from the rank reports (missing or failed ranks are recorded as such;
    ``lost``: ranks the run went on without, whose missing report does not fail it, role
    ``lost``)."""
    world = len(reports)
    ok = [r for r in reports if r and r.get("status") == "ok"]
    failed_ranks = [i for i, r in enumerate(reports) if not r or r.get("status") != "ok"]
    unexcused = [i for i in failed_ranks if i not in lost]

    wall = max((r["wall_time_s"] for r in ok), default=0.0)
    train_times = [r["train_time_s"] for r in ok if r.get("train_time_s") is not None]
    samples = sum(r.get("samples", 0) for r in ok)
    # a failed or stopped rank reports what it measured in its finished epochs (cli/worker.py)
    steps = [(r.get("steps") if r else None) for r in reports]
    first = next((r for r in ok if r.get("val_acc") is not None), ok[0] if ok else None)
    first = first or next((r for r in reports if r and r.get("val_history")), None)
    strategy = cfg.get("strategy", {}).get("name")
    compression = cfg.get("compression", {}).get("name")
    return {
        "status": status if not unexcused or status != "ok" else "failed",
        "error": error,
        "strategy": strategy,
        "compression": compression,
        "world_size": world,
        "roles": [(r.get("role", "worker") if r and r.get("status") == "ok" else "lost" if i in lost else "failed")
                  for i, r in enumerate(reports)],
        "trained_ranks": [i for i, r in enumerate(reports) if r and r.get("status") == "ok" and r.get("role", "worker") == "worker"],
        "failed_ranks": failed_ranks,
        "steps_per_rank": steps,
        "train_loss": _train_loss(ok),
        "val_loss": first.get("val_loss") if first else None,
        "val_acc": first.get("val_acc") if first else None,
        "wall_time_s": wall,
        # the slowest rank's training clock (callbacks.TrainClockCallback): its batches,
        # without set-up and validation passes; None when no rank ran a training batch
        "train_time_s": max(train_times) if train_times else None,
        "train_time_s_per_rank": [(r.get("train_time_s") if r and r.get("status") == "ok" else None) for r in reports],
        # each rank's CPU over its training, validation left out (callbacks.TrainClockCallback):
        # its process's and its machine's (every core, every process: /proc/stat), for the
        # bench's CPU figures
        "train_cpu_per_rank": [(r.get("train_cpu") if r and r.get("status") == "ok" else None) for r in reports],
        "samples_per_s": samples / wall if wall > 0 else 0.0,
        "comm": _comm(reports, ok, steps),
        "val_history": first.get("val_history", []) if first else [],
        "extras": [(r.get("extras", {}) if r else {}) for r in reports],
        "rank_errors": {str(i): r.get("error") for i, r in enumerate(reports) if r and r.get("status") != "ok"},
        "config": cfg,
    }


def _train_loss(ok: list[dict]) -> float | None:
    """The mean per-sample training loss over the ranks that finished (their shards' sums);
    for models the CLI cannot re-evaluate (pipeline), the mean of the strategy's own figure."""
    loss_n = sum(r.get("train_loss_count", 0) for r in ok)
    if loss_n:
        return sum(r.get("train_loss_sum", 0.0) for r in ok) / loss_n
    finals = [r.get("extras", {}).get("final_train_loss") for r in ok]
    finals = [f for f in finals if f is not None]
    return sum(finals) / len(finals) if finals else None


def _comm(reports: list[dict | None], ok: list[dict], steps: list) -> dict:
    """``summary["comm"]``: per-rank traffic (0 / None for a rank that did not finish), the
    mean communication time fractions, messages per step, totals per traffic kind."""
    def per_rank(key: str, default: Any = 0) -> list:
        return [(r["comm"].get(key, default) if r and r.get("status") == "ok" else default) for r in reports]

    fractions = [r["comm"]["time_s"] / r["wall_time_s"] for r in ok if r["wall_time_s"] > 0]
    exposed_fractions = [
        r["comm"].get("exposed_s", r["comm"]["time_s"]) / r["wall_time_s"] for r in ok if r["wall_time_s"] > 0
    ]
    messages = per_rank("messages", None)
    return {
        "bytes_sent": per_rank("bytes_sent"),
        "bytes_recv": per_rank("bytes_recv"),
        "dense_bytes": per_rank("dense_bytes"),
        "time_s": per_rank("time_s", 0.0),
        "time_fraction": sum(fractions) / len(fractions) if fractions else 0.0,
        "exposed_time_s": per_rank("exposed_s", 0.0),
        "exposed_fraction": (
            sum(exposed_fractions) / len(exposed_fractions) if exposed_fractions else 0.0
        ),
        # messages (collectives / point-to-point operations) of the payload kinds, and
        # per optimizer step (comm/meter.py: a lazy all-reduce bucket is one message)
        "messages": messages,
        "messages_per_step": [
            (m / s if m is not None and s else None) for m, s in zip(messages, steps)
        ],
        "by_kind": _sum_kinds(ok),
        "by_kind_per_rank": [(r["comm"].get("by_kind", {}) if r and r.get("status") == "ok" else {}) for r in reports],
    }


def write_summary(out_dir: str | Path, summary: dict) -> Path:
    path = Path(out_dir) / "summary.json"
    atomic_write_json(path, summary)
    return path


# ---------------------------------------------------------------------------- rank reports
def rank_file(out_dir: str | Path, rank: int) -> Path:
    """The report file of ``rank`` in the run directory ``out_dir`` (``ranks/rank<R>.json``)."""
    return Path(out_dir) / "ranks" / f"rank{rank}.json"


def current_run_id() -> str | None:
    """This run's id: ``EASGD_RUN_ID`` (the local launcher sets it), else torchrun's
    ``TORCHELASTIC_RUN_ID``, else SLURM's job and step ids, else None."""
    for key in ("EASGD_RUN_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(key):
            return os.environ[key]
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '0')}"
    return None


def report_run_id(path: Path) -> str | None:
    """The ``run_id`` a rank report file names (None: unreadable, or none)."""
    try:
        return json.loads(path.read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def read_rank_reports(out_dir: str | Path, world: int, run_id: str | None = None) -> list[dict | None]:
    """The rank reports of ``out_dir``; with ``run_id``, a report of another run counts as missing."""
    reports: list[dict | None] = []
    for r in range(world):
        path = rank_file(out_dir, r)
        try:
            rep = json.loads(path.read_text()) if path.exists() else None
        except (OSError, ValueError):
            rep = None
        if rep is not None and run_id is not None and rep.get("run_id") != run_id:
            rep = None
        reports.append(rep)
    return reports
