"""Run orchestration of ``bench/cluster.py``: one ``easgd-train`` process per emulated host
for each row (the long and the short run of the steady-state subtraction), time-to-accuracy
runs, the sc17 link-rate calibration and the ``--smoke`` network check."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench._netem import EmulatedCluster, LinkSpec
from bench._scenarios import (
    LIMIT,
    LIMIT_RUN,
    REPO,
    SC17_BASELINE_SHARE,
    SC17_FIRST_PROBE_MBIT,
    BenchConfig,
)
from bench._tables import (
    FIGURES,
    comm_share_of,
    fmt_figure,
    mean_or_none,
    row_from_summary,
    run_totals,
    steady_cpu,
    steady_figures,
    time_to_target,
    train_clock,
)
from easgd_lightning.config_tree import CONF_DIR, group_dir
from easgd_lightning.utils.rank_env import clean_env, rank_env


def loadavg() -> str | None:
    """The machine's load average (1, 5, 15 min) as /proc/loadavg has it; None elsewhere."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return None


# Defaults of every benchmark run (each can be replaced through --extra KEY=VALUE): no
# logger, no checkpoint files, no progress bar, and as many epochs as --steps needs.
BENCH_OVERRIDES = (
    "trainer.accelerator=cpu",
    "trainer.max_epochs=-1",
    "trainer.enable_progress_bar=false",
    "logger=none",
    "checkpoint.enabled=false",
)


def sc17_next_rate(
    rate_mbit: float, share: float, wanted: float, margin: float = 0.85, max_drop: float = 10.0
) -> float:
    """The next link rate to probe so that round-robin EASGD reaches ``wanted`` comm share.

    Model: per step, compute K is fixed and communication C scales with 1 / rate, so the
    share s = C / (C + K) has odds s / (1 - s) proportional to 1 / rate. The rate that
    gives the wanted odds is ``rate * odds(share) / odds(wanted)``; ``margin`` (< 1) aims
    a little below it, never more than ``max_drop`` times below ``rate_mbit``, and the
    result is rounded down to two significant digits. (The cap: with more ranks than cores
    the limit step, every rank computing at once, can be longer than round-robin's, whose
    workers take turns; the share then reads <= 0, which says nothing about the odds -- 8
    hosts on 2 cores at 1 Gbit/s read -34%, and the odds model sent the next probe to
    1.2 Mbit/s.)

    Args:
        rate_mbit: the rate just probed.
        share: the comm share measured there (clipped to [0.01, 0.99]).
        wanted: the comm share to reach.
        margin: factor applied to the model's rate.
        max_drop: the next rate is at least ``rate_mbit / max_drop``.

    Returns:
        The next rate in Mbit/s (at least 1).
    """
    s = min(max(share, 0.01), 0.99)
    odds = s / (1.0 - s)
    target_odds = wanted / (1.0 - wanted)
    rate = max(rate_mbit * odds / target_odds * margin, rate_mbit / max_drop)
    if rate <= 1.0:
        return 1.0
    digits = 10 ** (len(str(int(rate))) - 2)
    return float(max(1, int(rate // digits) * digits))


@dataclass
class RunResult:
    """Outcome of one configuration."""

    strategy: str
    compression: str
    status: str
    run_dir: str
    summary: dict | None = None
    figures: dict = field(default_factory=dict)


def host_rank_env(cluster: EmulatedCluster, rank: int, port: int) -> dict[str, str]:
    """One rank: its host is its node (``procs_per_host`` ranks each, torchrun's
    ``LOCAL_RANK`` / ``NODE_RANK`` / ``LOCAL_WORLD_SIZE``), rendezvous at host 0, gloo on
    the emulated link, the checkout this script belongs to first on ``PYTHONPATH``."""
    env = clean_env(repo=REPO, HYDRA_FULL_ERROR="1", GLOO_SOCKET_IFNAME=cluster.host_ifname)
    pph = cluster.procs_per_host
    if pph == 1:
        return rank_env(env, rank, cluster.workers, port, addr=cluster.addr(0), node_per_rank=True)
    out = rank_env(env, rank, cluster.world_size, port, addr=cluster.addr(0))
    out.update(
        LOCAL_RANK=str(rank % pph), NODE_RANK=str(cluster.host_of(rank)), LOCAL_WORLD_SIZE=str(pph)
    )
    return out


def wait_all(procs: list[subprocess.Popen], timeout_s: float,
             tend: Callable[[], None] | None = None) -> tuple[list[int | None], bool]:
    """Wait for all; stop early if one fails. ``tend`` runs at every poll (every 0.2 s).
    Returns (return codes, timed_out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if tend is not None:
            tend()
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes, False
        if any(c not in (None, 0) for c in codes):
            time.sleep(2.0)  # let the others notice and exit on their own
            return [p.poll() for p in procs], False
        time.sleep(0.2)
    return [p.poll() for p in procs], True


def log_tail(path: Path, n: int = 15) -> str:
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
    procs_per_host: int = 1,
) -> list[str]:
    """The ``easgd-train`` command line of one rank (all ranks share it); ``workers`` hosts
    (``trainer.num_nodes``) of ``procs_per_host`` processes (``trainer.devices``).

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
        f"trainer.devices={procs_per_host}",
        f"trainer.num_nodes={workers}",
    ]
    if epochs:
        fixed += [f"trainer.max_epochs={epochs}", "trainer.max_steps=-1"]
    else:
        fixed += [f"trainer.max_steps={steps}"]
    return [str(exe), *merge_overrides(BENCH_OVERRIDES, workload, extra, fixed)]


#: the bridge namespace's address of the switch's aggregator (last host of the /24)
SWITCH_HOST = 254


def switch_row(cluster: EmulatedCluster, overrides: Sequence[str]) -> bool:
    """Whether a row runs on the switch's aggregator: ``comm.allreduce=switch`` in its
    overrides and the cluster built with ``--aggregator switch`` (else rank 0 starts the
    aggregator process beside itself on host 0, as outside the bench)."""
    return bool(getattr(cluster, "switch_addr", None)) and "comm.allreduce=switch" in overrides


def place_switch_aggregator(cluster: EmulatedCluster) -> str:
    """Give the bridge (the emulated switch) an address on the hosts' /24: the aggregator
    runs there, on the switch's own interface, which no ``tc`` shapes (a switch
    backplane); each host's traffic to it still passes the host's shaped link both ways."""
    addr = f"{cluster.subnet}.{SWITCH_HOST}"
    cluster._run(f"ip -n {cluster.bridge_ns} addr add {addr}/24 dev br0")
    cluster.switch_addr = addr
    return addr


def start_switch_aggregator(cluster: EmulatedCluster, port: int, log: Path, timeout_s: float) -> subprocess.Popen:
    """Start ``python -m easgd_lightning.comm.switch`` in the bridge namespace for one run
    (it joins the run's rendezvous store on host 0 and exits when the workers close)."""
    env = clean_env(repo=REPO, GLOO_SOCKET_IFNAME="br0")
    cmd = [
        sys.executable, "-m", "easgd_lightning.comm.switch", "--addr", cluster.addr(0),
        "--port", str(port), "--workers", str(cluster.world_size), "--timeout-s", str(timeout_s),
    ]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", cluster.bridge_ns, *cmd], stdout=fh, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, cwd=REPO, start_new_session=True,
        )
    cluster._procs.append(proc)  # killed with the run's processes
    return proc


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
        procs_per_host=cluster.procs_per_host,
    )
    procs, logs = [], []
    switch = switch_row(cluster, [*extra, *overrides])
    if switch:  # NetReduce emulated: the aggregator at the switch (python -m bench.cluster --aggregator switch)
        cmd = [*cmd, "comm.aggregator=external"]
        start_switch_aggregator(cluster, port, run_dir / "logs" / "switch.log", timeout_s)
    for rank in range(cluster.world_size):
        log = run_dir / "logs" / f"rank{rank}.log"
        logs.append(log)
        procs.append(cluster.spawn(cluster.host_of(rank), cmd, host_rank_env(cluster, rank, port), log))
    codes, timed_out = wait_all(procs, timeout_s, tend=lambda: cluster.comm_first(procs))
    cluster.kill_procs()
    return _outcome(label, run_dir, logs, codes, timed_out, timeout_s)


def _outcome(label: str, run_dir: Path, logs: list[Path], codes: list[int | None], timed_out: bool,
             timeout_s: float) -> tuple[str, dict | None]:
    """(status, summary or None) of a finished run: a timeout, a rank's exit status, a
    missing summary.json or a summary that is not ``ok`` is a failure, said on stderr with
    the first failed rank's last lines."""
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
            f"[cluster] {label}: {status}; rank {bad} log {logs[bad]}:\n{log_tail(logs[bad])}",
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
            result.figures["cpu"] = steady_cpu(summary, short, steps - warmup_steps, os.cpu_count() or 1)
    result.figures["whole_run"] = {k: whole[k] for k in FIGURES}
    return result


def bytes_to_target(whole: dict, hit: dict | None) -> float | None:
    """Bytes one worker sent until the validation that reached the target (None: never)."""
    per_step = whole.get("bytes_per_step_per_worker")
    return per_step * hit["step"] if hit and per_step is not None and hit.get("step") else None


def peak_exchange(summary: dict) -> int | None:
    """The largest single exchange's dense bytes, where the strategy reports it (diloco)."""
    extras = summary.get("extras") or [{}]
    first = extras[0] if isinstance(extras, list) and extras else {}
    return first.get("peak_exchange_dense_bytes") if isinstance(first, dict) else None


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
        "bytes_to_target": bytes_to_target(whole, hit),
        "peak_exchange_bytes": peak_exchange(summary),
        "val_acc": summary.get("val_acc"),
        "train_time_s": clock,
        "step_time_s": clock / mean_or_none(steps) if clock and steps else whole["step_time_s"],
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
    print(f"[cluster] sc17 calibration: limit step {fmt_figure(limit_step, 's')} s ({status})", flush=True)
    rate = SC17_FIRST_PROBE_MBIT
    probes: list[dict] = []
    chosen = None
    for k in range(max_probes if limit_step else 0):
        cluster.shape(LinkSpec(rate, latency_ms))
        probes.append(_round_robin_probe(cluster, rate, limit_step, out_dir / f"rr_{rate:g}mbit",
                                         port + 1 + k, common))
        share = probes[-1]["comm_share"]
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


def _round_robin_probe(cluster: EmulatedCluster, rate: float, limit_step: float, run_dir: Path,
                       port: int, common: dict) -> dict:
    """One ``easgd_round_robin`` run of :func:`calibrate_sc17_rate` at ``rate`` (the links
    shaped already): its step, its share 1 - limit / step, and its metered share."""
    status, summary = _launch(cluster, BenchConfig("easgd_round_robin", "none"), run_dir=run_dir,
                              port=port, **common)
    step = _clock_step(summary) if summary else None
    share = 1.0 - limit_step / step if step else None
    metered = _run_share(summary) if summary else None
    print(
        f"[cluster] sc17 calibration: easgd_round_robin at {rate:g} Mbit/s: step "
        f"{fmt_figure(step, 's')} s, 1 - limit/step = {fmt_figure(share, 'pct')} (metered "
        f"{fmt_figure(metered, 'pct')}) ({status})",
        flush=True,
    )
    return {"rate_mbit": rate, "step_s": step, "comm_share": share, "metered_share": metered, "status": status}


def _clock_step(summary: dict) -> float | None:
    """Seconds per step of one run over its training clock (wall time where it has none)."""
    steps = [int(s) for s in summary.get("steps_per_rank") or [] if s]
    clock = train_clock(summary) or summary.get("wall_time_s")
    return clock / mean_or_none(steps) if clock and steps else None


def _run_share(summary: dict) -> float | None:
    """Metered comm share of one run over its training clock (exposed where recorded)."""
    totals = run_totals(summary, "train" if train_clock(summary) is not None else "wall")
    if not totals["time"] or not totals["comm_time"]:
        return comm_share_of(summary)[0]
    return mean_or_none(t / totals["time"] for t in totals["comm_time"])


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
    procs = []
    for rank in range(cluster.workers):
        cmd = [
            sys.executable,
            "-m",
            "bench.netns_smoke",
            "--mbytes",
            str(mbytes),
            "--repeats",
            str(repeats),
            "--out",
            str(res_dir),
            "--timeout-s",
            str(timeout_s),
        ]
        env = host_rank_env(cluster, rank, port)
        procs.append(cluster.spawn(rank, cmd, env, res_dir / f"rank{rank}.log"))
    codes, timed_out = wait_all(procs, timeout_s)
    cluster.kill_procs()
    if timed_out or any(c != 0 for c in codes):
        tail = log_tail(res_dir / "rank0.log")
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
        "cpu": smoke_cpu_shares(ranks[0].get("cpu")),
    }


def smoke_cpu_shares(cpu: dict | None) -> dict | None:
    """The machine's cores over the timed all-reduces (rank 0's /proc/stat window):
    ``busy_share`` (not idle), ``kernel_share`` (system, interrupts, steal) and ``user_share``
    of all cores' time; None without a reading."""
    host = (cpu or {}).get("host")
    total = sum(host.values()) if host else 0.0
    if not total:
        return None
    kernel = host["system"] + host["irq"] + host["softirq"] + host["steal"]
    return {"busy_share": 1.0 - (host["idle"] + host["iowait"]) / total,
            "kernel_share": kernel / total, "user_share": (host["user"] + host["nice"]) / total}


def missing_configs(selections: Iterable[str]) -> list[str]:
    """Files of the Hydra tree that ``group=name`` selections need but that do not exist."""
    conf = Path(CONF_DIR)
    missing = []
    if not (conf / "train.yaml").exists():
        missing.append("conf/train.yaml")
    for item in selections:
        key, _, value = item.partition("=")
        key = key.lstrip("+~")
        options = group_dir(key)
        if "." not in key and options.is_dir() and not (options / f"{value}.yaml").exists():
            missing.append(f"{'recipes' if key == 'recipe' else 'conf/' + key}/{value}.yaml")
    return sorted(set(missing))


def config_missing(config: BenchConfig) -> list[str]:
    strategy, compression, overrides = run_spec(config)
    return missing_configs([f"strategy={strategy}", f"compression={compression}", *overrides])
