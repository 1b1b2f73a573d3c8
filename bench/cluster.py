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

Usage (as root)::

    .venv/bin/python bench/cluster.py --quick
    .venv/bin/python bench/cluster.py                       # the default scenario
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
    "BenchConfig",
    "ClusterUnavailable",
    "EmulatedCluster",
    "LinkSpec",
    "RunResult",
    "build_table",
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

# DGC is measured at its final sparsity (no warm-up) and, as its config asks, with the
# momentum inside the compressor rather than in the optimizer.
DEFAULT_CONFIGS = (
    "ddp/none,ddp/fp16,ddp/dgc;compression.warmup_ratio_steps=0;optim.momentum=0,ddp/powersgd,"
    "sync_easgd/none,easgd_round_robin/none,sync_easgd/topk,async_easgd/none"
)
QUICK_CONFIGS = "ddp/none,sync_easgd/none"
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
QUICK_WORKLOAD: tuple[str, ...] = ()  # the CLI's default: small MLP on digits
DEFAULT_STEPS = 20
# The default scenario also runs each configuration for 2 steps and reports the difference.
DEFAULT_WARMUP_STEPS = 2
# Defaults of every benchmark run (each can be replaced through --extra KEY=VALUE): no
# logger, no checkpoint files, no progress bar, and as many epochs as --steps needs.
BENCH_OVERRIDES = (
    "trainer.accelerator=cpu",
    "trainer.max_epochs=-1",
    "trainer.enable_progress_bar=false",
    "logger=none",
    "checkpoint.enabled=false",
)
QUICK_STEPS = 100

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


def _mean(values: Iterable[float]) -> float | None:
    vals = [float(v) for v in values]
    return statistics.fmean(vals) if vals else None


def row_from_summary(summary: dict) -> dict:
    """Figures of one run, read from its ``summary.json`` (DESIGN.md 4.2).

    * ``step_time_s``: ``wall_time_s`` / mean of ``steps_per_rank`` over ranks that stepped
      (for asynchronous strategies the ranks' step counts differ; a pure server rank that
      takes no optimizer steps is left out).
    * ``samples_per_s``: as reported.
    * ``bytes_per_step_per_worker``: all ranks' ``comm.bytes_sent`` summed, divided by all
      ranks' steps summed (for synchronous strategies: one rank's bytes per step; for a
      parameter server it charges the server's replies to the workers' steps).
    * ``comm_share``: ``comm.time_fraction``.
    * ``final_loss``: ``train_loss``.

    Args:
        summary: the parsed summary.json.

    Returns:
        A dict with the five figures (``None`` where the summary lacks the field).
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
    return {
        "step_time_s": step_time,
        "samples_per_s": summary.get("samples_per_s"),
        "bytes_per_step_per_worker": bytes_per_step,
        "comm_share": comm.get("time_fraction"),
        "final_loss": summary.get("train_loss"),
        "steps_per_rank": steps,
        "wall_time_s": wall,
        "val_acc": summary.get("val_acc"),
    }


def _totals(summary: dict) -> dict:
    """Whole-run totals of one summary, the quantities :func:`steady_figures` subtracts."""
    steps = [int(s) if s is not None else 0 for s in summary.get("steps_per_rank") or []]
    comm = summary.get("comm") or {}
    wall = float(summary.get("wall_time_s") or 0.0)
    return {
        "wall": wall,
        "steps": steps,
        "samples": float(summary.get("samples_per_s") or 0.0) * wall,
        "sent": [int(b or 0) for b in comm.get("bytes_sent") or []],
        "comm_time": [float(t or 0.0) for t in comm.get("time_s") or []],
    }


def steady_figures(long: dict, short: dict) -> dict | None:
    """Per-step figures with the start-up steps subtracted out.

    Two runs of one configuration that differ only in their number of steps (``short``
    takes the first few, ``long`` all of them) share their start-up costs: DDP's bucket
    rebuild and the compression hooks' dense first iterations, lazy allocations, the first
    rendezvous of every collective. Their difference is the steady state:
    ``step_time = (wall_L - wall_S) / (steps_L - steps_S)``, and likewise for bytes (summed
    over ranks, per step summed over ranks), samples/s and each rank's communication time
    over the wall-time difference.

    Args:
        long: summary.json of the full run.
        short: summary.json of the short run of the same configuration.

    Returns:
        The figures as :func:`row_from_summary` names them (``final_loss`` from ``long``),
        or ``None`` when the difference is not positive (then use the whole-run figures).
    """
    a, b = _totals(long), _totals(short)
    if len(a["steps"]) != len(b["steps"]):
        return None
    d_wall = a["wall"] - b["wall"]
    d_steps = [x - y for x, y in zip(a["steps"], b["steps"])]
    stepping = [d for x, d in zip(a["steps"], d_steps) if x > 0]
    mean_steps = _mean(stepping)
    if d_wall <= 0 or not mean_steps or mean_steps <= 0 or sum(stepping) <= 0:
        return None
    d_sent = sum(a["sent"]) - sum(b["sent"])
    fractions = [(x - y) / d_wall for x, y in zip(a["comm_time"], b["comm_time"])]
    return {
        "step_time_s": d_wall / mean_steps,
        "samples_per_s": (a["samples"] - b["samples"]) / d_wall,
        "bytes_per_step_per_worker": d_sent / sum(stepping),
        # Not clipped: asynchronous collectives in flight at once (DDP's buckets during the
        # backward pass) each count their own launch-to-completion time, so the sum can
        # exceed the wall time; above 100% means communication overlapped itself.
        "comm_share": _mean(fractions) if fractions else None,
        "final_loss": long.get("train_loss"),
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
    return f"{value:.4g}"


def render_markdown(rows: list[dict], scenario: dict) -> str:
    """Render the table (and a scenario header) as markdown.

    Args:
        rows: the output of :func:`build_table`.
        scenario: the run's scenario dict (workers, link, workload, ...).

    Returns:
        Markdown text.
    """
    link = scenario["link"]
    lat = f"{link['latency_ms']} ms one-way"
    if link["latency_ms"] > 0 and not link.get("latency_emulated"):
        lat += " requested, NOT emulated (sch_netem missing in this kernel)"
    workload = " ".join(scenario["workload"]) or "(CLI defaults)"
    extra = " ".join(scenario["extra"]) or "-"
    machine = scenario["machine"]
    lines = [
        f"# Emulated cluster: {scenario['workers']} workers, {link['rate_mbit']} Mbit/s, {lat}",
        "",
        f"- workload: `{workload}`, steps: {scenario['steps']}, extra: `{extra}`",
        (
            f"- figures per step over steps {scenario['warmup_steps'] + 1}..{scenario['steps']}"
            f" (a {scenario['warmup_steps']}-step run of each configuration subtracted)"
            if scenario.get("warmup_steps")
            else "- figures over the whole run (first steps included)"
        ),
        f"- machine: {machine['cpus']} CPUs, {machine['platform']}, {scenario['date']}",
        f"- command: `{scenario['command']}`",
        (
            "- ratio = value / value of ddp/none in this run (step time < 1x and samples/s > 1x"
            " are faster; bytes ratio = 1 / compression factor)"
        ),
        "",
        (
            "| strategy/compression | step time (s) | x | samples/s | x | bytes/step/worker | x"
            " | comm share | x | final loss | x | status |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        q = r.get("ratio", {})
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{r['strategy']}/{r['compression']}"
                    + (f" `{' '.join(r['overrides'])}`" if r.get("overrides") else ""),
                    _fmt(r.get("step_time_s"), "s"),
                    _fmt(q.get("step_time_s"), "ratio"),
                    _fmt(r.get("samples_per_s"), "num"),
                    _fmt(q.get("samples_per_s"), "ratio"),
                    _fmt(r.get("bytes_per_step_per_worker"), "bytes"),
                    _fmt(q.get("bytes_per_step_per_worker"), "ratio"),
                    _fmt(r.get("comm_share"), "pct"),
                    _fmt(q.get("comm_share"), "ratio"),
                    _fmt(r.get("final_loss"), "num"),
                    _fmt(q.get("final_loss"), "ratio"),
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
    return "\n".join(lines) + "\n"


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
) -> list[str]:
    """The ``easgd-train`` command line of one rank (all ranks share it).

    Precedence, lowest first: the harness defaults (:data:`BENCH_OVERRIDES`), the
    workload, ``extra``, and last what the harness must control (run directory, strategy,
    compression, devices, nodes, steps).
    """
    exe = Path(sys.executable).parent / "easgd-train"
    fixed = [
        f"hydra.run.dir={run_dir}",
        f"strategy={strategy}",
        f"compression={compression}",
        "trainer.devices=1",
        f"trainer.num_nodes={workers}",
        f"trainer.max_steps={steps}",
    ]
    return [str(exe), *merge_overrides(BENCH_OVERRIDES, workload, extra, fixed)]


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
) -> tuple[str, dict | None]:
    """One ``easgd-train`` run on every host; returns (status, summary or None)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    label = f"{config.label} ({steps} steps)"
    # One run directory for all ranks, as on a cluster's shared file system: every rank
    # writes ranks/rank<R>.json there and global rank 0 merges them into summary.json.
    cmd = train_command(
        config.strategy,
        config.compression,
        cluster.workers,
        steps,
        run_dir,
        workload,
        [*config.overrides, *extra],
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
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
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
    conf = REPO / "conf"
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
    return _missing_configs(
        [f"strategy={config.strategy}", f"compression={config.compression}", *config.overrides]
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Emulated cluster benchmark: N network namespaces behind a shaped bridge.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workers", type=int, default=None, help="hosts (default 4; --quick: 2)")
    p.add_argument("--rate-mbit", type=float, default=1000.0, help="link rate, Mbit/s")
    p.add_argument("--latency-ms", type=float, default=0.1, help="one-way latency, ms")
    p.add_argument(
        "--configs",
        default=None,
        help=f"strategy/compression list (default: {DEFAULT_CONFIGS}; --quick: {QUICK_CONFIGS})",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"optimizer steps per run (default {DEFAULT_STEPS}; --quick {QUICK_STEPS})",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="also run each configuration for only this many steps and report the difference "
        "(steady state, start-up steps subtracted); 0: whole-run figures "
        f"(default {DEFAULT_WARMUP_STEPS}; --quick 0)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 workers, the CLI's small digits MLP, ddp/none + sync_easgd/none",
    )
    p.add_argument(
        "--workload",
        default=None,
        help="model/data Hydra overrides, space-separated (default: "
        f"'{' '.join(DEFAULT_WORKLOAD)}'; --quick: CLI defaults)",
    )
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        help="Hydra override passed to every run (repeatable; or several space-separated)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=REPO / "bench" / "results",
        help="where cluster.{json,md} and the run directories go",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="per configuration (default 1800; --quick 300)",
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


def _scenario(
    args: argparse.Namespace,
    cluster: EmulatedCluster,
    workload: Sequence[str],
    extra: Sequence[str],
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
    return {
        "run_id": cluster.run_id,
        "workers": cluster.workers,
        "link": cluster.describe(),
        "workload": list(workload),
        "extra": list(extra),
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "quick": args.quick,
        "command": " ".join(["bench/cluster.py", *argv]),
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
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


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.render is not None:
        data = json.loads(args.render.read_text())
        md = render_markdown(build_table(data["rows"]), data["scenario"])
        args.render.with_suffix(".md").write_text(md)
        print(md)
        return 0
    if args.cleanup_stale:
        check_privileges()
        stale = cleanup_stale()
        print(f"[cluster] removed {len(stale)} stale namespace(s): {stale}")
        return 0
    args.workers = args.workers or (2 if args.quick else 4)
    args.steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    if args.warmup_steps is None:
        args.warmup_steps = 0 if args.quick else DEFAULT_WARMUP_STEPS
    if args.steps < 1 or not 0 <= args.warmup_steps < args.steps:
        raise ValueError(
            f"--steps must be >= 1 and --warmup-steps in [0, --steps), got --steps "
            f"{args.steps} --warmup-steps {args.warmup_steps}"
        )
    timeout_s = args.timeout_s or (300.0 if args.quick else 1800.0)
    link = LinkSpec(args.rate_mbit, args.latency_ms)
    configs = parse_configs(args.configs or (QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS))
    base = next((c for c in configs if c.key == BASELINE and not c.overrides), None)
    if base is None:
        base = BenchConfig(*BASELINE)
        print("[cluster] added ddp/none: every ratio is taken against it", flush=True)
    else:
        configs.remove(base)
    configs.insert(0, base)  # the baseline runs first
    if args.workload is not None:
        workload = args.workload.split()
    else:
        workload = list(QUICK_WORKLOAD if args.quick else DEFAULT_WORKLOAD)
    extra = [tok for item in args.extra for tok in item.split()]

    check_privileges()
    if not args.smoke:
        # Without the workload or the baseline nothing can be compared: stop here.
        problems = _missing_configs([*workload, *extra]) + _config_missing(base)
        if problems:
            raise ClusterUnavailable(
                "missing Hydra configs: "
                + ", ".join(sorted(set(problems)))
                + " (pick another --workload/--extra or add them)"
            )
    stale = cleanup_stale(dry_run=True)
    if stale:
        print(
            f"[cluster] note: stale namespaces from killed runs: {stale} "
            "(remove with --cleanup-stale)",
            file=sys.stderr,
        )

    install_signal_handlers()
    out = args.out.resolve()
    with EmulatedCluster(args.workers, link, subnet=args.subnet) as cluster:
        print(
            f"[cluster] {cluster.run_id}: {cluster.workers} hosts on {args.subnet}.0/24, "
            f"{link.rate_mbit} Mbit/s, {link.latency_ms} ms",
            flush=True,
        )
        scenario = _scenario(args, cluster, workload, extra, argv)
        if args.smoke:
            return _smoke(cluster, args, out, scenario, timeout_s)
        rows: list[dict] = []
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
            res = run_config(
                cluster,
                config,
                steps=args.steps,
                warmup_steps=args.warmup_steps,
                workload=workload,
                extra=extra,
                out_dir=out / "cluster_runs",
                port=args.port + k,
                timeout_s=timeout_s,
            )
            row.update(status=res.status, run_dir=res.run_dir, **res.figures)
            if res.status == "ok":
                print(
                    f"[cluster]   step {_fmt(row['step_time_s'], 's')} s, "
                    f"{_fmt(row['samples_per_s'], 'num')} samples/s, "
                    f"{_fmt(row['bytes_per_step_per_worker'], 'bytes')}/step/worker, "
                    f"comm {_fmt(row['comm_share'], 'pct')}, "
                    f"loss {_fmt(row['final_loss'], 'num')}",
                    flush=True,
                )
        build_table(rows)
        md = render_markdown(rows, scenario)
        _write(out, "cluster", {"scenario": scenario, "rows": rows}, md)
        print()
        print(md)
        print(f"[cluster] wrote {out / 'cluster.json'} and {out / 'cluster.md'}")
        return 0 if all(r["status"] == "ok" for r in rows) else 1


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
