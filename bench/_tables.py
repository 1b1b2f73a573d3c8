"""Figures and tables of ``bench/cluster.py``: per-step figures from the runs'
``summary.json`` (steady state by subtracting a short run), ratios against the best dense
row (:func:`best_dense`: the fastest of ``ddp/none``, ``ddp/bf16``, ``ddp/fp16``) and
against ``ddp/none``, efficiency against the ``limit`` row, time to accuracy, target
verdicts and markdown."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from bench._scenarios import (
    BASELINE,
    BEST_DENSE,
    DENSE_CODECS,
    LIMIT,
    SC17_OF_BOUND,
    SHARE_KINDS,
    Target,
    one_config,
)
from easgd_lightning.utils.cputime import CPU_FIELDS


def _row_key(row: dict) -> tuple:
    return (row["strategy"], row["compression"], tuple(row.get("overrides") or ()))


def _find_row(rows: list[dict], spec: str) -> dict | None:
    config = one_config(spec)
    key = (config.strategy, config.compression, config.overrides)
    return next((r for r in rows if _row_key(r) == key), None)


def is_dense(row: dict) -> bool:
    """A dense baseline: ``ddp`` with compression ``none``, ``bf16`` or ``fp16`` and no
    override other than the compression's own (``compression.min_numel=0``); a row that
    changes the exchange (``comm.*``) or the training (``optim.*``) is not a baseline."""
    return (
        row["strategy"] == BASELINE[0]
        and row["compression"] in DENSE_CODECS
        and all(o.startswith("compression.") for o in row.get("overrides") or ())
    )


def best_dense(rows: list[dict], figure: str = "step_time_s") -> dict | None:
    """The completed dense row (:func:`is_dense`) with the smallest ``figure`` (a time or a
    byte count: smaller is better), the first in row order among equals; None when no
    completed dense row has that figure."""
    found = [r for r in rows if is_dense(r) and r.get("status") == "ok" and r.get(figure) is not None]
    return min(found, key=lambda r: float(r[figure]), default=None)


def dense_reference(rows: list[dict], figure: str) -> dict | None:
    """The row a :data:`~bench._scenarios.BEST_DENSE` reference stands for: the best dense
    row for ``figure``; when none has it (no dense row reached the target), the completed
    dense row that trained for the shortest time (``train_time_s``, the tightest bound on
    its time to the target), else the first completed dense row; None without one."""
    ok = [r for r in rows if is_dense(r) and r.get("status") == "ok"]
    return best_dense(rows, figure) or best_dense(rows, "train_time_s") or (ok[0] if ok else None)


def reference_record(rows: list[dict], figure: str) -> dict:
    """What a table was measured against (its JSON ``reference`` and its legend's line):
    ``row`` (the best dense row's spec, None without one), ``rule``, ``figure`` and every
    completed dense row's ``figure`` (``candidates``)."""
    ref = best_dense(rows, figure)
    return {
        "row": row_spec(ref) if ref else None,
        "rule": f"{BEST_DENSE}: least {figure} of the completed ddp/{{{','.join(DENSE_CODECS)}}} rows",
        "figure": figure,
        "candidates": {
            row_spec(r): r.get(figure) for r in rows if is_dense(r) and r.get("status") == "ok"
        },
    }


def reference_line(record: dict) -> str:
    """The table's line naming its reference row."""
    if not record.get("row"):
        return f"- reference: none (no dense row, ddp/{{{','.join(DENSE_CODECS)}}}, completed)"
    return f"- reference: {record['row']} ({BEST_DENSE}, least {record['figure']} of " + ", ".join(
        record["candidates"]
    ) + ")"


def evaluate_targets(rows: list[dict], targets: Sequence[Target]) -> list[dict]:
    """Judge every target against the rows of one run.

    Returns one dict per target: ``target`` (its description), ``row``, ``measured``
    (None when a row it needs did not run or failed), ``status`` (``PASS``, ``MISS``, or
    ``n/a: ...`` saying which row is missing or failed), and ``short`` (the table's label).
    """
    results = []
    for t in targets:
        ref = t.ref
        if ref == BEST_DENSE:
            resolved = dense_reference(rows, t.figure)
            ref = row_spec(resolved) if resolved else None
        out = {
            "target": t.describe(ref), "row": t.row, "short": t.short(ref), "kind": t.kind,
            "measured": None, "ref": ref,
        }
        needed = [t.row] + ([ref] if ref else [])
        found = {spec: _find_row(rows, spec) for spec in needed}
        if t.ref == BEST_DENSE and ref is None:
            found[BEST_DENSE] = None  # no dense row completed: "n/a: best dense not run"
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
            elif t.kind == "of_bound":
                value = row.get("of_bound")
            elif t.kind == "loss_gap":
                value = loss_gap(row.get("final_loss"), found[ref].get("final_loss"))
            else:
                mine, theirs = row.get(t.figure), found[ref].get(t.figure)
                value = theirs / mine if mine and theirs is not None else None
                if t.figure == "time_to_target_s" and value is None:
                    problem = _unreached(row, found[ref], t, ref)
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


def _unreached(row: dict, ref: dict, t: Target, spec: str) -> str:
    """Verdict of a time-to-target speedup when one of the two rows never got there
    (``spec``: the reference row's)."""
    if row.get("time_to_target_s") is None:
        return "MISS: never reached the target" if ref.get("time_to_target_s") is not None else (
            f"n/a: neither this row nor {spec} reached the target"
        )
    # The reference never got there: its whole training time bounds its time from below.
    bound = (ref.get("train_time_s") or 0.0) / row["time_to_target_s"]
    if bound >= t.bound:
        return f"PASS: {spec} never reached it (speedup > {bound:.2f}x)"
    return f"n/a: {spec} never reached the target"


def add_efficiency(rows: list[dict]) -> None:
    """``efficiency`` = limit ``step_time_s`` / the row's ``step_time_s`` (1.0: comm is free).

    Only rows that completed get a value; without a completed limit row every value is
    None. A row measured over another window than the limit row (``measured``: one fell
    back to whole-run figures, start-up included, while the other is steady state) gets
    None too: the ratio of the two would mix start-up into one side only.
    """
    limit = next(
        (r for r in rows if (r["strategy"], r["compression"]) == LIMIT and r.get("status") == "ok"),
        None,
    )
    ref = limit.get("step_time_s") if limit else None
    window = limit.get("measured") if limit else None
    for row in rows:
        mine = row.get("step_time_s")
        same_window = row.get("measured") == window
        row["efficiency"] = (
            float(ref) / float(mine) if ref and mine and same_window and row.get("status") == "ok" else None
        )


def ring_bound(workers: int, nbytes: float, rate_mbit: float, limit_step_s: float, baseline_step_s: float) -> dict:
    """The bandwidth bound of an overlapped all-reduce step against a baseline step.

    A ring all-reduce of ``nbytes`` over p workers moves 2 (p - 1) / p of it over every
    link, ``wire_s`` = that * 8 / rate (nominal rate, headers ignored: a lower bound). With
    the limit step K (compute alone) hidden perfectly behind it, a step cannot be shorter
    than max(K, wire_s): the speedup over the baseline is at most baseline / that. At least
    ``min_exposed_s`` = max(0, wire_s - K) of every step waits on the wire, so an exposed
    share s needs steps of at least min_exposed_s / s (:func:`max_speedup_at_share`). (SC17,
    p = 4: round-robin pays about 4 transfers of the model per step on the master's link
    against the ring's 1.5, so the bound cannot pass ~3x once round-robin spends >= 87% of
    its step communicating, and there 14% exposed is out of reach.)
    """
    wire_s = 2.0 * (workers - 1) / workers * nbytes * 8.0 / (rate_mbit * 1e6)
    best = max(limit_step_s, wire_s)
    exposed = max(0.0, wire_s - limit_step_s)
    return {
        "wire_s": wire_s,
        "limit_step_s": limit_step_s,
        "best_step_s": best,
        "max_speedup": baseline_step_s / best,
        "min_exposed_s": exposed,
        "min_exposed_share": exposed / best,
        "baseline_step_s": baseline_step_s,
    }


def share_of_bound(baseline_step_s: float | None, step_s: float | None, bound: dict | None) -> float | None:
    """A row's per-step speedup over the baseline (``baseline_step_s`` / ``step_s``) as a
    share of :func:`ring_bound`'s ``max_speedup`` (1.0: the row reaches the bound); None
    when a figure is missing."""
    if not (baseline_step_s and step_s and bound and bound.get("max_speedup")):
        return None
    return baseline_step_s / step_s / bound["max_speedup"]


def add_of_bound(rows: list[dict], scenario: dict) -> dict | None:
    """The sc17 bound (:func:`sc17_bound`) and, on each completed ``sync_easgd/none`` row,
    ``of_bound``: its speedup over round-robin as a share of it (:func:`share_of_bound`)."""
    bound = sc17_bound(rows, scenario)
    rr = next((r for r in rows if r.get("status") == "ok" and (r["strategy"], r["compression"])
               == ("easgd_round_robin", "none")), None)
    for row in rows:
        if row.get("status") == "ok" and (row["strategy"], row["compression"]) == ("sync_easgd", "none"):
            row["of_bound"] = share_of_bound(rr and rr.get("step_time_s"), row.get("step_time_s"), bound)
    return bound


def loss_gap(loss: float | None, ref_loss: float | None) -> float | None:
    """|loss - ref_loss| / ref_loss (issue 5's Optimus-CC bound: <= 5% of the uncompressed
    run's loss after the same steps); None when either is missing or ``ref_loss`` is 0."""
    if loss is None or not ref_loss:
        return None
    return abs(loss - ref_loss) / abs(ref_loss)


def max_speedup_at_share(bound: dict, share: float) -> float:
    """The largest speedup over the baseline of :func:`ring_bound`'s ``bound`` whose steps
    keep the exposed share at or under ``share``: steps of at least min_exposed_s / share."""
    return bound["baseline_step_s"] / max(bound["best_step_s"], bound["min_exposed_s"] / share)


def sc17_bound(rows: list[dict], scenario: dict) -> dict | None:
    """:func:`ring_bound` for the sc17 rows (round-robin as the baseline, the dense
    ``sync_easgd`` bytes per step); None when a row it needs did not complete."""
    ok = {(r["strategy"], r["compression"]): r for r in rows if r.get("status") == "ok"}
    limit, rr, sync = ok.get(LIMIT), ok.get(("easgd_round_robin", "none")), ok.get(("sync_easgd", "none"))
    if not (limit and rr and sync):
        return None
    steps, nbytes = (limit.get("step_time_s"), rr.get("step_time_s")), sync.get("bytes_per_step_per_worker")
    if not all(steps) or not nbytes:
        return None
    return ring_bound(scenario["workers"], nbytes, scenario["link"]["rate_mbit"], *steps)


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


def mean_or_none(values: Iterable[float]) -> float | None:
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
    * ``messages_per_step``: ``comm.messages_per_step``, mean over the ranks that stepped
      (collectives and point-to-point operations of the payload kinds per step).

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
    mean_steps = mean_or_none(stepping)
    step_time = wall / mean_steps if (wall is not None and mean_steps) else None
    bytes_per_step = sum(sent_list) / sum(stepping) if (sent_list and stepping) else None
    share, source = comm_share_of(summary)
    per_step = [m for m in comm.get("messages_per_step") or [] if m is not None]
    return {
        "messages_per_step": mean_or_none(per_step),
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
    """Seconds of training: the summary's ``train_time_s`` (the slowest rank's clock from
    the start of training to the end of its last batch, validation passes left out), or,
    for summaries written before it existed, the time from the start of training to the
    end of the last step's validation (``val_history``).

    Either leaves out the process group's and the strategy's set-up, whose jitter
    ``wall_time_s`` (the whole of ``fit``) carries into a difference of two runs. None
    when neither is there (then use ``wall_time_s``, which also counts the wait for the
    slowest rank to start).
    """
    if summary.get("train_time_s") is not None:
        return float(summary["train_time_s"])
    hist = summary.get("val_history") or []
    steps = [int(s) for s in summary.get("steps_per_rank") or [] if s]
    if not hist or hist[-1].get("time_s") is None or hist[-1].get("step") not in steps:
        return None
    return float(hist[-1]["time_s"])


def run_totals(summary: dict, clock: str) -> dict:
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
        "messages": [int(m or 0) for m in comm.get("messages") or []],
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
    a, b = run_totals(long, clock), run_totals(short, clock)
    if len(a["steps"]) != len(b["steps"]):
        return None
    d_time = a["time"] - b["time"]
    d_steps = [x - y for x, y in zip(a["steps"], b["steps"])]
    stepping = [d for x, d in zip(a["steps"], d_steps) if x > 0]
    mean_steps = mean_or_none(stepping)
    if d_time <= 0 or not mean_steps or mean_steps <= 0 or sum(stepping) <= 0:
        return None
    d_sent = sum(a["sent"]) - sum(b["sent"])
    fractions = [(x - y) / d_time for x, y in zip(a["comm_time"], b["comm_time"])]
    if a["sent"] == b["sent"]:
        # Nothing was sent in the window (the limit row): what the comm times differ by is
        # how long the collectives outside it (set-up broadcast, final average) waited.
        fractions = [0.0 for _ in fractions]
    d_messages = [x - y for x, y in zip(a["messages"], b["messages"])]
    msg_rates = [m / d for m, d in zip(d_messages, d_steps) if d > 0]
    return {
        "messages_per_step": mean_or_none(msg_rates) if msg_rates else None,
        "step_time_s": d_time / mean_steps,
        "samples_per_s": (a["samples"] - b["samples"]) / d_time,
        "bytes_per_step_per_worker": d_sent / sum(stepping),
        # Not clipped: asynchronous collectives in flight at once (DDP's buckets during the
        # backward pass) each count their own launch-to-completion time, so a total share
        # can exceed the wall time; above 100% means communication overlapped itself.
        "comm_share": mean_or_none(fractions) if fractions else None,
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


def _ratios(row: dict, base: dict | None, figures: Sequence[str]) -> dict[str, float | None]:
    """value / ``base``'s value per figure (None where either is missing, the base's is 0,
    or the row did not complete)."""
    out: dict[str, float | None] = {}
    for name in figures:
        value, ref = row.get(name), (base.get(name) if base else None)
        ok = value is not None and ref not in (None, 0) and row.get("status") == "ok"
        out[name] = float(value) / float(ref) if ok else None
    return out


def fp32_row(rows: list[dict]) -> dict | None:
    """The completed plain ``ddp/none`` row (fp32 DDP, no overrides), or None."""
    return next(
        (r for r in rows if (r["strategy"], r["compression"]) == BASELINE and not r.get("overrides")
         and r.get("status") == "ok"),
        None,
    )


def build_table(rows: list[dict], figure: str = "step_time_s") -> list[dict]:
    """Add ``ratio`` (value / the reference's value) for every figure of every row, and
    ``x_vs_none`` (the row's ``figure`` / ``ddp/none``'s: the fp32 ratio of older tables).

    The reference is the best dense row (:func:`best_dense` for ``figure``: the fastest of
    the completed ``ddp/none``, ``ddp/bf16``, ``ddp/fp16``); without one every ratio is
    ``None``.

    Args:
        rows: dicts with ``strategy``, ``compression``, ``status`` and the figures.
        figure: what picks the reference (the least of it).

    Returns:
        The same rows (mutated), each with a ``ratio`` dict keyed by figure.
    """
    base, fp32 = best_dense(rows, figure), fp32_row(rows)
    for row in rows:
        row["ratio"] = _ratios(row, base, FIGURES)
        row["x_vs_none"] = _ratios(row, fp32, (figure,))[figure]
    return rows


def fmt_figure(value: float | None, kind: str) -> str:
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
    return f"{100 * value:.1f}%" if t.get("kind") in SHARE_KINDS else f"{value:.2f}"


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
        f"# Emulated cluster, scenario {name}: {scenario['workers']} workers"
        + (
            f" (hosts) x {scenario['procs_per_host']} processes"
            if scenario.get("procs_per_host", 1) > 1
            else ""
        )
        + f", {link['rate_mbit']:g} Mbit/s, {lat}"
        + (f", {link['mtu']}-byte frames" if link.get("mtu") else "")
        + (f", ranks' main threads at nice {link['compute_nice']}" if link.get("compute_nice") else ""),
        "",
        f"- workload: `{workload}`, extra: `{extra}`",
    ]
    calib = scenario.get("calibration")
    if calib:
        probes = ", ".join(
            f"{p['rate_mbit']:g} Mbit/s -> {fmt_figure(p.get('comm_share'), 'pct')}" for p in calib["probes"]
        )
        lines.append(
            f"- link rate {link['rate_mbit']:g} Mbit/s chosen by measurement: the fastest probed "
            f"rate at which easgd_round_robin spent >= {100 * calib['wanted']:.0f}% of its step "
            f"on communication, i.e. 1 - (limit step {fmt_figure(calib.get('limit_step_s'), 's')} s) / "
            f"(its step) (probes: {probes})"
            + ("" if calib.get("reached") else "; NOT reached within the probes")
        )
    lines += [
        f"- machine: {machine['cpus']} CPUs, {machine['platform']}, {scenario['date']}"
        + (f", load average before: {scenario['loadavg']}" if scenario.get("loadavg") else ""),
        f"- command: `{scenario['command']}`",
    ]
    return lines


def steady_cpu(long: dict, short: dict, steps: int, cores: int) -> dict | None:
    """A row's CPU use in the steady state, from two summaries of it (``long``, ``short``):
    their ``train_cpu_per_rank`` (each rank's CPU from the start to the end of training)
    differ by the steps between them. The machine's (rank 0's /proc/stat reading: every
    core, every host of the emulation, the kernel's packet work) as busy core-ms per step
    and as shares of the cores' time (busy = all but idle and iowait; interrupts = irq +
    softirq; steal = taken by the hypervisor), and each rank's own process per step. None
    without both readings or with a window that is not positive."""
    a, b = long.get("train_cpu_per_rank") or [], short.get("train_cpu_per_rank") or []
    if steps <= 0 or not a or len(a) != len(b) or not (a[0] and b[0] and a[0].get("host") and b[0].get("host")):
        return None
    d = {k: a[0]["host"][k] - b[0]["host"][k] for k in CPU_FIELDS}
    total = sum(d.values())
    if a[0]["wall_s"] - b[0]["wall_s"] <= 0 or total <= 0:
        return None
    busy = total - d["idle"] - d["iowait"]
    return {
        "cpu_ms_per_step": 1e3 * busy / steps,
        "busy_share": busy / total,
        "user_share": (d["user"] + d["nice"]) / total,
        "system_share": d["system"] / total,
        "interrupt_share": (d["irq"] + d["softirq"]) / total,
        "steal_share": d["steal"] / total,
        "cores": cores,
        "process_ms_per_step": [1e3 * (x["process_s"] - y["process_s"]) / steps if x and y else None
                                for x, y in zip(a, b)],
    }


def cpu_md(rows: Sequence[dict]) -> str:
    """The line under a throughput table: each row's steady-state CPU use (:func:`steady_cpu`)."""
    def ranks(c: dict) -> str:
        return ", ".join("-" if v is None else f"{v:.1f}" for v in c.get("process_ms_per_step") or [])

    parts = [
        f"{row_spec(r)} {r['cpu']['cpu_ms_per_step']:.1f} ms (busy {100 * r['cpu']['busy_share']:.0f}%: "
        f"user {100 * r['cpu']['user_share']:.0f}, system {100 * r['cpu']['system_share']:.0f}, "
        f"interrupts {100 * r['cpu']['interrupt_share']:.0f}, steal {100 * r['cpu']['steal_share']:.0f}; "
        f"ranks' processes {ranks(r['cpu'])} ms)"
        for r in rows
        if r.get("cpu")
    ]
    cores = next(r["cpu"]["cores"] for r in rows if r.get("cpu"))
    return (
        f"CPU per step in the steady state, of the whole machine ({cores} cores, every host's "
        "processes and the kernel's packet work; shares of the cores' time) and of each rank's "
        "own process: " + "; ".join(parts) + "."
    )


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
    reference = scenario.get("reference") or reference_record(rows, "step_time_s")
    lines = _header(scenario) + _throughput_legend(scenario, share) + [
        reference_line(reference),
        "",
        (
            "| strategy/compression | step time (s) | x | x vs ddp/none | efficiency | samples/s | x "
            f"| bytes/step/worker | x | msgs/step | {share} | final loss | targets | status |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    lines += [_throughput_row(r, by_row, scenario, mixed=share == "comm share") for r in rows]
    bound = sc17_bound(rows, scenario) if scenario.get("name") == "sc17" else None
    if bound:
        lines += ["", _sc17_bound_md(bound, scenario, rows)]
    if scenario.get("name") == "sc17":
        lines += ["", sc17_projection_md(scenario.get("costmodel_sc17"))]
    if any(r.get("tokens_per_s") is not None for r in rows):
        lines += ["", _tokens_md(rows)]
    if any(r.get("cpu") for r in rows):
        lines += ["", cpu_md(rows)]
    return "\n".join(lines + _targets_md(targets)) + "\n"


def _throughput_legend(scenario: dict, share: str) -> list[str]:
    """The steps the figures cover, what x and efficiency are, and which comm share."""
    return [
        f"- steps: {scenario['steps']}; "
        + (
            f"figures per step over steps {scenario['warmup_steps'] + 1}..{scenario['steps']}"
            f" (a {scenario['warmup_steps']}-step run of each configuration subtracted)"
            if scenario.get("warmup_steps")
            else "figures over the whole run (first steps included)"
        ),
        (
            "- x = value / value of the reference row in this run (the best dense row: the least"
            " step time of ddp/none, ddp/bf16 and ddp/fp16; step time < 1x and samples/s > 1x"
            " are faster; bytes ratio = 1 / compression factor); x vs ddp/none = step time /"
            " ddp/none's (fp32, the ratio of tables before issue 29); efficiency = limit step time"
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
    ]


def _throughput_row(r: dict, by_row: dict[str, list[dict]], scenario: dict, *, mixed: bool) -> str:
    """One row of the throughput table (``mixed``: total comm shares marked *)."""
    q = r.get("ratio", {})
    star = "*" if mixed and r.get("comm_share_source") == "total" else ""
    whole = " (whole run)" if scenario.get("warmup_steps") and r.get("measured") == "whole run" else ""
    cells = [
        _row_label(r),
        fmt_figure(r.get("step_time_s"), "s"),
        fmt_figure(q.get("step_time_s"), "ratio"),
        fmt_figure(r.get("x_vs_none"), "ratio"),
        fmt_figure(r.get("efficiency"), "eff"),
        fmt_figure(r.get("samples_per_s"), "num"),
        fmt_figure(q.get("samples_per_s"), "ratio"),
        fmt_figure(r.get("bytes_per_step_per_worker"), "bytes"),
        fmt_figure(q.get("bytes_per_step_per_worker"), "ratio"),
        fmt_figure(r.get("messages_per_step"), "num"),
        fmt_figure(r.get("comm_share"), "pct") + star,
        fmt_figure(r.get("final_loss"), "num"),
        _target_cell(r, by_row),
        r.get("status", "?") + whole,
    ]
    return "| " + " | ".join(cells) + " |"


def _sc17_bound_md(bound: dict, scenario: dict, rows: Sequence[dict] = ()) -> str:
    """The sc17 scenario's bandwidth bound on Sync EASGD's speedup (:func:`sc17_bound`), and
    each sync_easgd row's measured speedup as a share of it (``of_bound``)."""
    measured = [
        f"{row_spec(r)}: {bound['baseline_step_s'] / r['step_time_s']:.2f}x measured, "
        f"{100 * r['of_bound']:.0f}% of the bound"
        for r in rows
        if r.get("of_bound") is not None
    ]
    return (
        f"Bandwidth bound ({scenario['workers']} workers): the ring all-reduce of sync_easgd's "
        f"difference moves 2(p-1)/p of "
        f"it over each link, {1e3 * bound['wire_s']:.1f} ms at {scenario['link']['rate_mbit']:g} "
        f"Mbit/s; with the limit step ({fmt_figure(bound['limit_step_s'], 's')} s) "
        f"hidden perfectly, no sync_easgd step is shorter than {fmt_figure(bound['best_step_s'], 's')} s: "
        f"speedup over this round-robin <= {bound['max_speedup']:.2f}x (exposed share "
        f"{100 * bound['min_exposed_share']:.0f}% at that step). At least "
        f"{1e3 * bound['min_exposed_s']:.1f} ms of every step waits on the wire, so an exposed "
        f"share <= 14% needs a speedup <= {max_speedup_at_share(bound, 0.14):.2f}x."
        + (f" Measured: {'; '.join(measured)} (target >= {100 * SC17_OF_BOUND:.0f}% of the bound)." if measured else "")
    )


#: the cost model's projection curve of SC17's Sync EASGD (tree all-reduce), on the layout
#: of their 4253 KNL cores (``bench.costmodel.projection``)
SC17_CURVE = ("knl", "sync_easgd/none (SC17 tree)")


def sc17_projection(projection: dict, source: str) -> dict | None:
    """SC17's row of a cost-model projection (``bench.costmodel.projection.project``'s
    output): the projected weak-scaling efficiency of Sync EASGD with SC17's tree on the
    KNL layout at each tabled worker count, beside SC17's own point; None when the
    projection has no such row (no dense sync_easgd row was measured)."""
    layout, label = SC17_CURVE
    effs = (projection.get("table") or {}).get(layout, {}).get(label)
    if not effs:
        return None
    return {"source": source, "layout": layout, "row": label, "efficiency": dict(effs),
            "sc17": projection.get("sc17"), "note": projection.get("note")}


def sc17_projection_md(record: dict | None) -> str:
    """The line under the sc17 table: :func:`sc17_projection`'s row, or how to get one."""
    if not record:
        return (
            "Cost model's SC17 row: not available (no bench/results/costmodel/costmodel.json or "
            "costmodel_inputs.json with a sync_easgd/none row; run `python -m bench.costmodel "
            "--measure`, or name one with `--costmodel PATH`)."
        )
    effs = ", ".join(f"{p} workers {100 * e:.1f}%" for p, e in record["efficiency"].items())
    point = record.get("sc17") or {}
    return (
        f"Cost model's SC17 row ({record['source']}; {record.get('note') or 'a model projection'}): "
        f"{record['row']} on the {record['layout']} layout, weak-scaling efficiency {effs}; "
        f"SC17 measured {100 * point.get('efficiency', float('nan')):.1f}% on "
        f"{point.get('workers')} KNL cores."
    )


def tokens_per_s(samples_per_s: float | None, seq_len: int | None) -> float | None:
    """Tokens per second of a language-model row: samples/s x tokens per sample."""
    return samples_per_s * seq_len if samples_per_s is not None and seq_len else None


def _tokens_md(rows: Sequence[dict]) -> str:
    """Tokens/s of each row that has them (the optimus scenario), with the final loss."""
    return "Tokens/s (samples/s x data.seq_len): " + "; ".join(
        f"{row_spec(r)} {fmt_figure(r['tokens_per_s'], 'num')} tokens/s, loss {fmt_figure(r.get('final_loss'), 'num')}"
        for r in rows
        if r.get("tokens_per_s") is not None
    ) + "."


def render_tta_markdown(rows: list[dict], scenario: dict) -> str:
    """The time-to-accuracy table: one row per configuration, speedup over the best dense
    row (its name on the ``reference`` line) and over ddp/none."""
    targets = scenario.get("targets") or []
    by_row = _targets_by_row(targets)
    acc = scenario["target_acc"]
    lines = _header(scenario) + [
        f"- each row trains for up to {scenario['epochs']} epochs and validates the model it "
        "delivers (the center for elastic rows) after every epoch; time = seconds from the "
        f"start of training to the first validation with val_acc >= {acc:g} "
        "(`val_history[].time_s` of summary.json)",
        "- speedup = the reference row's time / the row's time (the best dense row: the soonest "
        "of ddp/none, ddp/bf16 and ddp/fp16); x vs ddp/none = ddp/none's time / the row's (fp32, "
        "the speedup of tables before issue 29); bytes and comm share over the whole run",
        reference_line(scenario.get("reference") or reference_record(rows, "time_to_target_s")),
        "",
        (
            f"| strategy/compression | time to {acc:g} (s) | speedup | x vs ddp/none | epoch | step "
            f"| best val_acc | bytes/step/worker | {_share_label(rows)} | step time (s) "
            "| targets | status |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        reached = r.get("time_to_target_s") is not None
        lines.append(
            "| "
            + " | ".join(
                [
                    _row_label(r),
                    fmt_figure(r.get("time_to_target_s"), "s")
                    if reached
                    else ("never" if r.get("status") == "ok" else "-"),
                    fmt_figure(r.get("speedup"), "ratio"),
                    fmt_figure(r.get("speedup_vs_none"), "ratio"),
                    str(r["target_epoch"] + 1) if reached and r.get("target_epoch") is not None else "-",
                    str(r.get("target_step")) if reached else "-",
                    fmt_figure(r.get("best_val_acc"), "num"),
                    fmt_figure(r.get("bytes_per_step_per_worker"), "bytes"),
                    fmt_figure(r.get("comm_share"), "pct"),
                    fmt_figure(r.get("step_time_s"), "s"),
                    _target_cell(r, by_row),
                    r.get("status", "?"),
                ]
            )
            + " |"
        )
    return "\n".join(lines + _targets_md(targets)) + "\n"


def add_tta_speedup(rows: list[dict]) -> None:
    """``speedup`` = the best dense row's time to target (:func:`best_dense`) / the row's,
    ``speedup_vs_none`` = ``ddp/none``'s / the row's (None where either never got there)."""
    for key, base in (("speedup", best_dense(rows, "time_to_target_s")), ("speedup_vs_none", fp32_row(rows))):
        ref = base.get("time_to_target_s") if base else None
        for row in rows:
            mine = row.get("time_to_target_s")
            row[key] = ref / mine if ref and mine and row.get("status") == "ok" else None


def finish_table(rows: list[dict], scenario: dict, targets: Sequence[Target]) -> str:
    """Ratios, efficiency or speedup, target verdicts, the reference row
    (``scenario["reference"]``); returns the markdown."""
    tta = scenario.get("kind") == "tta"
    figure = "time_to_target_s" if tta else "step_time_s"
    build_table(rows)
    if tta:
        add_tta_speedup(rows)
    else:
        add_efficiency(rows)
        if scenario.get("name") == "sc17":
            add_of_bound(rows, scenario)
    scenario["reference"] = reference_record(rows, figure)
    scenario["targets"] = evaluate_targets(rows, targets)
    return render_markdown(rows, scenario)
