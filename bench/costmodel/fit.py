"""The fit of the cost model (:mod:`bench.costmodel.terms`) on the probe's measurements.

**Fit.** For each collective, the probe (``bench/costmodel/probe.py``) times it on the
emulated cluster at 2, 4 and 8 ranks, at three link rates and four message sizes (the
slowest rank, median of 3). Each sample gives one linear equation
``t = alpha * k_alpha + (k_bytes / R) * (1 / eta)``; :func:`fit_alpha_beta` solves them by
least squares in float64, each row weighted by 1/t (relative errors, so the small
messages that fix alpha count as much as the large ones), k_bytes with the probe rate's
token-bucket burst B; the fan-in's also gives phi (:func:`fit_overlap`). With alpha held,
eta is also fitted at each probed p (:func:`fit_eta_by_p`): the rows, measured at probed
p's, use that; the projection the all-p eta. With more ranks than cores
(8 ranks on this 2-core machine) every hop also waits for the next rank to be scheduled,
so k_alpha is scaled by max(1, p / cores): alpha is the latency of ranks that have a core
each (what the projection uses), and the predictions on the emulated cluster scale it
back, as they scale compute and codec time.

**Loops: the synchronisation cost.** The idle probe times collectives between barriers on
idle ranks. In training the ranks compute between collectives, on the same cores (here
more ranks than cores), so a collective starts when the slowest rank's compute ends and
its hops wait for ranks that are being scheduled. The probe therefore also times three
loop shapes around a fixed CPU kernel (``bench/costmodel/probe.py --loops``, at the
smallest and the largest message of each rate): the kernel alone (F), kernel + blocking
collective (serial) and kernel + the previous iteration's non-blocking collective
(overlapped), for the all-reduce and the all-gather. :func:`fit_loops` pairs each loop
sample with F and with C, the idle probe's sample at the same p, rate and size. Serial:
T = F + C + s, s(p, shape) the median of T - F - C. Overlapped: T = F + C - h min(F, C) + s,
h(p, shape) in [0, 1] the share of the shorter one the overlap actually hides (least
squares of T - F - C on min(F, C); 1 is the ideal max(F, C)), then s the median of the
rest. s is read at the smallest message, where C is a few alpha: it is a wait, not a
transfer, and at tens of ms of the link T - F - C is the difference of two noisy timings
of the same transfer (it is reported per size too). Two more serial loops run 2 and 4
blocking all-reduces per iteration (smallest message): :func:`fit_rounds` fits ``T_r - F - r C = s_0 + r s_r``,
s_r the cost of each further blocking round; a serial all-reduce row whose exchange sends
k messages in turn (PowerSGD's rounds) is charged ``s + (k - 1) s_r``, or, where the
probe ran ``loop_serial_ring_codec`` (the codec's compute between two blocking rounds,
sized from the exchange's measured codec: (k - 1)/k of it), ``s + (k - 1) s_c`` with
s_c from :func:`fit_codec_rounds`. One more loop,
``loop_ps`` (largest message), has the asynchronous strategies' shape: workers compute,
then exchange with the server in turn, the server kept busy. The fan-in probe fits phi on
one burst of simultaneous requests; training keeps the server busy with requests that
arrive in turn, step after step, so :func:`fit_ps_loop` solves each server-bound loop
sample, T = PS server round(p, n), for phi at its p and rate (the share varies with the
rate at a fixed p: 0.4 / 0.7 / 0.4 at 50 / 200 / 1000 Mbit/s in one batch; the loop also
runs at the workload's dense message n in every phase, and where it did only those samples
count, so that phi varies with the rate and not with the probe's message size), and the
server-round and round-robin formulas of the rows use that phi where it was measured at
their p, linear in log(rate) between the probed rates (the fan-in's phi elsewhere, and in
the projection). The probe's kernel is sized (``--kernel-matmuls``) from the limit row,
measured first, so that the loops compute per iteration what the workload computes per
step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence

import numpy as np

from bench.costmodel.terms import (
    COLLECTIVES,
    OVERLAPPED,
    after_burst,
    collective_terms,
    emulated_burst_bytes,
    rate_bps,
)

__all__ = [
    "LOOP_SHAPES",
    "busy_phi",
    "cpu_share",
    "fit",
    "fit_alpha_beta",
    "fit_codec_rounds",
    "fit_eta_by_p",
    "fit_loops",
    "fit_overlap",
    "fit_ps_loop",
    "fit_rounds",
    "free_times",
    "idle_times",
]


def fit_alpha_beta(
    k_alpha: Sequence[float], k_bytes_over_rate: Sequence[float], times: Sequence[float]
) -> tuple[float, float]:
    """Least squares for ``t = alpha k_alpha + (k_bytes / R) / eta`` (float64).

    Args:
        k_alpha: latency count of each sample.
        k_bytes_over_rate: bytes term of each sample divided by the nominal rate (s); pass
            ``k_bytes`` itself to fit ``1 / beta`` directly.
        times: measured seconds.

    Returns:
        ``(alpha, eta)`` (or ``(alpha, beta)`` when the rates were 1).

    Raises:
        ValueError: fewer than two samples, or samples that do not determine both.
    """
    a = np.column_stack([np.asarray(k_alpha, np.float64), np.asarray(k_bytes_over_rate, np.float64)])
    t = np.asarray(times, np.float64)
    if a.shape[0] < 2 or np.linalg.matrix_rank(a) < 2:
        raise ValueError("need samples with at least two independent (k_alpha, k_bytes) pairs")
    w = 1.0 / np.where(t > 0, t, 1.0)
    (alpha, inv_eta), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    return float(alpha), float(1.0 / inv_eta)


def cpu_share(k: int, cpus: int) -> float:
    """Slow-down of k busy processes on c cores: max(1, k / c)."""
    return max(1.0, k / max(1, cpus))


def fit_overlap(k_alpha: Sequence[float], serial: Sequence[float], overlapped: Sequence[float],
                times: Sequence[float]) -> float:
    """The share phi of each server reply that drains behind the next request, from the
    fan-in probe: least squares (rows weighted by 1/t) of
    ``t = alpha k_alpha + serial / eta - phi overlapped / eta`` for (alpha, 1/eta, phi/eta),
    with ``serial`` = 2(p-1) max(0, n - B) / R and ``overlapped`` = (p-2) max(0, n - B) / R:
    p = 2 (no next request) pins the serial cost, 4 and 8 ranks the hidden share.
    Clipped to [0, 1]; 0 (all serial) where the samples do not determine it."""
    a = np.column_stack([np.asarray(k_alpha, np.float64), np.asarray(serial, np.float64),
                         -np.asarray(overlapped, np.float64)])
    t = np.asarray(times, np.float64)
    if a.shape[0] < 3 or np.linalg.matrix_rank(a) < 3:
        return 0.0
    w = 1.0 / np.where(t > 0, t, 1.0)
    (_, inv_eta, phi_inv_eta), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
    if inv_eta <= 0:
        return 0.0
    return float(min(1.0, max(0.0, phi_inv_eta / inv_eta)))


def fit(samples: Sequence[dict], cpus: int | None = None,
        burst: Callable[[float], float] | None = None) -> dict[str, dict]:
    """Fit every probed collective.

    Args:
        samples: ``{"op", "p", "bytes", "rate_mbit", "time_s"}`` each.
        cpus: the cores the probe's ranks shared. When given, each latency count is
            scaled by :func:`cpu_share` (p, cpus): with more ranks than cores every hop
            also waits for the next rank to be scheduled, so the fitted ``alpha_s`` is the
            latency of ranks that have a core each (what the projection uses).
        burst: ``burst(rate_mbit) -> bytes``, the links' token-bucket burst B at each
            probe rate (:func:`emulated_burst_bytes`); None: no bucket (B = 0).

    Returns:
        ``{op: {"alpha_s", "eta", "samples", "max_rel_err", "median_rel_err", "cpus",
        "burst"}}`` (``burst``: whether B was charged, as :func:`fitted_net` must); ``ps``
        also ``overlap`` (phi, :func:`fit_overlap`).
    """
    out: dict[str, dict] = {}
    for op in COLLECTIVES:
        rows = [s for s in samples if s["op"] == op and s["p"] > 1]
        if len(rows) < 2:
            continue
        share = [cpu_share(s["p"], cpus) if cpus else 1.0 for s in rows]
        bursts = [burst(s["rate_mbit"]) if burst else 0.0 for s in rows]
        rates = [rate_bps(s["rate_mbit"]) for s in rows]
        times = [s["time_s"] for s in rows]
        extra: dict = {}
        overlap = 0.0
        if op in OVERLAPPED:
            x = [after_burst(s["bytes"], b) / r for s, b, r in zip(rows, bursts, rates)]
            overlap = fit_overlap(
                [collective_terms(op, s["p"], s["bytes"])[0] * f for s, f in zip(rows, share)],
                [2.0 * (s["p"] - 1) * v for s, v in zip(rows, x)],
                [(s["p"] - 2) * v for s, v in zip(rows, x)], times)
            extra["overlap"] = overlap
        ka, kb = zip(*(collective_terms(op, s["p"], s["bytes"], b, overlap) for s, b in zip(rows, bursts)))
        ka = [a * f for a, f in zip(ka, share)]
        kbr = [k / r for k, r in zip(kb, rates)]
        alpha, eta = fit_alpha_beta(ka, kbr, times)
        errs = [abs(alpha * a + b / eta - t) / t for a, b, t in zip(ka, kbr, times)]
        out[op] = {
            "alpha_s": alpha, "eta": eta, "samples": len(rows),
            "max_rel_err": max(errs), "median_rel_err": statistics.median(errs), "cpus": cpus,
            "burst": burst is not None,
            "eta_by_p": fit_eta_by_p(alpha, [s["p"] for s in rows], ka, kbr, times, eta), **extra,
        }
    return out


def fit_eta_by_p(alpha: float, ps: Sequence[int], k_alpha: Sequence[float],
                 k_bytes_over_rate: Sequence[float], times: Sequence[float], eta: float) -> dict[str, float]:
    """The bandwidth share at each probed p with the shared alpha held: per p, the
    1/t-weighted least squares of ``t - alpha k_alpha = (k_bytes / R) / eta_p`` (eta where
    that is not positive). On the emulated cluster eta_p rises with p (ring: 0.83-0.88 /
    1.05-1.10 / 1.33-1.48 at p = 2 / 4 / 8 in batches F-H): the ring's 2(p-1) hops of n/p
    bytes each start on a link that was idle while its ranks waited for a core, so more of
    each hop passes in the token bucket's burst as p grows. The predictions of the rows,
    on the emulated cluster at a probed p, use eta_p; the projection (no bucket) the
    all-p eta."""
    out: dict[str, float] = {}
    for p in sorted(set(ps)):
        idx = [i for i, q in enumerate(ps) if q == p]
        x = np.array([k_bytes_over_rate[i] / times[i] for i in idx], np.float64)
        y = np.array([(times[i] - alpha * k_alpha[i]) / times[i] for i in idx], np.float64)
        inv = float(x @ y / (x @ x)) if float(x @ x) > 0 else 0.0
        out[str(p)] = 1.0 / inv if inv > 0 else eta
    return out


def idle_times(probe: Sequence[dict]) -> dict[tuple, float]:
    """The idle probe's times by (op, p, bytes, rate)."""
    return {(s["op"], s["p"], s["bytes"], s["rate_mbit"]): s["time_s"] for s in probe}


def free_times(loops: Sequence[dict]) -> dict[tuple, float]:
    """The kernel-alone loops' (``loop_free``, F) times by (p, bytes, rate)."""
    return {(s["p"], s["bytes"], s["rate_mbit"]): s["time_s"] for s in loops if s["op"] == "loop_free"}


LOOP_SHAPES = ("serial_ring", "overlap_ring", "serial_allgather", "overlap_allgather")


def fit_loops(loops: Sequence[dict], probe: Sequence[dict]) -> dict:
    """The synchronisation cost s and the hidden share h of a compute loop around each
    collective shape, per p.

    Each loop sample (``bench/costmodel/probe.py --loops``: per iteration, the slowest
    rank) is paired with the same rate and message's ``loop_free`` sample (F: the kernel
    alone, the ranks sharing the cores) and the idle probe's sample of the collective (C).
    Serial loops: T = F + C + s, s the median over rates of T - F - C at the smallest
    message. Overlapped loops: T = F + C - h min(F, C) + s, h the share of the shorter of
    compute and collective that the overlap actually hides (1: T = max(F, C) + s, the
    ideal; 0: nothing hidden), fitted by least squares of T - F - C on min(F, C) over every
    size and clipped to [0, 1], then s the median of T - F - C + h min(F, C) at the
    smallest message. s is a wait, not a transfer, so it is read where C is a few alpha:
    at the largest messages T - F - C is the difference of two timings of a transfer of
    tens of ms, whose noise is ms (batch L, 2-rank all-gather: 0.1 / -4.4 / -3.6 / -10.4 ms
    by size, ascending; their median, -2.3 ms, had put a DGC row 27% low). The medians at
    every size are kept (``by_size``) to show it.

    Returns:
        ``{"free_s": {p: F}, "sync_s": {shape: {p: s}}, "hidden": {shape: {p: h}},
        "by_size": {shape: {p: {bytes: s}}}, "samples": n}`` (p as strings, JSON keys).
    """
    idle = idle_times(probe)
    free = free_times(loops)
    out: dict = {"free_s": {}, "sync_s": {}, "hidden": {}, "by_size": {}, "samples": 0}
    for p in sorted({s["p"] for s in loops}):
        fs = [t for (q, _, _), t in free.items() if q == p]
        if fs:
            out["free_s"][str(p)] = statistics.median(fs)
    for shape in LOOP_SHAPES:
        mode, coll = shape.split("_")
        points: dict[int, list[tuple[int, float, float]]] = {}  # p -> (bytes, T - F - C, min(F, C))
        for s in loops:
            if s["op"] != f"loop_{shape}":
                continue
            f = free.get((s["p"], s["bytes"], s["rate_mbit"]))
            c = idle.get((coll, s["p"], s["bytes"], s["rate_mbit"]))
            if f is None or c is None:
                continue
            points.setdefault(s["p"], []).append((s["bytes"], s["time_s"] - f - c, min(f, c)))
            out["samples"] += 1
        for p, pts in points.items():
            h = 0.0
            if mode == "overlap":
                h = 1.0
                x = np.array([q[2] for q in pts])
                if len(pts) >= 2 and np.ptp(x) > 0:
                    a = np.column_stack([np.ones_like(x), -x])
                    (_, h_ls), *_ = np.linalg.lstsq(a, np.array([q[1] for q in pts]), rcond=None)
                    h = float(min(1.0, max(0.0, h_ls)))
                out["hidden"].setdefault(shape, {})[str(p)] = h
            by_size: dict[int, list[float]] = {}
            for b, y, x in pts:
                by_size.setdefault(b, []).append(y + h * x)
            out["sync_s"].setdefault(shape, {})[str(p)] = statistics.median(by_size[min(by_size)])
            out["by_size"].setdefault(shape, {})[str(p)] = {
                str(b): statistics.median(cs) for b, cs in sorted(by_size.items())}
    out.update(fit_rounds(loops, idle, free))
    return out


def _rounds_of(op: str) -> int | None:
    """Blocking all-reduces per iteration of a serial ring loop (None: another loop)."""
    if op == "loop_serial_ring":
        return 1
    if op.startswith("loop_serial_ring_x"):
        return int(op.rsplit("_x", 1)[1])
    return None


def fit_rounds(loops: Sequence[dict], idle: dict, free: dict) -> dict:
    """Whether the synchronisation cost is paid per exchange or per blocking round.

    The probe's ``loop_serial_ring_x<r>`` loops run r blocking all-reduces after the
    kernel (at the smallest message of each rate, beside ``loop_serial_ring``, r = 1).
    Per p, least squares over rates of ``T_r - F - r C = s_0 + r s_r``: s_r the cost each
    further blocking round adds (0: paid once per exchange, whatever its rounds), clipped
    at 0; s_0 what is paid once.

    Returns:
        ``{"per_round_s": {p: s_r}, "fixed_s": {p: s_0}, "by_rounds": {p: {r: median}}}``.
    """
    keys = {(s["p"], s["bytes"], s["rate_mbit"]) for s in loops if (_rounds_of(s["op"]) or 1) > 1}
    points: dict[int, list[tuple[int, float]]] = {}
    for s in loops:
        r, key = _rounds_of(s["op"]), (s["p"], s["bytes"], s["rate_mbit"])
        if r is None or key not in keys or key not in free or ("ring", *key) not in idle:
            continue
        points.setdefault(s["p"], []).append((r, s["time_s"] - free[key] - r * idle[("ring", *key)]))
    out: dict = {"per_round_s": {}, "fixed_s": {}, "by_rounds": {}}
    for p, pts in sorted(points.items()):
        rs = np.array([float(r) for r, _ in pts])
        if np.ptp(rs) == 0:
            continue
        (s0, sr), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(rs), rs]),
                                       np.array([y for _, y in pts]), rcond=None)
        out["per_round_s"][str(p)] = max(0.0, float(sr))
        out["fixed_s"][str(p)] = float(s0)
        out["by_rounds"][str(p)] = {
            str(r): statistics.median(y for q, y in pts if q == r) for r in sorted({r for r, _ in pts})}
    return out


def fit_codec_rounds(loops: Sequence[dict], probe: Sequence[dict], sync_serial: dict[str, float],
                     kernel: dict | None) -> dict[str, float]:
    """The cost of each further blocking round when the codec computes between the rounds,
    per p, from the probe's ``loop_serial_ring_codec`` (kernel F, all-reduce, a shorter
    kernel f, all-reduce; f = F x between / matmuls, the same products): T - F - f - 2C
    = s + s_c, s the serial loop's once-per-exchange cost at p (``sync_s["serial_ring"]``),
    so s_c = the median over rates of T - F - f - 2C, minus s, clipped at 0.

    Returns:
        ``{p: s_c}`` (p as strings); empty without such samples or kernel sizes.
    """
    if not kernel or not kernel.get("between_matmuls") or not kernel.get("matmuls"):
        return {}
    share = kernel["between_matmuls"] / kernel["matmuls"]
    idle = idle_times(probe)
    free = free_times(loops)
    excess: dict[int, list[float]] = {}
    for s in loops:
        key = (s["p"], s["bytes"], s["rate_mbit"])
        if s["op"] != "loop_serial_ring_codec" or key not in free or ("ring", *key) not in idle:
            continue
        f_total = free[key] * (1.0 + share)
        excess.setdefault(s["p"], []).append(s["time_s"] - f_total - 2.0 * idle[("ring", *key)])
    return {str(p): max(0.0, statistics.median(v) - sync_serial.get(str(p), 0.0))
            for p, v in sorted(excess.items())}


def fit_ps_loop(loops: Sequence[dict], model: dict[str, dict]) -> dict[str, dict[str, float]]:
    """phi of a server kept busy, per p and link rate, from the probe's ``loop_ps``
    samples (workers computing then exchanging with the server in turn, the asynchronous
    strategies' shape). Once the server bounds the period, an iteration is its round,
    T = 2(p-1) alpha + (p-1)(2 - phi) x with x = max(0, n - B) / beta (alpha, beta and B of
    the fitted ``ps`` probe, alpha scaled by the CPU share), so each sample gives
    phi = 2 - (T - 2(p-1) alpha) / ((p-1) x), clipped to [0, 1] (the median where a (p,
    rate) has several). Samples with one worker (no next request), no bytes past the
    burst, or where the worker's own chain (the kernel alone F + its exchange W) is as long
    as T (not server-bound) say nothing about phi and are skipped. Per rate because the
    probe shows the share varying with the rate at a fixed p (why was not measured);
    :func:`busy_phi` interpolates. Where the probe also ran the loop at the workload's
    message (``"at": "workload"``), only those samples count: phi then varies with the
    rate alone, not with the probe's message size, which grows with the rate.

    Returns:
        ``{p: {rate_mbit: phi}}`` (both as strings); empty without samples or a ``ps`` fit.
    """
    par = model.get("ps")
    if not par:
        return {}
    free = free_times(loops)
    found: dict[int, dict[float, list[float]]] = {}
    at_workload = any(s.get("at") == "workload" for s in loops if s["op"] == "loop_ps")
    for s in loops:
        p = s["p"]
        if s["op"] != "loop_ps" or p < 3 or at_workload and s.get("at") != "workload":
            continue
        alpha = par["alpha_s"] * (cpu_share(p, par["cpus"]) if par.get("cpus") else 1.0)
        burst = emulated_burst_bytes(s["rate_mbit"]) if par.get("burst") else 0.0
        eta = (par.get("eta_by_p") or {}).get(str(p), par["eta"])
        x = after_burst(s["bytes"], burst) / (eta * rate_bps(s["rate_mbit"]))
        worker = free.get((p, s["bytes"], s["rate_mbit"]), 0.0) + 4.0 * alpha + 2.0 * x
        if x <= 0 or worker >= s["time_s"]:
            continue
        phi = 2.0 - (s["time_s"] - 2.0 * (p - 1) * alpha) / ((p - 1) * x)
        found.setdefault(p, {}).setdefault(float(s["rate_mbit"]), []).append(min(1.0, max(0.0, phi)))
    return {str(p): {f"{r:g}": statistics.median(v) for r, v in sorted(by_rate.items())}
            for p, by_rate in sorted(found.items())}


def busy_phi(by_rate: dict[str, float], rate_mbit: float) -> float:
    """phi at ``rate_mbit`` from :func:`fit_ps_loop`'s values at one p: linear in
    log(rate) between the two probed rates around it, the nearest one's outside them."""
    pts = sorted((float(r), v) for r, v in by_rate.items())
    if rate_mbit <= pts[0][0]:
        return pts[0][1]
    for (r0, v0), (r1, v1) in zip(pts, pts[1:]):
        if rate_mbit <= r1:
            w = math.log(rate_mbit / r0) / math.log(r1 / r0)
            return v0 + w * (v1 - v0)
    return pts[-1][1]
