"""Weak-scaling projection of the fitted model to layouts and scales that were not run.

**Projection.** Weak scaling (fixed work per worker) to 4096 workers on two layouts,
efficiency E(P) = t_c / T(P): the fitted formulas, alphas, etas and phi (no token bucket:
B = 0), the measured compute (of the rows on the fewest ranks: one worker per core where
that is this machine's count),
codec (growing with p where it decodes every rank's payload), messages and payloads
(s = 0 and h = 1: both are measured for ranks that share this machine's two cores), and
per layout (assumptions, stated in the output): workers per node,
intra- and inter-node nominal rates, the intra-node latency (and the inter-node one where
the layout does not use the fitted alpha) and a compute speed factor.
These are MODEL PROJECTIONS, not measurements. SC17's 91.5% weak-scaling efficiency
(Sync EASGD, 4253 KNL cores) is marked on the plot for reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from bench.costmodel.predict import dense_bytes, row_inputs, row_label, row_options, step_time
from bench.costmodel.terms import collective_time, hierarchical_allreduce_time, probe_of, rate_bps

__all__ = ["LAYOUTS", "PROJECTION_NOTE", "PROJECTION_WORKERS", "SC17_POINT", "layout_net", "layouts_with", "project"]


PROJECTION_NOTE = (
    "MODEL PROJECTION, not a measurement: the alpha-beta model fitted on the emulated "
    "cluster, extrapolated to layouts and scales that were not run."
)


SC17_POINT = (4253, 0.915)  # Sync EASGD weak scaling on 4253 KNL cores (SC17)


PROJECTION_WORKERS = (64, 512, 4096)


#: Layout assumptions of the projection (not measured; stated in every output).
LAYOUTS = {
    "knl": {
        "description": "64 nodes x 68 KNL cores (SC17's 4253-core run), one worker per core; "
        "intra-node: shared memory (tree), 100 Gbit/s per transfer, 5 us; inter-node: "
        "Cray Aries-class 80 Gbit/s per node at the fitted eta, and the fitted alpha (gloo "
        "over TCP, the backend this project runs on CPU clusters); a KNL core computes "
        "like one core here",
        "per_node": 68, "intra_mbit": 100_000.0, "intra_alpha_s": 5e-6,
        "inter_mbit": 80_000.0, "inter_alpha_s": None, "compute_factor": 1.0,
    },
    "gpu": {
        "description": "512 nodes x 8 GPUs, one worker per GPU; intra-node: NVLink-class "
        "1200 Gbit/s, 5 us; inter-node: InfiniBand-class 100 Gbit/s per node at the "
        "fitted eta, 10 us per message (NCCL-class, not fitted); a GPU step 10x faster "
        "than one core here",
        "per_node": 8, "intra_mbit": 1_200_000.0, "intra_alpha_s": 5e-6,
        "inter_mbit": 100_000.0, "inter_alpha_s": 1e-5, "compute_factor": 0.1,
    },
}


def layout_net(model: dict[str, dict], layout: dict) -> Callable[[str, int, float], float]:
    """``net(collective, P, bytes)`` on a layout: inside one node the intra-node link;
    across nodes, a tree's levels split into intra- and inter-node ones, every other
    collective paced by the inter-node links (fitted alpha, eta x the layout's rate)."""
    q = layout["per_node"]
    intra_beta = rate_bps(layout["intra_mbit"])

    def params(name: str) -> tuple[float, float]:
        par = model.get(probe_of(name)) or model["ring"]
        alpha = layout.get("inter_alpha_s")
        return par["alpha_s"] if alpha is None else alpha, par["eta"] * rate_bps(layout["inter_mbit"])

    def overlap(name: str) -> float:
        return (model.get(probe_of(name)) or {}).get("overlap", 0.0)

    def net(name: str, p: int, nbytes: float) -> float:
        if name == "hierarchical":
            return hierarchical_allreduce_time(
                p, q, nbytes, (layout["intra_alpha_s"], intra_beta), params("ring")
            )
        if p <= q:
            eta = (model.get(probe_of(name)) or model["ring"])["eta"]
            return collective_time(name, p, nbytes, layout["intra_alpha_s"], eta * intra_beta,
                                   overlap=overlap(name))
        if name == "tree":
            nodes = math.ceil(p / q)
            return collective_time("tree", q, nbytes, layout["intra_alpha_s"], intra_beta) + (
                collective_time("tree", nodes, nbytes, *params("tree"))
            )
        return collective_time(name, p, nbytes, *params(name), overlap=overlap(name))
    return net


def _workers_axis(limit: int = 4096) -> list[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def layouts_with(overrides: Sequence[str]) -> dict[str, dict]:
    """:data:`LAYOUTS` with ``layout.key=value`` overrides (numbers), e.g.
    ``gpu.compute_factor=0.1``.

    Raises:
        ValueError: an unknown layout or key, or a value that is not a positive number.
    """
    layouts = {k: dict(v) for k, v in LAYOUTS.items()}
    for item in overrides:
        target, _, value = item.partition("=")
        name, _, key = target.partition(".")
        if name not in layouts or key not in layouts[name] or key == "description":
            keys = sorted(k for k in LAYOUTS["knl"] if k != "description")
            raise ValueError(
                f"--layout {item!r}: expected LAYOUT.KEY=VALUE with LAYOUT in "
                f"{sorted(layouts)} and KEY in {keys}"
            )
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not number > 0:
            raise ValueError(f"--layout {item!r}: the value must be a positive number")
        layouts[name][key] = int(number) if key == "per_node" else number
        layouts[name]["description"] += f" [override: {key}={value}]"
    return layouts


def _projected_rows(inputs: dict) -> list[tuple[str, dict, str | None]]:
    """(label, row, all-reduce) of each curve: one per measured configuration, the one
    measured on the fewest ranks (one per core where that is this machine's count: the
    projection's one worker per core), plus the dense Sync EASGD row with SC17's tree and
    with hierarchical reduction in place of the ring (None: the row's own collectives)."""
    rows = [r for r in inputs["rows"] if r.get("status") == "ok" and r["strategy"] != "limit"]
    fewest = min((r.get("workers", 0) for r in rows), default=0)
    rows = [r for r in rows if r.get("workers", 0) == fewest]
    specs: list[tuple[str, dict, str | None]] = [(row_label(r), r, None) for r in rows]
    dense = next((r for r in rows if r["strategy"] == "sync_easgd" and r["compression"] == "none"), None)
    if dense is not None:
        specs += [("sync_easgd/none (SC17 tree)", dense, "tree"),
                  ("sync_easgd/none (hierarchical)", dense, "hierarchical")]
    return specs


def _efficiencies(row: dict, collective: str | None, inputs: dict, layout: dict,
                  net: Callable[[str, int, float], float], workers: Sequence[int]) -> list[float]:
    """t_c / T(P) of one row on one layout at each worker count (1 at one worker);
    ``collective``: the all-reduce done another way (:func:`_projected_rows`)."""
    x = row_inputs(row, inputs)
    opts = row_options(row)
    t_c = x["t_compute_1"] * layout["compute_factor"]
    row_net = net
    if collective is not None:
        def row_net(name, p, nb, _c=collective, _net=net):  # all-reduce another way
            return _net(_c if name == "ring" else name, p, nb)
    effs = []
    for p in workers:
        if p == 1:
            effs.append(1.0)
            continue
        t_k = x["t_codec_1"](p) * layout["compute_factor"]
        pred = step_time(
            row["strategy"], p, n=x["n"], m=x["m"], t_compute=t_c, t_codec=t_k,
            net=row_net, aggregation=x["aggregation"], calls=x["calls"], **opts,
        )
        effs.append(t_c / pred["step_s"])
    return effs


def project(
    model: dict[str, dict],
    inputs: dict,
    workers: Sequence[int] | None = None,
    layouts: dict[str, dict] | None = None,
) -> dict:
    """Weak-scaling efficiency t_c / T(P) of every measured row, plus Sync EASGD with
    SC17's tree and with hierarchical reduction, on each layout (default :data:`LAYOUTS`)."""
    workers = list(workers or _workers_axis())
    layouts = layouts or LAYOUTS
    specs = _projected_rows(inputs)
    curves: dict[str, dict[str, list]] = {}
    for lname, layout in layouts.items():
        net = layout_net(model, layout)
        curves[lname] = {label: _efficiencies(row, collective, inputs, layout, net, workers)
                         for label, row, collective in specs}
    table = {
        lname: {
            label: {str(p): effs[workers.index(p)] for p in PROJECTION_WORKERS if p in workers}
            for label, effs in lay.items()
        }
        for lname, lay in curves.items()
    }
    return {
        "note": PROJECTION_NOTE, "workers": workers, "curves": curves, "table": table,
        "layouts": {k: v["description"] for k, v in layouts.items()},
        "layout_parameters": layouts,
        "sc17": {"workers": SC17_POINT[0], "efficiency": SC17_POINT[1],
                 "what": "SC17: Sync EASGD, 91.5% weak scaling on 4253 KNL cores (measured there)"},
        "workload": {"dense_bytes": dense_bytes(inputs),
                     "what": "the measured workload (its bytes, compute and codec per step)"},
    }
