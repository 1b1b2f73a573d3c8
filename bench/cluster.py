"""Emulated cluster on one machine: network namespaces, a bridge and shaped links.

Builds N "hosts" as Linux network namespaces, each with one veth link into a bridge that
lives in its own namespace, shapes every link with ``tc`` (a token bucket at the chosen
rate, plus a ``netem`` delay when the kernel has it), runs one ``easgd-train`` process per
host over gloo/TCP with the rendezvous on host 0's private address, and tabulates each
(strategy, compression) configuration against the best dense row measured in the same run
(the fastest of ``ddp/none``, ``ddp/bf16``, ``ddp/fp16``; the table names it) and against
``ddp/none``.

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
its time; ``--hosts 8`` for 8 hosts), ``optimus`` (pipeline_3d with and without Optimus-CC),
``tta`` (time to a validation accuracy) and others; each prints its targets as PASS/MISS.

Usage (as root)::

    .venv/bin/python -m bench.cluster --quick
    .venv/bin/python -m bench.cluster                       # the default scenario
    .venv/bin/python -m bench.cluster --scenario quick,default,sc17,tta
    .venv/bin/python -m bench.cluster --workers 4 --rate-mbit 100 --latency-ms 1 \\
        --configs "ddp/none,ddp/powersgd,ddp/dgc;optim.momentum=0" --steps 50 \
        --extra "optim.lr=0.01"
    .venv/bin/python -m bench.cluster --workers 4 --rate-mbit 1000 --configs ddp/none \\
        --aggregator switch                                  # NetReduce emulated vs ring
    .venv/bin/python -m bench.cluster --smoke               # network check, no training
    .venv/bin/python -m bench.cluster --cleanup-stale       # after a SIGKILLed run

Exit codes: 0 all configurations ran; 1 some configuration failed, timed out or was
skipped (its config file is missing); 2 the emulated network cannot be built here (no
root / CAP_NET_ADMIN, ``ip netns add`` refused, missing tools) or the workload or the
``ddp/none`` baseline config is missing; 128+N after signal N (everything cleaned up).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench._netem import (  # noqa: F401
    COMPUTE_NICE,
    JUMBO_MTU,
    PREFIX,
    ClusterUnavailable,
    EmulatedCluster,
    Interrupted,
    LinkSpec,
    check_privileges,
    cleanup_all,
    cleanup_stale,
    install_signal_handlers,
    tbf_params,
)
from bench._runs import (  # noqa: F401
    BENCH_OVERRIDES,
    RunResult,
    calibrate_sc17_rate,
    config_missing,
    loadavg,
    merge_overrides,
    missing_configs,
    place_switch_aggregator,
    run_config,
    run_smoke,
    run_spec,
    run_tta_config,
    sc17_next_rate,
    train_command,
)
from bench._scenarios import (  # noqa: F401
    BASELINE,
    DEFAULT_WORKLOAD,
    DGC_ROW,
    LIMIT,
    LIMIT_RUN,
    REPO,
    SC17_BASELINE_SHARE,
    SC17_BLOCKING,
    SC17_FIRST_PROBE_MBIT,
    SC17_OVERLAPPED,
    SCENARIOS,
    TTA_CONFIGS,
    WIDE_MLP_WORKLOAD,
    BenchConfig,
    Scenario,
    Target,
    parse_configs,
)
from bench._tables import (  # noqa: F401
    FIGURES,
    add_efficiency,
    add_tta_speedup,
    build_table,
    comm_share_of,
    evaluate_targets,
    finish_table,
    fmt_figure,
    render_markdown,
    render_tta_markdown,
    row_from_summary,
    row_spec,
    sc17_projection,
    steady_figures,
    time_to_target,
    tokens_per_s,
    train_clock,
)

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


#: the row ``--aggregator switch`` adds: DDP's dense all-reduce through the switch
SWITCH_ROW = BenchConfig("ddp", "none", ("comm.allreduce=switch",))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Emulated cluster benchmark: N network namespaces behind a shaped bridge.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    _scenario_options(p)
    _run_options(p)
    _harness_options(p)
    _other_modes(p)
    return p


def _scenario_options(p: argparse.ArgumentParser) -> None:
    """The preset and what replaces its cluster shape and rows."""
    p.add_argument(
        "--scenario",
        default=None,
        help="preset(s), comma-separated, run one after the other: "
        + ", ".join(f"{k} ({v.description})" for k, v in SCENARIOS.items()).replace("%", "%%")
        + ". Default: default. The options below replace the preset's values.",
    )
    p.add_argument("--quick", action="store_true", help="same as --scenario quick")
    p.add_argument("--workers", "--hosts", dest="workers", type=int, default=None,
                   help="hosts (default: the preset's; --hosts is the same option)")
    p.add_argument(
        "--procs-per-host",
        type=int,
        default=None,
        help="training processes per host (default: the preset's, 1); ranks of one host talk "
        "over its loopback, hosts over the shaped link",
    )
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
    p.add_argument(
        "--only-configs",
        action="store_true",
        help="run exactly the --configs rows, in order: no ddp/none baseline and no limit row "
        "added (ratios and efficiency then blank, targets that need those rows n/a); for "
        "checks that read only the rows they name",
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


def _run_options(p: argparse.ArgumentParser) -> None:
    """What every run of a row gets: workload, extra overrides, output, time limit."""
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


def _harness_options(p: argparse.ArgumentParser) -> None:
    """How the harness runs the ranks: the switch aggregator, forked ranks, ports, subnet."""
    p.add_argument(
        "--aggregator",
        choices=("none", "switch"),
        default="none",
        help="switch: NetReduce emulated: an aggregator process at the emulated switch (the "
        "bridge namespace, its port unshaped) sums the dense gradients of the rows with "
        "comm.allreduce=switch; a row ddp/none;comm.allreduce=switch is added after ddp/none",
    )
    p.add_argument(
        "--fork-ranks",
        action="store_true",
        help="fork each easgd-train rank from a fork server per host (started in its namespace, "
        "having imported the command's modules once) instead of starting a fresh interpreter: "
        "seconds less per rank on a small machine; for checks of what the rows do (the tests), "
        "not of a rank's own start and exit",
    )
    p.add_argument("--port", type=int, default=29500, help="first rendezvous port")
    p.add_argument(
        "--costmodel",
        type=Path,
        default=REPO / "bench" / "results" / "costmodel" / "costmodel.json",
        help="sc17: the cost model's costmodel.json (or costmodel_inputs.json) whose projection's "
        "SC17 row the table prints (default: python -m bench.costmodel's output)",
    )
    p.add_argument("--subnet", default="10.77.0", help="private /24 prefix behind the bridge")
    p.add_argument(
        "--mtu",
        type=int,
        default=JUMBO_MTU,
        help=f"frame payload of every emulated link, bytes (default {JUMBO_MTU}: jumbo frames, "
        "a third of the kernel's CPU per byte of Ethernet's 1500, which the emulated hosts' "
        "kernels spend on the training's own cores; 1500 reproduces tables before 2026-12-06)",
    )
    p.add_argument(
        "--compute-nice",
        type=int,
        default=0,
        help=f"nice of each rank's main thread (its compute), its other threads (gloo's) at 0, so "
        f"no host's communication queues behind other hosts' compute on the shared cores (e.g. "
        f"{COMPUTE_NICE}; default 0: off -- it lengthened the quick scenario's compressed steps, "
        "bench/README.md)",
    )


def _other_modes(p: argparse.ArgumentParser) -> None:
    """The modes that train nothing: the network smoke test, re-rendering, clean-up."""
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


@dataclass
class Settings:
    """One scenario's preset with the command line's replacements applied."""

    preset: Scenario
    workers: int
    procs_per_host: int
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
    if getattr(args, "only_configs", False) or preset.only_configs:
        rows = list(configs)  # parse_configs dropped exact duplicates
    else:
        base = next((c for c in configs if c.key == BASELINE and not c.overrides), BenchConfig(*BASELINE))
        rows = [base] + [c for c in configs if c != base and c.key != LIMIT]
        if getattr(args, "aggregator", "none") == "switch" and SWITCH_ROW not in rows:
            rows.insert(1, SWITCH_ROW)
        if preset.kind == "throughput":
            limit = next((c for c in configs if c.key == LIMIT), BenchConfig(*LIMIT))
            rows.insert(1, limit)
    settings = Settings(
        preset=preset,
        workers=args.workers or preset.workers,
        procs_per_host=args.procs_per_host or preset.procs_per_host,
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


def _torch_version() -> str | None:
    """``torch.__version__`` (with its local part, e.g. ``+cpu``), read from the text of
    ``torch/version.py``: importing torch would cost this process seconds for one string."""
    if "torch" in sys.modules:
        return sys.modules["torch"].__version__
    try:
        where = importlib.util.find_spec("torch").submodule_search_locations[0]
        text = (Path(where) / "version.py").read_text()
    except (AttributeError, ImportError, OSError, TypeError):  # pragma: no cover - torch is a dependency
        return None
    found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return found.group(1) if found else None


def _scenario(
    args: argparse.Namespace,
    cluster: EmulatedCluster,
    settings: Settings,
    argv: Sequence[str],
) -> dict:
    torch_version = _torch_version()
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
        "procs_per_host": cluster.procs_per_host,
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
        "loadavg": loadavg(),
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


def _print_row(row: dict, kind: str) -> None:
    if row.get("status") != "ok":
        return
    if kind == "tta":
        t = row.get("time_to_target_s")
        print(
            f"[cluster]   time to target {fmt_figure(t, 's') if t is not None else 'never'} s, best val_acc "
            f"{fmt_figure(row.get('best_val_acc'), 'num')}, step {fmt_figure(row.get('step_time_s'), 's')} s",
            flush=True,
        )
        return
    print(
        f"[cluster]   step {fmt_figure(row['step_time_s'], 's')} s, "
        f"{fmt_figure(row['samples_per_s'], 'num')} samples/s, "
        f"{fmt_figure(row['bytes_per_step_per_worker'], 'bytes')}/step/worker, "
        f"comm {fmt_figure(row['comm_share'], 'pct')}, "
        f"loss {fmt_figure(row['final_loss'], 'num')}",
        flush=True,
    )


def run_scenario(args: argparse.Namespace, settings: Settings, argv: Sequence[str]) -> tuple[int, str]:
    """Build the cluster, run every row of one scenario, write its table; (exit code, md)."""
    preset = settings.preset
    problems = missing_configs([*settings.workload, *settings.extra]) + config_missing(
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
    with EmulatedCluster(
        settings.workers,
        link,
        subnet=args.subnet,
        procs_per_host=settings.procs_per_host,
        fork_ranks=getattr(args, "fork_ranks", False),
        mtu=getattr(args, "mtu", JUMBO_MTU),
        compute_nice=getattr(args, "compute_nice", 0),
    ) as cluster:
        scenario = _start_scenario(args, cluster, settings, argv, out)
        rows = [_run_row(args, cluster, settings, k, out) for k in range(len(settings.configs))]
        scenario["loadavg_after"] = loadavg()
        if preset.name == "sc17":
            scenario["costmodel_sc17"] = costmodel_sc17(getattr(args, "costmodel", None))
        add_tokens(rows)
        md = finish_table(rows, scenario, preset.targets)
        _write(out, "cluster", {"scenario": scenario, "rows": rows}, md)
        print()
        print(md)
        print(f"[cluster] wrote {out / 'cluster.json'} and {out / 'cluster.md'}")
        return (0 if all(r["status"] == "ok" for r in rows) else 1), md


def costmodel_sc17(path: Path | None) -> dict | None:
    """SC17's row of the cost model's projection (``bench._tables.sc17_projection``): from
    ``costmodel.json`` (``bench.costmodel.report.analyse`` stores ``project``'s output
    there), else from the ``costmodel_inputs.json`` beside it (fitted and projected here by
    ``bench.costmodel``'s own ``fit`` and ``project``); None when neither exists."""
    if path is None:
        return None
    inputs_path = path if path.name == "costmodel_inputs.json" else path.with_name("costmodel_inputs.json")
    if path != inputs_path and path.is_file():
        return sc17_projection(json.loads(path.read_text())["projection"], str(path))
    if not inputs_path.is_file():
        return None
    from bench.costmodel import fit, project
    from bench.costmodel.terms import emulated_burst_bytes

    inputs = json.loads(inputs_path.read_text())
    model = fit(inputs["probe"], cpus=inputs.get("cpus"), burst=emulated_burst_bytes)
    return sc17_projection(project(model, inputs), str(inputs_path))


def add_tokens(rows: list[dict]) -> None:
    """``tokens_per_s`` on each completed row whose run trained a sequence model
    (``data.seq_len`` in its summary's config): samples/s x seq_len."""
    for row in rows:
        if row.get("status") != "ok" or not row.get("run_dir"):
            continue
        try:
            summary = json.loads((Path(row["run_dir"]) / "summary.json").read_text())
        except (OSError, ValueError):
            continue
        seq_len = ((summary.get("config") or {}).get("data") or {}).get("seq_len")
        if isinstance(seq_len, int) and seq_len > 0:
            row["tokens_per_s"] = tokens_per_s(row.get("samples_per_s"), seq_len)


def _start_scenario(args: argparse.Namespace, cluster: EmulatedCluster, settings: Settings,
                    argv: Sequence[str], out: Path) -> dict:
    """On the built cluster: the switch's aggregator where asked, the sc17 link-rate
    calibration where the preset has no rate; the scenario's record."""
    if getattr(args, "aggregator", "none") == "switch":
        addr = place_switch_aggregator(cluster)
        print(f"[cluster] switch aggregator at {addr} (bridge namespace, unshaped)", flush=True)
    print(
        f"[cluster] scenario {settings.preset.name} ({cluster.run_id}): {cluster.workers} hosts "
        f"x {cluster.procs_per_host} processes on "
        f"{args.subnet}.0/24, {cluster.link.latency_ms} ms, {cluster.mtu}-byte frames"
        + (f", main threads at nice {cluster.compute_nice}" if cluster.compute_nice else ""),
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
    return scenario


def _run_row(args: argparse.Namespace, cluster: EmulatedCluster, settings: Settings, k: int,
             out: Path) -> dict:
    """Row ``k`` of the scenario: skipped (its config files missing), or its run's figures."""
    configs = settings.configs
    config = configs[k]
    row = {
        "strategy": config.strategy,
        "compression": config.compression,
        "overrides": list(config.overrides),
    }
    missing = config_missing(config)
    if missing:
        row["status"] = f"skipped ({', '.join(missing)} not found)"
        print(
            f"[cluster] ({k + 1}/{len(configs)}) {config.label}: {row['status']}",
            file=sys.stderr,
            flush=True,
        )
        return row
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
    if settings.preset.kind == "tta":
        res = run_tta_config(
            cluster, config, epochs=settings.epochs, target_acc=settings.target_acc, **common
        )
    else:
        res = run_config(
            cluster, config, steps=settings.steps, warmup_steps=settings.warmup_steps, **common
        )
    row.update(status=res.status, run_dir=res.run_dir, **res.figures)
    _print_row(row, settings.preset.kind)
    return row


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
        with EmulatedCluster(workers, link, subnet=args.subnet, mtu=args.mtu) as cluster:
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


def _share(res: dict, key: str) -> str:
    """A smoke result's CPU share as a percentage, '-' without a reading."""
    cpu = res.get("cpu")
    return f"{100 * cpu[key]:.0f}%" if cpu else "-"


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
            f"{res['busbw_mbit']:.1f} Mbit/s = {res['busbw_mbit'] / rate:.2f} of the link; "
            f"cores {_share(res, 'busy_share')} busy, {_share(res, 'kernel_share')} in the kernel "
            f"({cluster.mtu}-byte frames)",
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
        f"{cluster.mtu}-byte frames; cores: the machine's over the timed all-reduces",
        "",
        "| rate (Mbit/s) | hosts | MB | median s | bus bw (Mbit/s) | of link | cores busy | in the kernel |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['rate_mbit']:g} | {r['workers']} | {r['bytes'] / 1e6:.1f} | "
            f"{r['median_s']:.3f} | {r['busbw_mbit']:.1f} | "
            f"{r['busbw_mbit'] / r['rate_mbit']:.2f} | {_share(r, 'busy_share')} | "
            f"{_share(r, 'kernel_share')} |"
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
    except Interrupted as exc:
        print(f"bench/cluster.py: {exc}; cleaned up", file=sys.stderr)
        return 128 + exc.signum
    finally:
        cleanup_all()


if __name__ == "__main__":
    sys.exit(main())
