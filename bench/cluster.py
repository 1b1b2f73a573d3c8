"""Emulated cluster on one machine: network namespaces, a bridge and shaped links.

Builds N "hosts" as Linux network namespaces, each with one veth link into a bridge that
lives in its own namespace, shapes every link with ``tc`` (a token bucket at the chosen
rate, plus a ``netem`` delay when the kernel has it), runs one ``easgd-train`` process per
host over gloo/TCP with the rendezvous on host 0's private address, and tabulates each
(strategy, compression) configuration against ``ddp``/``none`` measured in the same run.

Nothing is created outside the namespaces this script makes: the veth pairs are created
directly inside them (``ip -n NS link add ... peer ... netns NS2``), the addresses are on a
private /24 that only exists behind the bridge, and the machine's own interfaces are never
touched. Everything is removed on exit, on Ctrl-C, SIGTERM, SIGHUP and on errors (a
``finally`` block, signal handlers and an ``atexit`` hook share one idempotent clean-up).

Link model (per host, full duplex): traffic leaving a host passes a token bucket of
``--rate-mbit`` on the host's ``eth0`` (its upload) and then ``--latency-ms`` of one-way
delay; traffic towards a host passes a second token bucket of the same rate on its bridge
port (its download), as on a switch port. Host-to-host one-way latency is therefore
``--latency-ms`` and the round trip twice that.

Every throughput scenario also runs a ``limit`` row: the same hosts, workers and workload
with no communication at all; each row's ``efficiency`` is the limit's step time over its
own. Scenarios (``--scenario``, several comma-separated run one after the other): ``quick``,
``default``, ``sc17`` (link rate calibrated until round-robin EASGD communicates >= 87% of
its time) and ``tta`` (time to a validation accuracy); each prints its targets as PASS/MISS.

Usage (as root)::

    .venv/bin/python bench/cluster.py --quick
    .venv/bin/python bench/cluster.py                       # the default scenario
    .venv/bin/python bench/cluster.py --scenario quick,default,sc17,tta
    .venv/bin/python bench/cluster.py --workers 4 --rate-mbit 100 --latency-ms 1 \\
        --configs "ddp/none,ddp/powersgd,ddp/dgc;optim.momentum=0" --steps 50 \
        --extra "optim.lr=0.01"
    .venv/bin/python bench/cluster.py --smoke               # network check, no training
    .venv/bin/python bench/cluster.py --cleanup-stale       # after a SIGKILLed run

Exit codes: 0 all configurations ran; 1 some configuration failed, timed out or was
skipped (its config file is missing); 2 the emulated network cannot be built here (no
root / CAP_NET_ADMIN, ``ip netns add`` refused, missing tools) or the workload or the
``ddp/none`` baseline config is missing; 128+N after signal N (everything cleaned up).
"""

from __future__ import annotations

import argparse
import atexit
import datetime as _dt
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

__all__ = [
    "SCENARIOS",
    "BenchConfig",
    "ClusterUnavailable",
    "EmulatedCluster",
    "LinkSpec",
    "RunResult",
    "Scenario",
    "Target",
    "add_efficiency",
    "add_tta_speedup",
    "build_table",
    "calibrate_sc17_rate",
    "evaluate_targets",
    "sc17_next_rate",
    "steady_figures",
    "time_to_target",
    "train_clock",
    "check_privileges",
    "cleanup_stale",
    "main",
    "merge_overrides",
    "parse_configs",
    "render_markdown",
    "row_from_summary",
    "tbf_params",
]

REPO = Path(__file__).resolve().parent.parent
PREFIX = "easgd-bench"
BASELINE = ("ddp", "none")

# The "limit" row: the same hosts, workers and workload with no communication at all.
# It runs as local SGD whose averaging period is longer than any run, so every worker
# trains alone; what local SGD still sends happens outside the timed window (the set-up
# broadcast before training starts, one final average after the last step; both are the
# same in the long and the short run of the steady-state subtraction and cancel).
LIMIT = ("limit", "none")
LIMIT_RUN = ("local_sgd", "none", ("strategy.period=1000000000",))

# DGC is measured at its final sparsity (no warm-up) and, as its config asks, with the
# momentum inside the compressor rather than in the optimizer.
DGC_ROW = "ddp/dgc;compression.warmup_ratio_steps=0;optim.momentum=0"
# AlexNet at 64x64 on synthetic data: ~57M parameters, ~230 MB of fp32 gradients per step.
# 2560 training samples = 20 steps x 32 per worker x 4 workers: the timed steps stay inside
# one epoch (no validation pass inside the timed fit); the final train loss is evaluated
# on 256 of them.
DEFAULT_WORKLOAD = (
    "model=alexnet",
    "data=synthetic",
    "data.image_size=64",
    "data.train_size=2560",
    "data.val_size=128",
    "data.train_eval_size=256",
)
# The digits MLP made wide (64 -> 2048 -> 10, 153k parameters, 614 kB of fp32 per
# exchange): steps of a few tens of milliseconds, so a slow link makes it
# communication-bound at little cost in bench time.
WIDE_MLP_WORKLOAD = ("model.hidden=2048",)
# Defaults of every benchmark run (each can be replaced through --extra KEY=VALUE): no
# logger, no checkpoint files, no progress bar, and as many epochs as --steps needs.
BENCH_OVERRIDES = (
    "trainer.accelerator=cpu",
    "trainer.max_epochs=-1",
    "trainer.enable_progress_bar=false",
    "logger=none",
    "checkpoint.enabled=false",
)
# SC17 (You, Buluc, Demmel): the original EASGD spends 87% of its time communicating.
SC17_BASELINE_SHARE = 0.87
SC17_FIRST_PROBE_MBIT = 1000.0

_CAP_SYS_ADMIN = 21
_CAP_NET_ADMIN = 12
_CMD_TIMEOUT_S = 30.0


class ClusterUnavailable(RuntimeError):
    """The emulated network cannot be built on this machine (exit code 2)."""


# --------------------------------------------------------------------------- pure helpers


@dataclass(frozen=True)
class LinkSpec:
    """One emulated link: rate in Mbit/s (10^6 bit/s) and one-way latency in ms."""

    rate_mbit: float
    latency_ms: float

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"--rate-mbit must be > 0, got {self.rate_mbit}")
        if self.latency_ms < 0:
            raise ValueError(f"--latency-ms must be >= 0, got {self.latency_ms}")


def tbf_params(rate_mbit: float, mtu: int = 1500) -> dict[str, int]:
    """Token-bucket parameters for ``tc qdisc ... tbf`` at a given rate.

    The bucket holds 2 ms of traffic (at least two full frames), so the shaper neither
    starves at high rates (where the kernel timer granularity matters) nor lets a long
    burst through at low rates. The queue holds 100 ms of traffic and at least 2 MiB, more
    than Linux lets one local TCP socket park in a qdisc (``tcp_limit_output_bytes``,
    1 MiB), so senders are paced by back-pressure rather than by drops (drops at low rates
    cost 10-15% of the throughput through retransmission time-outs).

    Args:
        rate_mbit: link rate in Mbit/s.
        mtu: frame payload size in bytes.

    Returns:
        ``{"rate_kbit": ..., "burst_bytes": ..., "limit_bytes": ...}``.
    """
    rate_bytes_per_s = rate_mbit * 1e6 / 8.0
    burst = max(2 * (mtu + 100), int(rate_bytes_per_s * 0.002))
    limit = max(2 * 1024 * 1024, int(rate_bytes_per_s * 0.1)) + burst
    return {
        "rate_kbit": max(1, round(rate_mbit * 1000)),
        "burst_bytes": burst,
        "limit_bytes": limit,
    }


@dataclass(frozen=True)
class BenchConfig:
    """One row of the table: a strategy, a compression and overrides for this row only."""

    strategy: str
    compression: str
    overrides: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.strategy, self.compression)

    @property
    def label(self) -> str:
        return f"{self.strategy}/{self.compression}"

    @property
    def slug(self) -> str:
        # Hydra's override grammar forbids '=' inside hydra.run.dir's value.
        tail = "_".join(re.sub(r"[^A-Za-z0-9.-]", "-", o) for o in self.overrides)
        return f"{self.strategy}__{self.compression}" + (f"__{tail}" if tail else "")


def parse_configs(text: str) -> list[BenchConfig]:
    """Parse ``"strategy/compression,strategy/compression;key=value;key=value"``.

    Items are separated by commas; an item may carry Hydra overrides for that row only
    after semicolons (e.g. ``ddp/dgc;compression.warmup_ratio_steps=0``).

    Args:
        text: the ``--configs`` value.

    Returns:
        The configurations in order, exact duplicates removed.

    Raises:
        ValueError: an item is not of the form ``strategy/compression[;key=value...]``.
    """
    configs: list[BenchConfig] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        head, *overrides = (tok.strip() for tok in item.split(";"))
        parts = head.split("/")
        bad = [o for o in overrides if "=" not in o]
        if len(parts) != 2 or not all(re.fullmatch(r"[A-Za-z0-9_\-]+", p) for p in parts) or bad:
            raise ValueError(
                f"--configs: '{item}' is not 'strategy/compression[;key=value...]' "
                "(e.g. ddp/none, sync_easgd/topk, ddp/dgc;compression.warmup_ratio_steps=0)"
            )
        config = BenchConfig(parts[0], parts[1], tuple(o for o in overrides if o))
        if config not in configs:
            configs.append(config)
    if not configs:
        raise ValueError("--configs: empty list; give e.g. 'ddp/none,sync_easgd/none'")
    return configs


def _spec(text: str) -> BenchConfig:
    """One ``strategy/compression[;key=value...]`` item as a :class:`BenchConfig`."""
    (config,) = parse_configs(text)
    return config


_SHARES = ("comm_share", "comm_bound")


@dataclass(frozen=True)
class Target:
    """A ratio a scenario must reach, judged PASS/MISS in the table.

    Kinds: ``efficiency`` (the row's ``efficiency`` against ``bound``), ``comm_share``
    (the row's comm share), ``comm_bound`` (1 - efficiency: the share of the step that
    communication adds over the limit), ``speedup`` (``figure`` of the row ``ref`` divided by the same
    figure of this row: how many times faster this row is).
    """

    row: str
    kind: str
    op: str
    bound: float
    ref: str | None = None
    figure: str = "step_time_s"
    note: str = ""

    def describe(self) -> str:
        what = {
            "efficiency": "efficiency",
            "comm_share": "comm share",
            "comm_bound": "share of the step spent on communication (1 - efficiency)",
            "speedup": f"{'time to target' if self.figure == 'time_to_target_s' else 'per-step'}"
            f" speedup over {self.ref}",
        }[self.kind]
        bound = f"{100 * self.bound:.0f}%" if self.kind in _SHARES else f"{self.bound:g}"
        if self.kind == "speedup":
            bound += "x"
        return f"{self.row}: {what} {self.op} {bound}" + (f" ({self.note})" if self.note else "")

    def short(self) -> str:
        bound = f"{100 * self.bound:.0f}%" if self.kind in _SHARES else f"{self.bound:g}"
        name = {"efficiency": "eff", "comm_share": "comm", "comm_bound": "1-eff", "speedup": "x"}[
            self.kind
        ]
        if self.kind == "speedup":
            ref = _spec(self.ref or "").label
            return f"{bound}x vs {ref}"
        return f"{name} {self.op} {bound}"


def _row_key(row: dict) -> tuple:
    return (row["strategy"], row["compression"], tuple(row.get("overrides") or ()))


def _find_row(rows: list[dict], spec: str) -> dict | None:
    config = _spec(spec)
    key = (config.strategy, config.compression, config.overrides)
    return next((r for r in rows if _row_key(r) == key), None)


def evaluate_targets(rows: list[dict], targets: Sequence[Target]) -> list[dict]:
    """Judge every target against the rows of one run.

    Returns one dict per target: ``target`` (its description), ``row``, ``measured``
    (None when a row it needs did not run or failed), ``status`` (``PASS``, ``MISS``, or
    ``n/a: ...`` saying which row is missing or failed), and ``short`` (the table's label).
    """
    results = []
    for t in targets:
        out = {
            "target": t.describe(), "row": t.row, "short": t.short(), "kind": t.kind,
            "measured": None,
        }
        needed = [t.row] + ([t.ref] if t.ref else [])
        found = {spec: _find_row(rows, spec) for spec in needed}
        problem = next(
            (
                f"n/a: {spec} " + ("not run" if r is None else f"{r.get('status')}")
                for spec, r in found.items()
                if r is None or r.get("status") != "ok"
            ),
            None,
        )
        if problem is None:
            row = found[t.row]
            if t.kind == "efficiency":
                value = row.get("efficiency")
            elif t.kind == "comm_share":
                value = row.get("comm_share")
            elif t.kind == "comm_bound":
                eff = row.get("efficiency")
                value = None if eff is None else 1.0 - eff
            else:
                mine, theirs = row.get(t.figure), found[t.ref].get(t.figure)
                value = theirs / mine if mine and theirs is not None else None
                if t.figure == "time_to_target_s" and value is None:
                    problem = _unreached(row, found[t.ref], t)
            if problem is not None:
                pass
            elif value is None:
                problem = f"n/a: no {t.kind} figure"
            else:
                out["measured"] = value
                ok = value >= t.bound if t.op == ">=" else value <= t.bound
                out["status"] = "PASS" if ok else "MISS"
        if problem is not None:
            out["status"] = problem
        results.append(out)
    return results


def _unreached(row: dict, ref: dict, t: Target) -> str:
    """Verdict of a time-to-target speedup when one of the two rows never got there."""
    if row.get("time_to_target_s") is None:
        return "MISS: never reached the target" if ref.get("time_to_target_s") is not None else (
            f"n/a: neither this row nor {t.ref} reached the target"
        )
    # The reference never got there: its whole training time bounds its time from below.
    bound = (ref.get("train_time_s") or 0.0) / row["time_to_target_s"]
    if bound >= t.bound:
        return f"PASS: {t.ref} never reached it (speedup > {bound:.2f}x)"
    return f"n/a: {t.ref} never reached the target"


def add_efficiency(rows: list[dict]) -> None:
    """``efficiency`` = limit ``step_time_s`` / the row's ``step_time_s`` (1.0: comm is free).

    Only rows that completed get a value; without a completed limit row every value is
    None.
    """
    limit = next(
        (r for r in rows if (r["strategy"], r["compression"]) == LIMIT and r.get("status") == "ok"),
        None,
    )
    ref = limit.get("step_time_s") if limit else None
    for row in rows:
        mine = row.get("step_time_s")
        row["efficiency"] = (
            float(ref) / float(mine) if ref and mine and row.get("status") == "ok" else None
        )


def sc17_next_rate(rate_mbit: float, share: float, wanted: float, margin: float = 0.85) -> float:
    """The next link rate to probe so that round-robin EASGD reaches ``wanted`` comm share.

    Model: per step, compute K is fixed and communication C scales with 1 / rate, so the
    share s = C / (C + K) has odds s / (1 - s) proportional to 1 / rate. The rate that
    gives the wanted odds is ``rate * odds(share) / odds(wanted)``; ``margin`` (< 1) aims
    a little below it, and the result is rounded down to two significant digits.

    Args:
        rate_mbit: the rate just probed.
        share: the comm share measured there (clipped to [0.01, 0.99]).
        wanted: the comm share to reach.
        margin: factor applied to the model's rate.

    Returns:
        The next rate in Mbit/s (at least 1).
    """
    s = min(max(share, 0.01), 0.99)
    odds = s / (1.0 - s)
    target_odds = wanted / (1.0 - wanted)
    rate = rate_mbit * odds / target_odds * margin
    if rate <= 1.0:
        return 1.0
    digits = 10 ** (len(str(int(rate))) - 2)
    return float(max(1, int(rate // digits) * digits))


def time_to_target(history: list[dict], target: float) -> dict | None:
    """The first validation in ``val_history`` at or above ``target`` accuracy.

    Returns ``{"time_s", "step", "epoch"}`` (seconds since training started, as the
    summary records them) or None when it was never reached.
    """
    for entry in history:
        acc = entry.get("val_acc")
        if acc is not None and acc >= target:
            return {"time_s": float(entry["time_s"]), "step": entry.get("step"), "epoch": entry.get("epoch")}
    return None


@dataclass(frozen=True)
class Scenario:
    """A preset: hosts, link, workload, rows, run length and the targets it is judged by.

    ``kind`` ``throughput`` measures per-step figures over ``steps`` (steady state after
    ``warmup_steps``) and always adds the limit row; ``tta`` trains each row for
    ``epochs`` and reports the time to ``target_acc``. ``rate_mbit`` None: calibrate the
    rate (sc17).
    """

    name: str
    description: str
    workers: int
    rate_mbit: float | None
    workload: tuple[str, ...]
    configs: str
    targets: tuple[Target, ...] = ()
    steps: int = 20
    warmup_steps: int = 2
    extra: tuple[str, ...] = ()
    kind: str = "throughput"
    epochs: int = 0
    target_acc: float = 0.0
    timeout_s: float = 1800.0


SC17_OVERLAPPED = "sync_easgd/none;strategy.overlap=true"
SC17_BLOCKING = "sync_easgd/none;strategy.overlap=false"
TTA_CONFIGS = (
    f"ddp/none,{DGC_ROW},ddp/powersgd,sync_easgd/none;strategy.tau=4,sync_easgd/topk,"
    "local_sgd/none;strategy.period_rule=qsr;strategy.h_base=2;strategy.gamma=0.1,"
    "async_easgd/none;strategy.tau=4"
)
SCENARIOS: dict[str, Scenario] = {
    "quick": Scenario(
        name="quick",
        description="2 hosts, 100 Mbit/s, the digits MLP made wide (model.hidden=2048)",
        workers=2,
        rate_mbit=100.0,
        workload=WIDE_MLP_WORKLOAD,
        configs=f"ddp/none,{DGC_ROW},ddp/powersgd,sync_easgd/none,sync_easgd/topk",
        targets=(
            Target(DGC_ROW, "efficiency", ">=", 0.8),
            Target("sync_easgd/topk", "efficiency", ">=", 0.8),
        ),
        steps=210,
        warmup_steps=10,
        timeout_s=300.0,
    ),
    "default": Scenario(
        name="default",
        description="4 hosts, 1 Gbit/s, AlexNet 64x64 on synthetic data",
        workers=4,
        rate_mbit=1000.0,
        workload=DEFAULT_WORKLOAD,
        configs=f"ddp/none,{DGC_ROW},ddp/powersgd,sync_easgd/none,sync_easgd/topk",
        targets=(
            Target(DGC_ROW, "efficiency", ">=", 0.8),
            Target("ddp/powersgd", "efficiency", ">=", 0.8),
            Target("sync_easgd/topk", "efficiency", ">=", 0.8),
            Target(DGC_ROW, "speedup", ">=", 2.0, ref="ddp/none"),
        ),
        steps=8,
        warmup_steps=2,
        timeout_s=1200.0,
    ),
    "sc17": Scenario(
        name="sc17",
        description=(
            "4 hosts, the wide digits MLP, link rate calibrated so that easgd_round_robin "
            "spends >= 87% of its time communicating (SC17's baseline)"
        ),
        workers=4,
        rate_mbit=None,
        workload=WIDE_MLP_WORKLOAD,
        configs=f"ddp/none,easgd_round_robin/none,{SC17_BLOCKING},{SC17_OVERLAPPED}",
        targets=(
            Target(
                "easgd_round_robin/none", "comm_bound", ">=", SC17_BASELINE_SHARE,
                note="the calibration: SC17's baseline",
            ),
            Target(SC17_OVERLAPPED, "speedup", ">=", 5.3, ref="easgd_round_robin/none"),
            Target(SC17_OVERLAPPED, "comm_share", "<=", 0.14),
        ),
        steps=40,
        warmup_steps=10,
        timeout_s=600.0,
    ),
    "tta": Scenario(
        name="tta",
        description=(
            "time to accuracy: 4 hosts, 100 Mbit/s (ddp/none communication-bound), the wide "
            "digits MLP, lr halved every 4 epochs"
        ),
        workers=4,
        rate_mbit=100.0,
        workload=WIDE_MLP_WORKLOAD,
        extra=("optim.schedule=step", "optim.step_size_epochs=4", "optim.gamma=0.5"),
        configs=TTA_CONFIGS,
        targets=tuple(
            Target(spec, "speedup", ">=", 2.0, ref="ddp/none", figure="time_to_target_s")
            for spec in TTA_CONFIGS.split(",")[1:]
        ),
        kind="tta",
        epochs=12,
        target_acc=0.95,
        timeout_s=600.0,
    ),
}


def _mean(values: Iterable[float]) -> float | None:
    vals = [float(v) for v in values]
    return statistics.fmean(vals) if vals else None


def comm_share_of(summary: dict) -> tuple[float | None, str]:
    """The comm share a summary reports, and which field it came from.

    ``comm.exposed_fraction`` (the time the training loop actually waited for
    communication) when the summary has it, else ``comm.time_fraction`` (all
    communication time, overlapped or not).
    """
    comm = summary.get("comm") or {}
    if comm.get("exposed_fraction") is not None:
        return comm["exposed_fraction"], "exposed"
    return comm.get("time_fraction"), "total"


def row_from_summary(summary: dict) -> dict:
    """Figures of one run, read from its ``summary.json`` (DESIGN.md 4.2).

    * ``step_time_s``: ``wall_time_s`` / mean of ``steps_per_rank`` over ranks that stepped
      (for asynchronous strategies the ranks' step counts differ; a pure server rank that
      takes no optimizer steps is left out).
    * ``samples_per_s``: as reported.
    * ``bytes_per_step_per_worker``: all ranks' ``comm.bytes_sent`` summed, divided by all
      ranks' steps summed (for synchronous strategies: one rank's bytes per step; for a
      parameter server it charges the server's replies to the workers' steps).
    * ``comm_share``: ``comm.exposed_fraction``, or ``comm.time_fraction`` where the summary
      has no exposed figure (``comm_share_source``: ``exposed`` / ``total``).
    * ``final_loss``: ``train_loss``.

    Args:
        summary: the parsed summary.json.

    Returns:
        A dict with the figures (``None`` where the summary lacks the field).
    """
    steps = [int(s) if s is not None else 0 for s in summary.get("steps_per_rank") or []]
    stepping = [s for s in steps if s > 0]
    wall = summary.get("wall_time_s")
    comm = summary.get("comm") or {}
    sent = comm.get("bytes_sent")
    sent_list = [int(b) for b in sent] if isinstance(sent, list) else []
    mean_steps = _mean(stepping)
    step_time = wall / mean_steps if (wall is not None and mean_steps) else None
    bytes_per_step = sum(sent_list) / sum(stepping) if (sent_list and stepping) else None
    share, source = comm_share_of(summary)
    return {
        "step_time_s": step_time,
        "samples_per_s": summary.get("samples_per_s"),
        "bytes_per_step_per_worker": bytes_per_step,
        "comm_share": share,
        "comm_share_source": source,
        "final_loss": summary.get("train_loss"),
        "steps_per_rank": steps,
        "wall_time_s": wall,
        "val_acc": summary.get("val_acc"),
    }


def train_clock(summary: dict) -> float | None:
    """Seconds from the start of training to the end of the last step's validation.

    ``val_history`` entries carry the time since training started (after process-group
    set-up and the strategy's initial broadcast); Lightning validates when ``max_steps``
    is reached, so the last entry closes the run. None when the history does not end at
    a step some rank finished on (then use ``wall_time_s``, which also counts the wait
    for the slowest rank to start).
    """
    hist = summary.get("val_history") or []
    steps = [int(s) for s in summary.get("steps_per_rank") or [] if s]
    if not hist or hist[-1].get("time_s") is None or hist[-1].get("step") not in steps:
        return None
    return float(hist[-1]["time_s"])


def _totals(summary: dict, clock: str) -> dict:
    """Whole-run totals of one summary, the quantities :func:`steady_figures` subtracts."""
    steps = [int(s) if s is not None else 0 for s in summary.get("steps_per_rank") or []]
    comm = summary.get("comm") or {}
    wall = float(summary.get("wall_time_s") or 0.0)
    exposed = comm.get("exposed_time_s")
    comm_times = exposed if isinstance(exposed, list) else comm.get("time_s") or []
    return {
        "time": train_clock(summary) if clock == "train" else wall,
        "steps": steps,
        "samples": float(summary.get("samples_per_s") or 0.0) * wall,
        "sent": [int(b or 0) for b in comm.get("bytes_sent") or []],
        "comm_time": [float(t or 0.0) for t in comm_times],
        "comm_source": "exposed" if isinstance(exposed, list) else "total",
    }


def steady_figures(long: dict, short: dict) -> dict | None:
    """Per-step figures with the start-up steps subtracted out.

    Two runs of one configuration that differ only in their number of steps (``short``
    takes the first few, ``long`` all of them) share their start-up costs: DDP's bucket
    rebuild and the compression hooks' dense first iterations, lazy allocations, the first
    rendezvous of every collective. Their difference is the steady state:
    ``step_time = (T_L - T_S) / (steps_L - steps_S)``, and likewise for bytes (summed
    over ranks, per step summed over ranks), samples/s and each rank's communication time
    (exposed where the summaries record it) over the time difference. T is the training
    clock (:func:`train_clock`) when both runs have it, else ``wall_time_s``.

    Args:
        long: summary.json of the full run.
        short: summary.json of the short run of the same configuration.

    Returns:
        The figures as :func:`row_from_summary` names them (``final_loss`` from ``long``)
        plus ``clock`` (``train`` / ``wall``), or ``None`` when the difference is not
        positive (then use the whole-run figures).
    """
    clock = "train" if train_clock(long) is not None and train_clock(short) is not None else "wall"
    a, b = _totals(long, clock), _totals(short, clock)
    if len(a["steps"]) != len(b["steps"]):
        return None
    d_time = a["time"] - b["time"]
    d_steps = [x - y for x, y in zip(a["steps"], b["steps"])]
    stepping = [d for x, d in zip(a["steps"], d_steps) if x > 0]
    mean_steps = _mean(stepping)
    if d_time <= 0 or not mean_steps or mean_steps <= 0 or sum(stepping) <= 0:
        return None
    d_sent = sum(a["sent"]) - sum(b["sent"])
    fractions = [(x - y) / d_time for x, y in zip(a["comm_time"], b["comm_time"])]
    if a["sent"] == b["sent"]:
        # Nothing was sent in the window (the limit row): what the comm times differ by is
        # how long the collectives outside it (set-up broadcast, final average) waited.
        fractions = [0.0 for _ in fractions]
    return {
        "step_time_s": d_time / mean_steps,
        "samples_per_s": (a["samples"] - b["samples"]) / d_time,
        "bytes_per_step_per_worker": d_sent / sum(stepping),
        # Not clipped: asynchronous collectives in flight at once (DDP's buckets during the
        # backward pass) each count their own launch-to-completion time, so a total share
        # can exceed the wall time; above 100% means communication overlapped itself.
        "comm_share": _mean(fractions) if fractions else None,
        "comm_share_source": a["comm_source"],
        "final_loss": long.get("train_loss"),
        "clock": clock,
    }


FIGURES = (
    "step_time_s",
    "samples_per_s",
    "bytes_per_step_per_worker",
    "comm_share",
    "final_loss",
)


def build_table(rows: list[dict], baseline: tuple[str, str] = BASELINE) -> list[dict]:
    """Add ``ratio`` (value / baseline value) for every figure of every row.

    The baseline is the row with ``(strategy, compression) == baseline`` that completed;
    without one every ratio is ``None``.

    Args:
        rows: dicts with ``strategy``, ``compression``, ``status`` and the figures.
        baseline: the configuration the ratios are taken against.

    Returns:
        The same rows (mutated), each with a ``ratio`` dict keyed by figure.
    """
    base = next(
        (
            r
            for r in rows
            if (r["strategy"], r["compression"]) == baseline and r.get("status") == "ok"
        ),
        None,
    )
    for row in rows:
        ratios: dict[str, float | None] = {}
        for name in FIGURES:
            value = row.get(name)
            ref = base.get(name) if base else None
            ratios[name] = (
                float(value) / float(ref)
                if value is not None and ref not in (None, 0) and row.get("status") == "ok"
                else None
            )
        row["ratio"] = ratios
    return rows


def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if abs(value) >= scale:
                return f"{value / scale:.2f} {unit}"
        return f"{value:.0f} B"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "ratio":
        if value >= 100:
            return f"{value:.0f}x"
        return f"{value:.2f}x" if value >= 0.1 else f"{value:.2g}x"
    if kind == "s":
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    if kind == "eff":
        return f"{value:.2f}"
    return f"{value:.4g}"


def _share_label(rows: list[dict]) -> str:
    sources = {r.get("comm_share_source") for r in rows if r.get("comm_share") is not None}
    if sources == {"exposed"}:
        return "exposed comm share"
    if sources == {"total"}:
        return "comm share (total)"
    return "comm share"


def _targets_by_row(targets: list[dict]) -> dict[str, list[dict]]:
    by_row: dict[str, list[dict]] = {}
    for t in targets:
        by_row.setdefault(t["row"], []).append(t)
    return by_row


def _target_cell(row: dict, by_row: dict[str, list[dict]]) -> str:
    label = row_spec(row)
    cells = []
    for t in by_row.get(label, []):
        status = t["status"].split(":")[0] if t["status"].startswith(("PASS", "MISS")) else "n/a"
        cells.append(f"{t['short']}: {status}")
    return "; ".join(cells) or "-"


def _row_label(row: dict) -> str:
    if (row["strategy"], row["compression"]) == LIMIT and not row.get("overrides"):
        return "limit (no communication)"
    return f"{row['strategy']}/{row['compression']}" + (
        f" `{' '.join(row['overrides'])}`" if row.get("overrides") else ""
    )


def row_spec(row: dict) -> str:
    """The ``--configs`` item of a row (``strategy/compression[;key=value...]``)."""
    return ";".join([f"{row['strategy']}/{row['compression']}", *(row.get("overrides") or [])])


def _format_measured(t: dict) -> str:
    value = t.get("measured")
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if t.get("kind") in _SHARES else f"{value:.2f}"


def _targets_md(targets: list[dict]) -> list[str]:
    if not targets:
        return []
    lines = ["", "| target | measured | result |", "|---|---:|---|"]
    for t in targets:
        lines.append(f"| {t['target']} | {_format_measured(t)} | {t['status']} |")
    return lines


def _header(scenario: dict) -> list[str]:
    link = scenario["link"]
    lat = f"{link['latency_ms']} ms one-way"
    if link["latency_ms"] > 0 and not link.get("latency_emulated"):
        lat += " requested, NOT emulated (sch_netem missing in this kernel)"
    workload = " ".join(scenario["workload"]) or "(CLI defaults)"
    extra = " ".join(scenario["extra"]) or "-"
    machine = scenario["machine"]
    name = scenario.get("name", "custom")
    lines = [
        f"# Emulated cluster, scenario {name}: {scenario['workers']} workers, "
        f"{link['rate_mbit']:g} Mbit/s, {lat}",
        "",
        f"- workload: `{workload}`, extra: `{extra}`",
    ]
    calib = scenario.get("calibration")
    if calib:
        probes = ", ".join(
            f"{p['rate_mbit']:g} Mbit/s -> {_fmt(p.get('comm_share'), 'pct')}" for p in calib["probes"]
        )
        lines.append(
            f"- link rate {link['rate_mbit']:g} Mbit/s chosen by measurement: the fastest probed "
            f"rate at which easgd_round_robin spent >= {100 * calib['wanted']:.0f}% of its step "
            f"on communication, i.e. 1 - (limit step {_fmt(calib.get('limit_step_s'), 's')} s) / "
            f"(its step) (probes: {probes})"
            + ("" if calib.get("reached") else "; NOT reached within the probes")
        )
    lines += [
        f"- machine: {machine['cpus']} CPUs, {machine['platform']}, {scenario['date']}"
        + (f", load average before: {scenario['loadavg']}" if scenario.get("loadavg") else ""),
        f"- command: `{scenario['command']}`",
    ]
    return lines


def render_markdown(rows: list[dict], scenario: dict) -> str:
    """Render the table (and a scenario header, and the targets) as markdown.

    Args:
        rows: the output of :func:`build_table`.
        scenario: the run's scenario dict (workers, link, workload, targets, ...).

    Returns:
        Markdown text.
    """
    if scenario.get("kind") == "tta":
        return render_tta_markdown(rows, scenario)
    targets = scenario.get("targets") or []
    by_row = _targets_by_row(targets)
    share = _share_label(rows)
    lines = _header(scenario) + [
        f"- steps: {scenario['steps']}; "
        + (
            f"figures per step over steps {scenario['warmup_steps'] + 1}..{scenario['steps']}"
            f" (a {scenario['warmup_steps']}-step run of each configuration subtracted)"
            if scenario.get("warmup_steps")
            else "figures over the whole run (first steps included)"
        ),
        (
            "- x = value / value of ddp/none in this run (step time < 1x and samples/s > 1x"
            " are faster; bytes ratio = 1 / compression factor); efficiency = limit step time"
            " / row step time (limit: every worker trains alone, no communication)"
        ),
        f"- {share}: "
        + (
            "comm.exposed_fraction (time the training loop waited for communication)"
            if share == "exposed comm share"
            else "comm.time_fraction (all communication time; these summaries have no "
            "exposed figure)"
            if share == "comm share (total)"
            else "exposed where the summary has it, else total (marked *)"
        ),
        "",
        (
            "| strategy/compression | step time (s) | x | efficiency | samples/s | x "
            f"| bytes/step/worker | x | {share} | final loss | targets | status |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    mixed = share == "comm share"
    for r in rows:
        q = r.get("ratio", {})
        star = "*" if mixed and r.get("comm_share_source") == "total" else ""
        lines.append(
            "| "
            + " | ".join(
                [
                    _row_label(r),
                    _fmt(r.get("step_time_s"), "s"),
                    _fmt(q.get("step_time_s"), "ratio"),
                    _fmt(r.get("efficiency"), "eff"),
                    _fmt(r.get("samples_per_s"), "num"),
                    _fmt(q.get("samples_per_s"), "ratio"),
                    _fmt(r.get("bytes_per_step_per_worker"), "bytes"),
                    _fmt(q.get("bytes_per_step_per_worker"), "ratio"),
                    _fmt(r.get("comm_share"), "pct") + star,
                    _fmt(r.get("final_loss"), "num"),
                    _target_cell(r, by_row),
                    r.get("status", "?")
                    + (
                        " (whole run)"
                        if scenario.get("warmup_steps") and r.get("measured") == "whole run"
                        else ""
                    ),
                ]
            )
            + " |"
        )
    return "\n".join(lines + _targets_md(targets)) + "\n"


def render_tta_markdown(rows: list[dict], scenario: dict) -> str:
    """The time-to-accuracy table: one row per configuration, speedup over ddp/none."""
    targets = scenario.get("targets") or []
    by_row = _targets_by_row(targets)
    acc = scenario["target_acc"]
    lines = _header(scenario) + [
        f"- each row trains for up to {scenario['epochs']} epochs and validates the model it "
        "delivers (the center for elastic rows) after every epoch; time = seconds from the "
        f"start of training to the first validation with val_acc >= {acc:g} "
        "(`val_history[].time_s` of summary.json)",
        "- speedup = ddp/none's time / the row's time; bytes and comm share over the whole run",
        "",
        (
            f"| strategy/compression | time to {acc:g} (s) | speedup | epoch | step "
            f"| best val_acc | bytes/step/worker | {_share_label(rows)} | step time (s) "
            "| targets | status |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        reached = r.get("time_to_target_s") is not None
        lines.append(
            "| "
            + " | ".join(
                [
                    _row_label(r),
                    _fmt(r.get("time_to_target_s"), "s")
                    if reached
                    else ("never" if r.get("status") == "ok" else "-"),
                    _fmt(r.get("speedup"), "ratio"),
                    str(r["target_epoch"] + 1) if reached and r.get("target_epoch") is not None else "-",
                    str(r.get("target_step")) if reached else "-",
                    _fmt(r.get("best_val_acc"), "num"),
                    _fmt(r.get("bytes_per_step_per_worker"), "bytes"),
                    _fmt(r.get("comm_share"), "pct"),
                    _fmt(r.get("step_time_s"), "s"),
                    _target_cell(r, by_row),
                    r.get("status", "?"),
                ]
            )
            + " |"
        )
    return "\n".join(lines + _targets_md(targets)) + "\n"


# --------------------------------------------------------------------------- privileges


def _effective_caps() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def check_privileges() -> None:
    """Fail early, with the reason, when namespaces cannot be built here.

    Raises:
        ClusterUnavailable: not Linux, ``ip``/``tc`` missing, or neither root nor
            CAP_NET_ADMIN + CAP_SYS_ADMIN (``ip netns add`` needs both).
    """
    if platform.system() != "Linux":
        raise ClusterUnavailable(f"needs Linux network namespaces; this is {platform.system()}")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(f"'{tool}' (iproute2) not found on PATH; install iproute2")
    caps = _effective_caps()
    if not (caps >> _CAP_NET_ADMIN & 1 and caps >> _CAP_SYS_ADMIN & 1):
        raise ClusterUnavailable(
            "needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces; "
            "run it as root, e.g. `sudo .venv/bin/python bench/cluster.py ...`"
        )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _list_netns() -> list[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], check=False, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S
    )
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def cleanup_stale(dry_run: bool = False) -> list[str]:
    """Delete ``easgd-bench-<pid>-*`` namespaces whose creating process is gone.

    Only namespaces made by this script (its name prefix) whose ``<pid>`` is no longer
    alive are touched: a run that was SIGKILLed cannot clean up after itself.

    Args:
        dry_run: only list them.

    Returns:
        The stale namespace names.
    """
    stale = []
    for name in _list_netns():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-(?:br|\d+)", name)
        if m and not _pid_alive(int(m.group(1))):
            stale.append(name)
    if not dry_run:
        for name in stale:
            _kill_netns_pids(name)
            subprocess.run(
                ["ip", "netns", "del", name], check=False, capture_output=True, timeout=30
            )
    return stale


def _kill_netns_pids(ns: str) -> None:
    """SIGKILL whatever still runs inside a namespace this script created."""
    out = subprocess.run(
        ["ip", "netns", "pids", ns],
        check=False,
        capture_output=True,
        text=True,
        timeout=_CMD_TIMEOUT_S,
    )
    for tok in out.stdout.split():
        if tok.isdigit() and int(tok) != os.getpid():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


# --------------------------------------------------------------------------- the cluster

_LIVE: list[EmulatedCluster] = []


def _cleanup_all() -> None:
    for cluster in list(_LIVE):  # noqa: PERF101 - down() removes from _LIVE
        cluster.down()


class _Interrupted(BaseException):
    """Raised from a signal handler so ``finally`` blocks run."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def _on_signal(signum: int, _frame: object) -> None:
    # Ignore repeats while cleaning up; the first one unwinds the stack.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise _Interrupted(signum)


def install_signal_handlers() -> None:
    """Route SIGINT/SIGTERM/SIGHUP through ``finally`` blocks; clean up at exit too."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    atexit.register(_cleanup_all)


class EmulatedCluster:
    """N hosts in network namespaces behind one bridge, each link shaped with ``tc``.

    Use as a context manager; :meth:`down` is idempotent and also runs from ``atexit``.

    Args:
        workers: number of hosts.
        link: rate and latency of every host's link.
        subnet: first three octets of the private /24 (hosts get .1, .2, ...).
        run_id: name prefix of everything created (default ``easgd-bench-<pid>``).
    """

    host_ifname = "eth0"

    def __init__(
        self,
        workers: int,
        link: LinkSpec,
        subnet: str = "10.77.0",
        run_id: str | None = None,
    ) -> None:
        if not 1 <= workers <= 250:
            raise ValueError(f"--workers must be in 1..250, got {workers}")
        if not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"--subnet must be a private 10.x.y prefix, got {subnet}")
        self.workers = workers
        self.link = link
        self.subnet = subnet
        self.run_id = run_id or f"{PREFIX}-{os.getpid()}"
        self.bridge_ns = f"{self.run_id}-br"
        self.hosts = [f"{self.run_id}-{i}" for i in range(workers)]
        self.latency_emulated = False
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._down = False
        self._warned = False

    # -- addressing
    def addr(self, rank: int) -> str:
        """Private address of host ``rank``."""
        return f"{self.subnet}.{rank + 1}"

    @staticmethod
    def port_ifname(rank: int) -> str:
        """Name of host ``rank``'s port on the bridge (inside the bridge namespace)."""
        return f"port{rank}"

    # -- commands
    @staticmethod
    def _run(cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run one ``ip``/``tc`` command (space-separated; our names contain no spaces)."""
        proc = subprocess.run(
            cmd.split(), check=False, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"`{cmd}` failed: {proc.stderr.strip()}")
        return proc

    def _add_netns(self, name: str) -> None:
        proc = self._run(f"ip netns add {name}", check=False)
        if proc.returncode != 0:
            raise ClusterUnavailable(
                f"`ip netns add {name}` failed: {proc.stderr.strip()} "
                "(network namespaces are not permitted here: needs root or CAP_NET_ADMIN + "
                "CAP_SYS_ADMIN, and a kernel/container that allows them)"
            )
        self._namespaces.append(name)

    # -- lifecycle
    def __enter__(self) -> Self:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Create the namespaces, bridge, veth pairs, addresses and shaping."""
        _LIVE.append(self)
        self._add_netns(self.bridge_ns)
        br, eth = self.bridge_ns, self.host_ifname
        self._run(f"ip -n {br} link add br0 type bridge")
        self._run(f"ip -n {br} link set br0 up")
        self._run(f"ip -n {br} link set lo up")
        for i, ns in enumerate(self.hosts):
            self._add_netns(ns)
            port = self.port_ifname(i)
            # Both ends are created inside our namespaces: the host's namespace never sees them.
            self._run(f"ip -n {br} link add {port} type veth peer name {eth} netns {ns}")
            self._run(f"ip -n {br} link set {port} master br0")
            self._run(f"ip -n {br} link set {port} up")
            self._run(f"ip -n {ns} addr add {self.addr(i)}/24 dev {eth}")
            self._run(f"ip -n {ns} link set {eth} up")
            self._run(f"ip -n {ns} link set lo up")
        self.shape(self.link)

    def shape(self, link: LinkSpec) -> None:
        """(Re)apply rate and latency to every link; can be called between runs."""
        self.link = link
        p = tbf_params(link.rate_mbit)
        tbf = f"tbf rate {p['rate_kbit']}kbit burst {p['burst_bytes']} limit {p['limit_bytes']}"
        delay = f"netem delay {link.latency_ms * 1000:.0f}us limit 100000"
        br, eth = self.bridge_ns, self.host_ifname
        emulated = True
        for i, ns in enumerate(self.hosts):
            port = self.port_ifname(i)
            # Upload: host eth0 -> token bucket -> netem delay (when the kernel has netem).
            self._run(f"tc -n {ns} qdisc del dev {eth} root", check=False)
            self._run(f"tc -n {ns} qdisc add dev {eth} root handle 1: {tbf}")
            if link.latency_ms > 0:
                proc = self._run(
                    f"tc -n {ns} qdisc add dev {eth} parent 1:1 handle 10: {delay}", check=False
                )
                emulated = emulated and proc.returncode == 0
            # Download: bridge port -> token bucket (a switch port's egress).
            self._run(f"tc -n {br} qdisc del dev {port} root", check=False)
            self._run(f"tc -n {br} qdisc add dev {port} root handle 1: {tbf}")
        self.latency_emulated = emulated and link.latency_ms > 0
        if link.latency_ms > 0 and not emulated and not self._warned:
            self._warned = True
            print(
                f"[cluster] WARNING: latency {link.latency_ms} ms NOT emulated: the kernel has "
                "no sch_netem (tc qdisc netem); links are rate-shaped only.",
                file=sys.stderr,
                flush=True,
            )

    def describe(self) -> dict:
        """The link as recorded in the results."""
        p = tbf_params(self.link.rate_mbit)
        return {
            "rate_mbit": self.link.rate_mbit,
            "latency_ms": self.link.latency_ms,
            "latency_emulated": self.latency_emulated,
            "shaping": "tbf on host egress and on bridge-port egress (full duplex)"
            + (", netem delay on host egress" if self.latency_emulated else ""),
            "tbf": p,
            "subnet": f"{self.subnet}.0/24",
        }

    def spawn(
        self, rank: int, cmd: Sequence[str], env: dict[str, str], log: Path
    ) -> subprocess.Popen:
        """Start ``cmd`` inside host ``rank``'s namespace, output to ``log``.

        Each process gets its own session so that :meth:`down` can kill its whole group.
        """
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.hosts[rank], *cmd],
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )
        self._procs.append(proc)
        return proc

    def kill_procs(self) -> None:
        """SIGTERM every process group started here, then SIGKILL what is left after 5 s."""
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            live = [p for p in self._procs if p.poll() is None]
            for p in live:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + grace
            for p in live:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._procs = [p for p in self._procs if p.poll() is None]

    def down(self) -> None:
        """Remove everything this cluster created (idempotent).

        SIGINT/SIGTERM/SIGHUP are held back while it runs, so a second Ctrl-C cannot cut
        the clean-up short; every step is attempted even when an earlier one fails.
        """
        if self._down:
            return
        self._down = True
        held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            steps = [self.kill_procs]
            # Anything that escaped its process group still lives inside our namespaces.
            steps += [lambda ns=ns: _kill_netns_pids(ns) for ns in self._namespaces]
            if self.bridge_ns in self._namespaces:
                steps += [
                    lambda i=i: self._run(
                        f"ip -n {self.bridge_ns} link del {self.port_ifname(i)}", check=False
                    )
                    for i in range(self.workers)
                ]
            steps += [
                lambda ns=ns: self._run(f"ip netns del {ns}", check=False)
                for ns in reversed(self._namespaces)
            ]
            for step in steps:
                try:
                    step()
                except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                    print(f"[cluster] clean-up step failed: {exc}", file=sys.stderr)
            left = [n for n in _list_netns() if n.startswith(self.run_id + "-")]
            if left:
                print(
                    f"[cluster] WARNING: could not delete namespaces {left}; "
                    "run `bench/cluster.py --cleanup-stale` after this process exits",
                    file=sys.stderr,
                )
            self._namespaces = []
        finally:
            if self in _LIVE:
                _LIVE.remove(self)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


# --------------------------------------------------------------------------- runs


@dataclass
class RunResult:
    """Outcome of one configuration."""

    strategy: str
    compression: str
    status: str
    run_dir: str
    summary: dict | None = None
    figures: dict = field(default_factory=dict)


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "NODE_RANK",
        "GROUP_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "GLOO_SOCKET_IFNAME",
        "SLURM_JOB_ID",
        "SLURM_NTASKS",
    ):
        env.pop(key, None)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        WANDB_MODE=env.get("WANDB_MODE", "offline"),
        WANDB_SILENT="true",
        HYDRA_FULL_ERROR="1",
    )
    return env


def _rank_env(cluster: EmulatedCluster, rank: int, port: int) -> dict[str, str]:
    env = _base_env()
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(cluster.workers),
        LOCAL_RANK="0",
        NODE_RANK=str(rank),
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR=cluster.addr(0),
        MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME=cluster.host_ifname,
        # The ranks train with the code of the checkout this script belongs to.
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p),
    )
    return env


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> tuple[list[int | None], bool]:
    """Wait for all; stop early if one fails. Returns (return codes, timed_out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes, False
        if any(c not in (None, 0) for c in codes):
            time.sleep(2.0)  # let the others notice and exit on their own
            return [p.poll() for p in procs], False
        time.sleep(0.2)
    return [p.poll() for p in procs], True


def _log_tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in lines[-n:])


def _last_line(path: Path, limit: int = 200) -> str:
    """The last non-empty line of a log (the one-line error of a refused config)."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:limit] if lines else ""


def merge_overrides(*groups: Iterable[str]) -> list[str]:
    """Concatenate Hydra overrides, a later one replacing an earlier one of the same key.

    Args:
        groups: override lists, in increasing precedence.

    Returns:
        One list with each key once, in the order the keys first appeared.
    """
    merged: dict[str, str] = {}
    for group in groups:
        for item in group:
            key = item.partition("=")[0].lstrip("+~")
            merged.pop(key, None)  # move to the end: position follows precedence
            merged[key] = item
    return list(merged.values())


def train_command(
    strategy: str,
    compression: str,
    workers: int,
    steps: int,
    run_dir: Path,
    workload: Sequence[str],
    extra: Sequence[str],
    epochs: int | None = None,
) -> list[str]:
    """The ``easgd-train`` command line of one rank (all ranks share it).

    Precedence, lowest first: the harness defaults (:data:`BENCH_OVERRIDES`), the
    workload, ``extra``, and last what the harness must control (run directory, strategy,
    compression, devices, nodes, and the run length: ``steps`` optimizer steps, or with
    ``epochs`` that many epochs and no step limit).
    """
    exe = Path(sys.executable).parent / "easgd-train"
    fixed = [
        f"hydra.run.dir={run_dir}",
        f"strategy={strategy}",
        f"compression={compression}",
        "trainer.devices=1",
        f"trainer.num_nodes={workers}",
    ]
    if epochs:
        fixed += [f"trainer.max_epochs={epochs}", "trainer.max_steps=-1"]
    else:
        fixed += [f"trainer.max_steps={steps}"]
    return [str(exe), *merge_overrides(BENCH_OVERRIDES, workload, extra, fixed)]


def run_spec(config: BenchConfig) -> tuple[str, str, tuple[str, ...]]:
    """What ``easgd-train`` runs for a row: the limit row is local SGD that never averages."""
    if config.key == LIMIT:
        return LIMIT_RUN[0], LIMIT_RUN[1], LIMIT_RUN[2] + config.overrides
    return config.strategy, config.compression, config.overrides


def _launch(
    cluster: EmulatedCluster,
    config: BenchConfig,
    *,
    steps: int,
    run_dir: Path,
    workload: Sequence[str],
    extra: Sequence[str],
    port: int,
    timeout_s: float,
    epochs: int | None = None,
) -> tuple[str, dict | None]:
    """One ``easgd-train`` run on every host; returns (status, summary or None)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    label = f"{config.label} ({steps} steps)"
    # One run directory for all ranks, as on a cluster's shared file system: every rank
    # writes ranks/rank<R>.json there and global rank 0 merges them into summary.json.
    strategy, compression, overrides = run_spec(config)
    # The row's own overrides come last: they are more specific than --extra.
    cmd = train_command(
        strategy,
        compression,
        cluster.workers,
        steps,
        run_dir,
        workload,
        [*extra, *overrides],
        epochs=epochs,
    )
    procs, logs = [], []
    for rank in range(cluster.workers):
        log = run_dir / "logs" / f"rank{rank}.log"
        logs.append(log)
        procs.append(cluster.spawn(rank, cmd, _rank_env(cluster, rank, port), log))
    codes, timed_out = _wait_all(procs, timeout_s)
    cluster.kill_procs()
    summary_path = run_dir / "summary.json"
    status = "ok"
    if timed_out:
        status = f"timeout after {timeout_s:.0f}s"
    elif any(c != 0 for c in codes):
        status = f"failed (rc={codes})"
    elif not summary_path.exists():
        status = "failed (no summary.json)"
    if status != "ok":
        bad = next((i for i, c in enumerate(codes) if c not in (0, None)), 0)
        reason = _last_line(logs[bad])
        if reason:
            status += f": {reason}"
        print(
            f"[cluster] {label}: {status}; rank {bad} log {logs[bad]}:\n{_log_tail(logs[bad])}",
            file=sys.stderr,
            flush=True,
        )
        return status, None
    summary = json.loads(summary_path.read_text())
    if summary.get("status", "ok") != "ok":
        status = f"failed (summary status {summary.get('status')!r})"
        print(
            f"[cluster] {label}: {status}: {summary.get('error') or summary.get('rank_errors')}",
            file=sys.stderr,
            flush=True,
        )
        return status, None
    return status, summary


def run_config(
    cluster: EmulatedCluster,
    config: BenchConfig,
    *,
    steps: int,
    warmup_steps: int,
    workload: Sequence[str],
    extra: Sequence[str],
    out_dir: Path,
    port: int,
    timeout_s: float,
) -> RunResult:
    """Run one configuration on every host and compute its figures.

    With ``warmup_steps > 0`` the configuration also runs for only ``warmup_steps`` steps,
    and the figures are the difference of the two runs (:func:`steady_figures`); the
    whole-run figures stay in ``figures["whole_run"]``.
    """
    run_dir = out_dir / config.slug
    kwargs = dict(workload=workload, extra=extra, timeout_s=timeout_s)
    status, summary = _launch(cluster, config, steps=steps, run_dir=run_dir, port=port, **kwargs)
    result = RunResult(config.strategy, config.compression, status, str(run_dir), summary)
    if summary is None:
        return result
    whole = row_from_summary(summary)
    result.figures = dict(whole)
    result.figures["measured"] = "whole run"
    if warmup_steps > 0:
        short_dir = run_dir / f"first{warmup_steps}"
        status, short = _launch(
            cluster, config, steps=warmup_steps, run_dir=short_dir, port=port + 1000, **kwargs
        )
        steady = steady_figures(summary, short) if short is not None else None
        if steady is None:
            print(
                f"[cluster] {config.label}: no steady-state figures ({status}); "
                "reporting the whole run",
                file=sys.stderr,
                flush=True,
            )
        else:
            result.figures.update(steady)
            result.figures["measured"] = f"steps {warmup_steps + 1}..{steps}"
    result.figures["whole_run"] = {k: whole[k] for k in FIGURES}
    return result


def run_tta_config(
    cluster: EmulatedCluster,
    config: BenchConfig,
    *,
    epochs: int,
    target_acc: float,
    workload: Sequence[str],
    extra: Sequence[str],
    out_dir: Path,
    port: int,
    timeout_s: float,
) -> RunResult:
    """Train one configuration for ``epochs`` epochs; figures: time to ``target_acc``.

    The time is the first entry of summary.json's ``val_history`` (one validation of the
    delivered model per epoch, timed from the start of training) at or above the target.
    """
    run_dir = out_dir / config.slug
    status, summary = _launch(
        cluster, config, steps=-1, run_dir=run_dir, port=port, workload=workload,
        extra=extra, timeout_s=timeout_s, epochs=epochs,
    )
    result = RunResult(config.strategy, config.compression, status, str(run_dir), summary)
    if summary is None:
        return result
    whole = row_from_summary(summary)
    history = summary.get("val_history") or []
    hit = time_to_target(history, target_acc)
    clock = train_clock(summary)
    steps = [s for s in whole["steps_per_rank"] if s > 0]
    accs = [h["val_acc"] for h in history if h.get("val_acc") is not None]
    result.figures = {
        "time_to_target_s": hit["time_s"] if hit else None,
        "target_step": hit["step"] if hit else None,
        "target_epoch": hit["epoch"] if hit else None,
        "best_val_acc": max(accs) if accs else None,
        "val_acc": summary.get("val_acc"),
        "train_time_s": clock,
        "step_time_s": clock / _mean(steps) if clock and steps else whole["step_time_s"],
        "bytes_per_step_per_worker": whole["bytes_per_step_per_worker"],
        "comm_share": whole["comm_share"],
        "comm_share_source": whole["comm_share_source"],
        "final_loss": whole["final_loss"],
        "steps_per_rank": whole["steps_per_rank"],
        "val_history": [
            {"time_s": h.get("time_s"), "step": h.get("step"), "val_acc": h.get("val_acc")}
            for h in history
        ],
    }
    return result


def add_tta_speedup(rows: list[dict]) -> None:
    """``speedup`` = ddp/none's time to target / the row's (None where either never got there)."""
    base = next(
        (r for r in rows if (r["strategy"], r["compression"]) == BASELINE and not r.get("overrides")
         and r.get("status") == "ok"),
        None,
    )
    ref = base.get("time_to_target_s") if base else None
    for row in rows:
        mine = row.get("time_to_target_s")
        row["speedup"] = ref / mine if ref and mine and row.get("status") == "ok" else None


def calibrate_sc17_rate(
    cluster: EmulatedCluster,
    *,
    latency_ms: float,
    steps: int,
    workload: Sequence[str],
    extra: Sequence[str],
    out_dir: Path,
    port: int,
    timeout_s: float,
    wanted: float = SC17_BASELINE_SHARE,
    max_probes: int = 4,
) -> dict:
    """Find a link rate at which ``easgd_round_robin`` communicates >= ``wanted`` of its time.

    The share is measured against the limit, not the meter: ``1 - K / T`` with T the
    round-robin step and K the step of the limit row (no communication) on the same
    hosts, both over the training clock of one ``steps``-step run. (The meter misses part
    of round-robin's waiting: workers served early wait for the busy master inside
    Lightning's unmetered per-step broadcast.) Probes 1 Gbit/s first, then the rate
    :func:`sc17_next_rate` predicts, up to ``max_probes`` rates.

    Returns:
        ``{"rate_mbit", "wanted", "reached", "limit_step_s", "probes": [{"rate_mbit",
        "step_s", "comm_share" (1 - K / T), "metered_share", "status"}]}``; the cluster is
        left shaped at the chosen rate.
    """
    cluster.shape(LinkSpec(SC17_FIRST_PROBE_MBIT, latency_ms))
    common = dict(steps=steps, workload=workload, extra=extra, timeout_s=timeout_s)
    status, summary = _launch(
        cluster, BenchConfig(*LIMIT), run_dir=out_dir / "limit", port=port, **common
    )
    limit_step = _clock_step(summary) if summary else None
    print(f"[cluster] sc17 calibration: limit step {_fmt(limit_step, 's')} s ({status})", flush=True)
    rate = SC17_FIRST_PROBE_MBIT
    probes: list[dict] = []
    chosen = None
    for k in range(max_probes if limit_step else 0):
        cluster.shape(LinkSpec(rate, latency_ms))
        status, summary = _launch(
            cluster, BenchConfig("easgd_round_robin", "none"),
            run_dir=out_dir / f"rr_{rate:g}mbit", port=port + 1 + k, **common,
        )
        step = _clock_step(summary) if summary else None
        share = 1.0 - limit_step / step if step else None
        probes.append({
            "rate_mbit": rate, "step_s": step, "comm_share": share,
            "metered_share": _run_share(summary) if summary else None, "status": status,
        })
        print(
            f"[cluster] sc17 calibration: easgd_round_robin at {rate:g} Mbit/s: step "
            f"{_fmt(step, 's')} s, 1 - limit/step = {_fmt(share, 'pct')} (metered "
            f"{_fmt(probes[-1]['metered_share'], 'pct')}) ({status})",
            flush=True,
        )
        if share is None:
            break
        chosen = rate
        if share >= wanted:
            break
        rate = sc17_next_rate(rate, max(share, 0.01), wanted)
        if rate >= chosen:
            break
    reached = bool(probes) and (probes[-1]["comm_share"] or 0.0) >= wanted
    final = chosen if chosen is not None else SC17_FIRST_PROBE_MBIT
    cluster.shape(LinkSpec(final, latency_ms))
    return {
        "rate_mbit": final, "wanted": wanted, "reached": reached,
        "limit_step_s": limit_step, "probes": probes,
    }


def _clock_step(summary: dict) -> float | None:
    """Seconds per step of one run over its training clock (wall time where it has none)."""
    steps = [int(s) for s in summary.get("steps_per_rank") or [] if s]
    clock = train_clock(summary) or summary.get("wall_time_s")
    return clock / _mean(steps) if clock and steps else None


def _run_share(summary: dict) -> float | None:
    """Metered comm share of one run over its training clock (exposed where recorded)."""
    totals = _totals(summary, "train" if train_clock(summary) is not None else "wall")
    if not totals["time"] or not totals["comm_time"]:
        return comm_share_of(summary)[0]
    return _mean(t / totals["time"] for t in totals["comm_time"])


def run_smoke(
    cluster: EmulatedCluster,
    mbytes: float,
    repeats: int,
    out_dir: Path,
    port: int,
    timeout_s: float,
) -> dict:
    """All-reduce ``mbytes`` MB over the emulated network; return timing per rank."""
    res_dir = out_dir / f"smoke_{cluster.link.rate_mbit:g}mbit_{port}"
    if res_dir.exists():
        shutil.rmtree(res_dir)
    script = Path(__file__).resolve().parent / "netns_smoke.py"
    procs = []
    for rank in range(cluster.workers):
        cmd = [
            sys.executable,
            str(script),
            "--mbytes",
            str(mbytes),
            "--repeats",
            str(repeats),
            "--out",
            str(res_dir),
            "--timeout-s",
            str(timeout_s),
        ]
        env = _rank_env(cluster, rank, port)
        procs.append(cluster.spawn(rank, cmd, env, res_dir / f"rank{rank}.log"))
    codes, timed_out = _wait_all(procs, timeout_s)
    cluster.kill_procs()
    if timed_out or any(c != 0 for c in codes):
        tail = _log_tail(res_dir / "rank0.log")
        raise RuntimeError(f"smoke all-reduce failed (rc={codes}, timeout={timed_out}):\n{tail}")
    ranks = [json.loads((res_dir / f"rank{r}.json").read_text()) for r in range(cluster.workers)]
    median = max(r["median_s"] for r in ranks)
    n = cluster.workers
    nbytes = ranks[0]["bytes"]
    # A bandwidth-optimal all-reduce moves 2 (n-1)/n of the buffer in and out of each host.
    wire = 2 * (n - 1) / n * nbytes
    return {
        "rate_mbit": cluster.link.rate_mbit,
        "latency_ms": cluster.link.latency_ms,
        "workers": n,
        "bytes": nbytes,
        "median_s": median,
        "algbw_mbit": nbytes * 8 / median / 1e6,
        "busbw_mbit": wire * 8 / median / 1e6,
        "times_s": ranks[0]["times_s"],
    }


# --------------------------------------------------------------------------- CLI


def _missing_configs(selections: Iterable[str]) -> list[str]:
    """Files of the Hydra tree that ``group=name`` selections need but that do not exist."""
    conf = REPO / "easgd_lightning" / "conf"
    missing = []
    if not (conf / "train.yaml").exists():
        missing.append("conf/train.yaml")
    for item in selections:
        key, _, value = item.partition("=")
        key = key.lstrip("+~")
        if "." not in key and (conf / key).is_dir() and not (conf / key / f"{value}.yaml").exists():
            missing.append(f"conf/{key}/{value}.yaml")
    return sorted(set(missing))


def _config_missing(config: BenchConfig) -> list[str]:
    strategy, compression, overrides = run_spec(config)
    return _missing_configs([f"strategy={strategy}", f"compression={compression}", *overrides])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Emulated cluster benchmark: N network namespaces behind a shaped bridge.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--scenario",
        default=None,
        help="preset(s), comma-separated, run one after the other: "
        + ", ".join(f"{k} ({v.description})" for k, v in SCENARIOS.items())
        + ". Default: default. The options below replace the preset's values.",
    )
    p.add_argument("--quick", action="store_true", help="same as --scenario quick")
    p.add_argument("--workers", type=int, default=None, help="hosts (default: the preset's)")
    p.add_argument(
        "--rate-mbit",
        type=float,
        default=None,
        help="link rate, Mbit/s (default: the preset's; sc17 calibrates it)",
    )
    p.add_argument("--latency-ms", type=float, default=0.1, help="one-way latency, ms")
    p.add_argument(
        "--configs",
        default=None,
        help="strategy/compression list (default: the preset's). ddp/none is always run "
        "first and, except in tta, the limit row (no communication) second",
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="also run each configuration for only this many steps and report the difference "
        "(steady state, start-up steps subtracted); 0: whole-run figures",
    )
    p.add_argument("--epochs", type=int, default=None, help="tta: epochs per run")
    p.add_argument("--target-acc", type=float, default=None, help="tta: val accuracy to reach")
    p.add_argument(
        "--workload",
        default=None,
        help="model/data Hydra overrides, space-separated (default: the preset's)",
    )
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        help="Hydra override passed to every run (repeatable; or several space-separated); "
        "added after the preset's own",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "bench" / "results",
        help="results go to OUT/<scenario>/cluster.{json,md} and OUT/<scenario>/runs/",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="per run (default: the preset's, 300-1200 s)",
    )
    p.add_argument("--port", type=int, default=29500, help="first rendezvous port")
    p.add_argument("--subnet", default="10.77.0", help="private /24 prefix behind the bridge")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="no training: time an all-reduce at --rate-mbit and at --smoke-ref-mbit",
    )
    p.add_argument("--smoke-mbytes", type=float, default=10.0)
    p.add_argument("--smoke-repeats", type=int, default=3)
    p.add_argument(
        "--smoke-ref-mbit",
        type=float,
        default=1000.0,
        help="the reference rate the smoke run compares --rate-mbit against",
    )
    p.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="JSON",
        help="re-render the markdown table of an existing cluster.json (next to it), then exit",
    )
    p.add_argument(
        "--cleanup-stale",
        action="store_true",
        help="delete namespaces left by killed runs of this script, then exit",
    )
    return p


@dataclass
class Settings:
    """One scenario's preset with the command line's replacements applied."""

    preset: Scenario
    workers: int
    rate_mbit: float | None
    workload: list[str]
    extra: list[str]
    configs: list[BenchConfig]
    steps: int
    warmup_steps: int
    epochs: int
    target_acc: float
    timeout_s: float


def scenario_names(text: str | None, quick: bool) -> list[str]:
    """The presets to run, in order (``--scenario a,b`` plus ``--quick``)."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    if quick and "quick" not in names:
        names.insert(0, "quick")
    names = names or ["default"]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(
            f"--scenario: unknown {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}"
        )
    return list(dict.fromkeys(names))


def resolve_settings(args: argparse.Namespace, preset: Scenario) -> Settings:
    """The preset, each value replaced by the command line's where one was given."""
    configs = parse_configs(args.configs or preset.configs)
    base = next((c for c in configs if c.key == BASELINE and not c.overrides), BenchConfig(*BASELINE))
    rows = [base] + [c for c in configs if c != base and c.key != LIMIT]
    if preset.kind == "throughput":
        limit = next((c for c in configs if c.key == LIMIT), BenchConfig(*LIMIT))
        rows.insert(1, limit)
    settings = Settings(
        preset=preset,
        workers=args.workers or preset.workers,
        rate_mbit=args.rate_mbit if args.rate_mbit is not None else preset.rate_mbit,
        workload=args.workload.split() if args.workload is not None else list(preset.workload),
        extra=[*preset.extra, *(tok for item in args.extra for tok in item.split())],
        configs=rows,
        steps=args.steps or preset.steps,
        warmup_steps=preset.warmup_steps if args.warmup_steps is None else args.warmup_steps,
        epochs=args.epochs or preset.epochs,
        target_acc=args.target_acc if args.target_acc is not None else preset.target_acc,
        timeout_s=args.timeout_s or preset.timeout_s,
    )
    if preset.kind == "throughput" and (
        settings.steps < 1 or not 0 <= settings.warmup_steps < settings.steps
    ):
        raise ValueError(
            f"--steps must be >= 1 and --warmup-steps in [0, --steps), got --steps "
            f"{settings.steps} --warmup-steps {settings.warmup_steps} (scenario {preset.name})"
        )
    if preset.kind == "tta" and (settings.epochs < 1 or not 0 < settings.target_acc <= 1):
        raise ValueError(
            f"--epochs must be >= 1 and --target-acc in (0, 1], got {settings.epochs} and "
            f"{settings.target_acc} (scenario {preset.name})"
        )
    return settings


def _loadavg() -> str | None:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return None


def _scenario(
    args: argparse.Namespace,
    cluster: EmulatedCluster,
    settings: Settings,
    argv: Sequence[str],
) -> dict:
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # pragma: no cover - torch is a dependency
        torch_version = None
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            check=False,
            capture_output=True,
            text=True,
        ).stdout.strip()
        or None
    )
    preset = settings.preset
    return {
        "name": preset.name,
        "kind": preset.kind,
        "description": preset.description,
        "run_id": cluster.run_id,
        "workers": cluster.workers,
        "link": cluster.describe(),
        "workload": list(settings.workload),
        "extra": list(settings.extra),
        "steps": settings.steps if preset.kind == "throughput" else None,
        "warmup_steps": settings.warmup_steps if preset.kind == "throughput" else None,
        "epochs": settings.epochs if preset.kind == "tta" else None,
        "target_acc": settings.target_acc if preset.kind == "tta" else None,
        "quick": preset.name == "quick",
        "command": " ".join(["bench/cluster.py", *argv]),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "loadavg": _loadavg(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch_version,
            "git": commit,
        },
    }


def _write(out: Path, name: str, payload: dict, markdown: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for suffix, text in (("json", json.dumps(payload, indent=2, default=str)), ("md", markdown)):
        tmp = out / f"{name}.{suffix}.tmp"
        tmp.write_text(text)
        tmp.replace(out / f"{name}.{suffix}")


def finish_table(rows: list[dict], scenario: dict, targets: Sequence[Target]) -> str:
    """Ratios, efficiency or speedup, target verdicts; returns the markdown."""
    build_table(rows)
    if scenario.get("kind") == "tta":
        add_tta_speedup(rows)
    else:
        add_efficiency(rows)
    scenario["targets"] = evaluate_targets(rows, targets)
    return render_markdown(rows, scenario)


def _print_row(row: dict, kind: str) -> None:
    if row.get("status") != "ok":
        return
    if kind == "tta":
        t = row.get("time_to_target_s")
        print(
            f"[cluster]   time to target {_fmt(t, 's') if t is not None else 'never'} s, best val_acc "
            f"{_fmt(row.get('best_val_acc'), 'num')}, step {_fmt(row.get('step_time_s'), 's')} s",
            flush=True,
        )
        return
    print(
        f"[cluster]   step {_fmt(row['step_time_s'], 's')} s, "
        f"{_fmt(row['samples_per_s'], 'num')} samples/s, "
        f"{_fmt(row['bytes_per_step_per_worker'], 'bytes')}/step/worker, "
        f"comm {_fmt(row['comm_share'], 'pct')}, "
        f"loss {_fmt(row['final_loss'], 'num')}",
        flush=True,
    )


def run_scenario(args: argparse.Namespace, settings: Settings, argv: Sequence[str]) -> tuple[int, str]:
    """Build the cluster, run every row of one scenario, write its table; (exit code, md)."""
    preset = settings.preset
    problems = _missing_configs([*settings.workload, *settings.extra]) + _config_missing(
        settings.configs[0]
    )
    if problems:
        # Without the workload or the baseline nothing can be compared: stop here.
        raise ClusterUnavailable(
            "missing Hydra configs: "
            + ", ".join(sorted(set(problems)))
            + " (pick another --workload/--extra or add them)"
        )
    out = args.out.resolve() / preset.name
    first_rate = settings.rate_mbit or SC17_FIRST_PROBE_MBIT
    link = LinkSpec(first_rate, args.latency_ms)
    with EmulatedCluster(settings.workers, link, subnet=args.subnet) as cluster:
        print(
            f"[cluster] scenario {preset.name} ({cluster.run_id}): {cluster.workers} hosts on "
            f"{args.subnet}.0/24, {link.latency_ms} ms",
            flush=True,
        )
        calibration = None
        if settings.rate_mbit is None:
            calibration = calibrate_sc17_rate(
                cluster,
                latency_ms=args.latency_ms,
                steps=settings.steps,
                workload=settings.workload,
                extra=settings.extra,
                out_dir=out / "calibration",
                port=args.port + 500,
                timeout_s=settings.timeout_s,
            )
        scenario = _scenario(args, cluster, settings, argv)
        scenario["calibration"] = calibration
        rows: list[dict] = []
        configs = settings.configs
        for k, config in enumerate(configs):
            row = {
                "strategy": config.strategy,
                "compression": config.compression,
                "overrides": list(config.overrides),
            }
            rows.append(row)
            missing = _config_missing(config)
            if missing:
                row["status"] = f"skipped ({', '.join(missing)} not found)"
                print(
                    f"[cluster] ({k + 1}/{len(configs)}) {config.label}: {row['status']}",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            print(
                f"[cluster] ({k + 1}/{len(configs)}) {config.label} "
                f"{' '.join(config.overrides)}...",
                flush=True,
            )
            common = dict(
                workload=settings.workload,
                extra=settings.extra,
                out_dir=out / "runs",
                port=args.port + k,
                timeout_s=settings.timeout_s,
            )
            if preset.kind == "tta":
                res = run_tta_config(
                    cluster, config, epochs=settings.epochs, target_acc=settings.target_acc, **common
                )
            else:
                res = run_config(
                    cluster, config, steps=settings.steps, warmup_steps=settings.warmup_steps, **common
                )
            row.update(status=res.status, run_dir=res.run_dir, **res.figures)
            _print_row(row, preset.kind)
        scenario["loadavg_after"] = _loadavg()
        md = finish_table(rows, scenario, preset.targets)
        _write(out, "cluster", {"scenario": scenario, "rows": rows}, md)
        print()
        print(md)
        print(f"[cluster] wrote {out / 'cluster.json'} and {out / 'cluster.md'}")
        return (0 if all(r["status"] == "ok" for r in rows) else 1), md


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.render is not None:
        data = json.loads(args.render.read_text())
        scenario = data["scenario"]
        preset = SCENARIOS.get(scenario.get("name", ""))
        md = finish_table(data["rows"], scenario, preset.targets if preset else ())
        args.render.with_suffix(".md").write_text(md)
        print(md)
        return 0
    if args.cleanup_stale:
        check_privileges()
        stale = cleanup_stale()
        print(f"[cluster] removed {len(stale)} stale namespace(s): {stale}")
        return 0
    names = scenario_names(args.scenario, args.quick)
    all_settings = [resolve_settings(args, SCENARIOS[n]) for n in names]

    check_privileges()
    stale = cleanup_stale(dry_run=True)
    if stale:
        print(
            f"[cluster] note: stale namespaces from killed runs: {stale} "
            "(remove with --cleanup-stale)",
            file=sys.stderr,
        )
    install_signal_handlers()
    if args.smoke:
        workers = args.workers or 4
        args.rate_mbit = args.rate_mbit or 1000.0
        link = LinkSpec(args.rate_mbit, args.latency_ms)
        with EmulatedCluster(workers, link, subnet=args.subnet) as cluster:
            settings = all_settings[0]
            scenario = _scenario(args, cluster, settings, argv)
            return _smoke(cluster, args, args.out.resolve(), scenario, settings.timeout_s)
    codes, tables = [], []
    started = time.monotonic()
    for settings in all_settings:
        t0 = time.monotonic()
        code, md = run_scenario(args, settings, argv)
        codes.append(code)
        tables.append(md + f"\n(scenario {settings.preset.name}: {time.monotonic() - t0:.0f} s)\n")
    if len(all_settings) > 1:
        text = "\n".join(tables) + f"\nTotal: {time.monotonic() - started:.0f} s\n"
        args.out.resolve().mkdir(parents=True, exist_ok=True)
        (args.out.resolve() / "summary.md").write_text(text)
        print(f"[cluster] all tables: {args.out.resolve() / 'summary.md'}")
    return max(codes)


def _smoke(
    cluster: EmulatedCluster, args: argparse.Namespace, out: Path, scenario: dict, timeout_s: float
) -> int:
    results = []
    rates = (
        [args.smoke_ref_mbit, args.rate_mbit]
        if args.smoke_ref_mbit != args.rate_mbit
        else [args.rate_mbit]
    )
    for k, rate in enumerate(rates):
        cluster.shape(LinkSpec(rate, args.latency_ms))
        res = run_smoke(
            cluster, args.smoke_mbytes, args.smoke_repeats, out / "smoke", args.port + k, timeout_s
        )
        res["latency_emulated"] = cluster.latency_emulated
        results.append(res)
        print(
            f"[smoke] {rate:g} Mbit/s: {res['bytes'] / 1e6:.1f} MB all-reduce over "
            f"{res['workers']} hosts in {res['median_s']:.3f} s (median), bus bandwidth "
            f"{res['busbw_mbit']:.1f} Mbit/s = {res['busbw_mbit'] / rate:.2f} of the link",
            flush=True,
        )
    if len(results) == 2:
        ratio = results[1]["median_s"] / results[0]["median_s"]
        print(
            f"[smoke] {rates[1]:g} Mbit/s is {ratio:.1f}x slower than {rates[0]:g} Mbit/s "
            f"(rate ratio {rates[0] / rates[1]:.1f})"
        )
    lines = [
        "# Emulated cluster smoke: gloo all-reduce",
        "",
        "| rate (Mbit/s) | hosts | MB | median s | bus bw (Mbit/s) | of link |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['rate_mbit']:g} | {r['workers']} | {r['bytes'] / 1e6:.1f} | "
            f"{r['median_s']:.3f} | {r['busbw_mbit']:.1f} | "
            f"{r['busbw_mbit'] / r['rate_mbit']:.2f} |"
        )
    _write(
        out, "cluster_smoke", {"scenario": scenario, "results": results}, "\n".join(lines) + "\n"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (2 when the emulated network is unavailable)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _main(argv)
    except ClusterUnavailable as exc:
        print(f"bench/cluster.py: cannot build the emulated cluster: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"bench/cluster.py: {exc}", file=sys.stderr)
        return 2
    except _Interrupted as exc:
        print(f"bench/cluster.py: {exc}; cleaned up", file=sys.stderr)
        return 128 + exc.signum
    finally:
        _cleanup_all()


if __name__ == "__main__":
    sys.exit(main())
