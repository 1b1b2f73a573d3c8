"""The cost model's outputs: ``costmodel.json``, ``costmodel.md`` and
``costmodel_projection.png`` (:func:`analyse`: fit, predict, project, write)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.costmodel.fit import fit, fit_codec_rounds, fit_loops, fit_ps_loop
from bench.costmodel.predict import ablation, predict_rows
from bench.costmodel.projection import project
from bench.costmodel.terms import emulated_burst_bytes

__all__ = ["analyse", "markdown", "projection_markdown"]


def markdown(result: dict) -> str:
    """The fit, the predictions and the projection as markdown."""
    lines = _fit_md(result) + _loops_md(result.get("loops") or {}) + _predictions_md(result["predictions"])
    lines += _meters_md(result["predictions"]) + _ablation_md(result.get("ablation") or [])
    lines += _held_out_md(result["predictions"])
    lines += ["", projection_markdown(result["projection"])]
    return "\n".join(lines) + "\n"


def _fit_md(result: dict) -> list[str]:
    """What the fit used, and each collective's alpha and eta with the fit's errors; phi of
    the server's replies, of a busy server, and the token bucket where charged."""
    inputs = result["inputs_summary"]
    lines = [
        "# Cost model (alpha-beta), fitted on the emulated cluster",
        "",
        f"- fitted on: {inputs['probe_samples']} probe samples (ranks {inputs['probe_workers']}, "
        f"link rates {inputs['probe_rates_mbit']} Mbit/s) and their loops, the limit row (compute) and the codec "
        "measurements; every other row below is held out",
        f"- load average: {inputs.get('loadavg_before')} before, {inputs.get('loadavg_after')} after",
        "",
        "| collective | alpha (us) | eta (of the link) | eta at each probed p (the rows') | samples | "
        "median rel. err | max rel. err |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for op, par in result["fit"].items():
        by_p = ", ".join(f"{q}: {v:.3f}" for q, v in (par.get("eta_by_p") or {}).items())
        lines.append(
            f"| {op} | {par['alpha_s'] * 1e6:.0f} | {par['eta']:.3f} | {by_p} | {par['samples']} | "
            f"{100 * par['median_rel_err']:.1f}% | {100 * par['max_rel_err']:.1f}% |"
        )
    fitted = result["fit"]
    if "overlap" in fitted.get("ps", {}):
        lines += ["", f"- the server's replies: phi = {fitted['ps']['overlap']:.2f} of each drains "
                  "behind the next request (0: serial, 1: full duplex), from the fan-in"]
    busy = (result.get("loops") or {}).get("busy_overlap") or {}
    if busy:
        per_p = "; ".join(f"p={p}: " + ", ".join(f"{v:.2f} at {r} Mbit/s" for r, v in by_rate.items())
                          for p, by_rate in busy.items())
        lines.append(f"- a busy server (the probe's `loop_ps`: workers computing then exchanging in turn): "
                     f"phi {per_p}; the async and round-robin rows use it at their p, linear in "
                     "log(rate) between the probed rates")
    if any(par.get("burst") for par in fitted.values()):
        lines.append("- token bucket: the first B bytes of each transfer after an idle link pass at "
                     "line rate (B = 2 ms of the link, `bench/_netem.py`); B = 0 in the projection")
    return lines


def _loops_md(loops: dict) -> list[str]:
    """The probe loops' table: F, each shape's s (and h) per p, the per-round costs."""
    if not loops.get("sync_s"):
        return []
    ps = sorted({int(q) for v in loops["sync_s"].values() for q in v})
    lines = [
        "",
        "Probe loops (compute + collective, the slowest rank per iteration): the "
        "synchronisation cost s, what a loop took beyond the kernel alone (F) plus the "
        "idle collective C (serial) or beyond F + C - h min(F, C) (overlapped; h: the "
        "share the overlap hid), ms per iteration; the median over rates at the smallest "
        "message, which the rows use (in brackets: at each message size, ascending).",
        "",
        "| shape | " + " | ".join(f"p={q}" for q in ps) + " |",
        "|---|" + "---:|" * len(ps),
        "| F: kernel alone | " + " | ".join(
            f"{1e3 * loops['free_s'].get(str(q), float('nan')):.1f}" for q in ps) + " |",
    ]
    for shape, by_p in loops["sync_s"].items():
        lines.append(f"| {shape} | " + " | ".join(_loop_cell(loops, shape, by_p, q) for q in ps) + " |")
    if loops.get("per_round_s"):
        lines.append("| each further blocking all-reduce (s_r) | " + " | ".join(
            f"{1e3 * loops['per_round_s'][str(q)]:.1f} (r: " + " / ".join(
                f"{r}={1e3 * v:.1f}" for r, v in loops["by_rounds"][str(q)].items()) + ")"
            if str(q) in loops["per_round_s"] else "" for q in ps) + " |")
    if loops.get("codec_round_s"):
        lines.append("| each further blocking all-reduce with the codec between (s_c; used) | " + " | ".join(
            f"{1e3 * loops['codec_round_s'][str(q)]:.1f}" if str(q) in loops["codec_round_s"] else ""
            for q in ps) + " |")
    return lines


def _loop_cell(loops: dict, shape: str, by_p: dict, q: int) -> str:
    """One shape's s at p = q in ms, its value at each message size and its h."""
    if str(q) not in by_p:
        return ""
    sizes = loops["by_size"][shape][str(q)]
    per = " / ".join(f"{1e3 * v:.1f}" for v in sizes.values())
    h = (loops.get("hidden", {}).get(shape) or {}).get(str(q))
    return f"{1e3 * by_p[str(q)]:.1f} ({per})" + ("" if h is None else f", h={h:.2f}")


def _predictions_md(predictions: list[dict]) -> list[str]:
    """Every row's measured and predicted step time, with the prediction's parts."""
    lines = [
        "",
        "| row | ranks | Mbit/s | measured s/step | spread | predicted | error | t_c | t_k | comm | msgs | s | formula | held out |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in predictions:
        lines.append(
            f"| {r['row']} | {r['workers']} | {r['rate_mbit']:g} | {r['measured_s']:.4f} | "
            f"{_percent(r.get('spread'))} | {r['predicted_s']:.4f} | {100 * r['rel_err']:+.1f}% | {r['t_compute_s']:.4f} | "
            f"{r['t_codec_s']:.4f} | {r['comm_s']:.4f} | {r.get('messages', 1):g} | "
            f"{r.get('sync_s', 0.0):.4f} | {r['formula']} | "
            f"{'no (fit)' if r['in_fit'] else 'yes'} |"
        )
    return lines


def _meters_md(predictions: list[dict]) -> list[str]:
    """What each row's own meter saw per step, beside the model's comm and local time."""
    metered = [r for r in predictions if r.get("meter")]
    if not metered:
        return []
    lines = [
        "",
        "What each row's own meter saw per steady-state step (diagnosis only: no figure "
        "of a row enters its prediction); rest = step - exposed communication:",
        "",
        "| row | step | comm (meter) | exposed | rest | codec (hook) | msgs/step | "
        "model: comm | model: t_c + t_k + s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in metered:
        m = r["meter"]
        msgs = m.get("messages_per_step")
        lines.append(
            f"| {r['row']} (p={r['workers']}) | {m['step_s']:.4f} | {m['comm_s']:.4f} | {m['exposed_s']:.4f} | "
            f"{m['rest_s']:.4f} | {m['codec_s']:.4f} | "
            f"{'' if msgs is None else format(msgs, '.2f')} | {r['comm_s']:.4f} | "
            f"{r['t_compute_s'] + r['t_codec_s'] + r.get('sync_s', 0.0):.4f} |"
        )
    return lines


def _ablation_md(ablation_rows: list[dict]) -> list[str]:
    """Each held-out row's error as the model's parts are added in turn."""
    if not ablation_rows:
        return []
    lines = [
        "",
        "The error as the model's parts are added in turn (idle: the idle probe's "
        "collectives, the codec round trip on one tensor, the compressor's nominal "
        "collectives and the row's metered payload; + exchange: codec, messages and bytes "
        "of the whole exchange on the model's tensors; + loops: the synchronisation cost "
        "and the overlap's hidden share; + local runs: the rows' cost beyond the limit "
        "with all ranks on one host, codec and the strategy's machinery, where measured):",
        "",
        "| row | idle | + exchange | + loops | + local runs |",
        "|---|---:|---:|---:|---:|",
    ]
    for a in ablation_rows:
        lines.append(f"| {a['row']} | {100 * a['idle']:+.1f}% | {100 * a['+ exchange']:+.1f}% | "
                     f"{100 * a['+ loops']:+.1f}% | {100 * a.get('+ local runs', a['+ loops']):+.1f}% |")
    return lines


def _held_out_md(predictions: list[dict]) -> list[str]:
    """How many held-out rows came within 15%, per rank count, beside the repeats' spread."""
    lines: list[str] = []
    held = [r for r in predictions if not r["in_fit"]]
    for q in sorted({r["workers"] for r in held}):
        at_q = [r for r in held if r["workers"] == q]
        within = sum(abs(r["rel_err"]) <= 0.15 for r in at_q)
        spreads = sorted(r["spread"] for r in at_q if r.get("spread") is not None)
        lines += ["", f"Held-out rows within 15% on {q} ranks: {within} of {len(at_q)}" + (
            f" (the measurements' own spread between repeats: median {_percent(spreads[len(spreads) // 2])}, "
            f"largest {_percent(spreads[-1])})." if spreads else ".")]
    return lines


def projection_markdown(projection: dict) -> str:
    """The projection table (efficiency at 64 / 512 / 4096 workers); re-exported by
    ``easgd-report``."""
    from easgd_lightning.cli.report import projection_markdown as render

    return render(projection)


def _percent(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def analyse(inputs: dict, out: Path, layouts: dict[str, dict] | None = None,
            use_loops: bool = True) -> dict:
    """Fit, predict, project; write costmodel.json / .md / _projection.png into ``out``."""
    from easgd_lightning.cli.report import plot_projection
    from easgd_lightning.utils.atomic import atomic_write_text

    model = fit(inputs["probe"], cpus=inputs.get("cpus"), burst=emulated_burst_bytes)
    loops = fit_loops(inputs.get("probe_loops") or [], inputs["probe"])
    loops["busy_overlap"] = fit_ps_loop(inputs.get("probe_loops") or [], model)
    loops["codec_round_s"] = fit_codec_rounds(inputs.get("probe_loops") or [], inputs["probe"],
                                              loops["sync_s"].get("serial_ring") or {}, inputs.get("probe_kernel"))
    result = {
        "fit": model,
        "loops": loops,
        "predictions": predict_rows(model, inputs, loops if use_loops else None),
        "ablation": ablation(model, inputs, loops),
        "projection": project(model, inputs, layouts=layouts),
        "inputs_summary": {
            "probe_samples": len(inputs["probe"]),
            "probe_workers": sorted({s["p"] for s in inputs["probe"]}),
            "probe_rates_mbit": sorted({s["rate_mbit"] for s in inputs["probe"]}),
            "loadavg_before": inputs.get("loadavg_before"),
            "loadavg_after": inputs.get("loadavg_after"),
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    png = plot_projection(result["projection"], out / "costmodel_projection.png")
    result["projection"]["png"] = png.name
    atomic_write_text(out / "costmodel.json", json.dumps(result, indent=2))
    md = markdown(result)
    atomic_write_text(out / "costmodel.md", md)
    return result
