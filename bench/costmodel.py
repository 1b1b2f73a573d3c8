r"""Alpha-beta cost model fitted on the emulated cluster, and a weak-scaling projection.

Every collective the strategies use costs, on p ranks and a message of n bytes,
``k_alpha(p) * alpha + k_bytes(p, n) / beta``: alpha is the per-message latency (software
and network), beta the bandwidth a rank achieves, fitted as ``beta = eta * R`` with R the
link's nominal rate and eta the share of it the collective gets. The terms:

=================  =====================  ==========================  ===========================
collective         k_alpha                k_bytes                     used by
=================  =====================  ==========================  ===========================
ring all-reduce    2 (p - 1)              2 (p - 1) n / p             ddp, sync_easgd, local_sgd,
                                                                      fp16 / PowerSGD payloads
tree all-reduce    2 ceil(log2 p)         2 ceil(log2 p) n            SC17's Sync EASGD (reduce +
                                                                      broadcast, binomial tree)
all-gather         p - 1                  (p - 1) m                   sparse payloads (topk, DGC,
                                                                      ...): m per rank, so the
                                                                      bytes grow with p
broadcast (gloo)   p - 1                  (p - 1) n                   set-up, center to workers:
                                                                      the root sends to each rank
PS fan-in (probe)  2 p                    (2(p-1) - (p-2) phi) n      the probe's fan-in: p - 1
                                                                      workers push at once, the
                                                                      slowest (last served) one
PS server round    2 (p - 1)              (p - 1)(2 - phi) n          async EASGD / SGD: the
                                                                      server's throughput bound
PS worker          4                      2 n                         one worker's own exchange
round robin        p - 1 (p >= 3);        (p - 1)(2 - phi) n;         original EASGD: the master
                   2 (p = 2)              2 n (p = 2)                 serves workers one by one
                                                                      (PS's alpha, beta, phi)
=================  =====================  ==========================  ===========================

so e.g. ring all-reduce = 2(p-1)(alpha + n/(p beta)), tree = 2 log2(p) (alpha + n/beta),
all-gather = (p-1)(alpha + m/beta).

**The server's replies and full duplex** (``strategies/ps/server.py``,
``strategies/round_robin.py``, ``bench/_netem.py``). Every host has its own egress token
bucket and the bridge port to it shapes the other direction, so a host can send and
receive at the full rate at once. gloo's send / receive (torch's ``dist.send`` / ``recv``)
is a rendezvous: a payload moves only once its receiver has posted the receive. The
server serves one request at a time: the header from any source, then that worker's
payload (two rendezvous: 2 alpha; n bytes on the server's bridge port), the update, then
the reply (header and payload: the worker posted both receives with its request, so they
go at once) by a blocking send, which returns when the last byte is in the socket; the
socket's send buffer is the kernel's autotuned one (gloo sizes SO_SNDBUF for its bound
buffers only, not for these unbound sends), so a share phi of the reply (what the buffer
holds) is still draining on the server's egress and the worker's port while the server
receives the next request on its own port, and 1 - phi of it is serial. phi = 1 is the
ideal full duplex (the fan-in costs p n, only the last reply exposed), phi = 0 the old
serial 2 (p-1) n; phi is fitted on the probe's fan-in (:func:`fit_overlap`: 2 ranks have no
next request and pin the serial cost, 4 and 8 ranks the hidden share). In training the
p - 1 workers keep the server busy: a worker's period of tau steps is its own exchange W
= PS worker (behind its compute with overlap) or the server's round S = PS server round
of the p - 1 requests, whichever is longer (for p >= 3, S >= W: the last reply's tail
drains behind the next round's requests). The round-robin master does the same with one
message per request (alpha), its replies overlapping the next worker's push; with p >= 3
the last reply's tail drains while the master computes and the next round starts.

**The emulated token bucket** (``bench/_netem.py``'s ``tbf_params``: burst B = 2 ms of the
link, at least two 1600-byte packets). After an idle gap the bucket is full and a transfer's
first B bytes pass at line rate, through both shapers (the host's then the bridge port's):
on the emulated cluster each transfer that starts on an idle link is charged
max(0, b - B) / beta. The collectives that keep their links busy from step to step
(ring, all-gather, broadcast) count B once per call; the tree once per phase (the root's
port receives every reduce level, its egress sends every broadcast level); the server and
round robin once per request and per reply (each starts on a link idle since its last
one). k_bytes above is at B = 0; the projection's links have no bucket (B = 0). **Hierarchical reduction** (SC17's KNL layout: q
workers per node reduce through shared memory, nodes through the network) on P = N q
workers: ``2 ceil(log2 q) (alpha_i + n/beta_i)`` (tree reduce and broadcast inside the
node) ``+ ring(N, n)`` over the N nodes' links.

**Fit.** For each collective, the probe (``bench/costmodel_probe.py``) times it on the
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
loop shapes around a fixed CPU kernel (``bench/costmodel_probe.py --loops``, at the
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

**Step time** of a (strategy, compression) row on p ranks (:func:`step_time`), with t_c the
measured compute per step (the ``limit`` row: same hosts, no communication; CPU sharing of
k computing processes on c cores scales it by max(1, k/c)), t_k the codec time of one
exchange (:func:`measure_exchange_codec`: error feedback, compression, this rank's decode
and the decode of every rank's payload (all-gather) or of the sum (all-reduce), on the
model's own tensors; linear in p between the measured world sizes; same CPU scaling; for
the all-reduce / all-gather family (:data:`LOCAL_STRATEGIES`) the row's own configuration
run with min(p, cores) ranks on one host instead (loopback, no shaped link), less the
limit row run the same way, each outside its exposed communication (the loopback transfers
and the waits inside the collectives, which C and s charge), per worker with a core
(:func:`local_cost`: the codec and the strategy's machinery per step, DDP's reducer, the
elastic update and the other ranks' threads included, which the codec timed alone leaves
out; the same CPU scaling to p, plus the codec's growth to p)), n
the dense message, m the payload a rank sends per exchange and k its messages
(:func:`count_exchange_messages`: the exchange run through the strategies' own collective
on a one-rank group, e.g. PowerSGD: a P and a Q round per matrix plus the small tensors'
dense all-reduce), C = k x ring(p, m/k) (linear payloads) or k x all-gather(p, m/k)
(sparse payloads), s = s(p, the row's loop shape):

- ``ddp``: t_c + t_k + C + s (serial; s + (k - 1) s_r for k blocking all-reduces);
- ``sync_easgd``: the same, C and s per exchange / tau; with ``overlap`` the exchange runs
  behind the next step's compute: t_c + C - h min(t_c, C) + t_k + s (overlapped; h = 1:
  max(t_c, C) + t_k + s);
- ``local_sgd``: t_c + (ring(p, n) + s) / tau;
- ``easgd_round_robin``: t_c + round robin(p, n) / tau;
- ``async_easgd`` (server = one rank, p - 1 workers; W = PS worker(n), S = PS server
  round(p, n)): max((tau - 1) t_c + max(t_c, W), S) / tau with overlap (tau = 1:
  max(t_c, W, S)), max(tau t_c + W, S) / tau without (no loop shape probed: s = 0);
- ``limit``: t_c.

**Held out.** The fit uses only the probe (collectives and loops), the limit rows
(compute), the local runs and the codec measurements (time, messages and bytes of each exchange); every
training row's step time is a prediction, reported against its measured step time
(target: within 15%), at a link rate the probe did not use, on each of the rows' rank
counts (``--rows-workers``, default 2 and 4: one rank per core of this machine, and two
per core), each from the limit row of its own p. A row's step time is its steady state:
the difference of a run and its first steps (``bench/_tables.py``), on the training
clock (summary.json's ``train_time_s``: batches only, not ``fit``'s set-up), the median of
``--repeats`` runs (default 3; their spread printed beside it), as are the limit rows'
and the local runs'. Each held-out row's own meter (communication, exposed and codec time,
messages per step) is printed beside its prediction for diagnosis; none of it enters a
prediction (the local runs' meters do: their step outside the exposed communication).

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

Usage::

    sudo .venv/bin/python bench/costmodel.py --measure            # probe + rows, then fit
    .venv/bin/python bench/costmodel.py --fit bench/results/costmodel/costmodel_inputs.json
    easgd-report bench/results/costmodel                          # adds the projection

Outputs in ``--out`` (default ``bench/results/costmodel``): ``costmodel_inputs.json`` (the
measurements), ``costmodel.json`` (fit, predictions, projection), ``costmodel.md`` and
``costmodel_projection.png``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = [
    "COLLECTIVES",
    "LAYOUTS",
    "allgather_terms",
    "broadcast_terms",
    "busy_phi",
    "collective_time",
    "fit",
    "fit_alpha_beta",
    "fit_codec_rounds",
    "fit_eta_by_p",
    "fit_ps_loop",
    "hierarchical_allreduce_time",
    "layouts_with",
    "predict_rows",
    "project",
    "ps_terms",
    "ring_terms",
    "round_robin_terms",
    "step_time",
    "tree_terms",
]

PROJECTION_NOTE = (
    "MODEL PROJECTION, not a measurement: the alpha-beta model fitted on the emulated "
    "cluster, extrapolated to layouts and scales that were not run."
)
SC17_POINT = (4253, 0.915)  # Sync EASGD weak scaling on 4253 KNL cores (SC17)
PROJECTION_WORKERS = (64, 512, 4096)


# ---------------------------------------------------------------- collective formulas
def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def _after_burst(nbytes: float, burst: float) -> float:
    """Bytes a token bucket of ``burst`` bytes, full after an idle link, makes wait for
    its rate: the first ``burst`` bytes of a transfer pass at line rate."""
    return max(0.0, nbytes - burst)


def ring_terms(p: int, n: float, burst: float = 0.0) -> tuple[float, float]:
    """Ring all-reduce (reduce-scatter + all-gather): 2(p-1) steps of n/p bytes; each link
    carries the steps back to back, so its bucket's burst counts once."""
    return 2.0 * (p - 1), _after_burst(2.0 * (p - 1) * n / p, burst)


def tree_terms(p: int, n: float, burst: float = 0.0) -> tuple[float, float]:
    """Binomial-tree reduce then broadcast: 2 ceil(log2 p) steps of n bytes. The root's
    port receives every reduce level and its egress sends every broadcast level back to
    back: one burst per phase."""
    return 2.0 * _log2(p), 2.0 * _after_burst(_log2(p) * n, burst)


def allgather_terms(p: int, m: float, burst: float = 0.0) -> tuple[float, float]:
    """Ring all-gather of m bytes per rank: p-1 steps of m (the received bytes grow with p),
    back to back on each link: one burst."""
    return float(p - 1), _after_burst(float(p - 1) * m, burst)


def broadcast_terms(p: int, n: float, burst: float = 0.0) -> tuple[float, float]:
    """gloo's broadcast: the root sends n to each of the p-1 others over its own link, back
    to back: one burst."""
    return float(p - 1), _after_burst(float(p - 1) * n, burst)


def ps_terms(p: int, n: float, burst: float = 0.0, overlap: float = 0.0) -> tuple[float, float]:
    """Parameter-server fan-in as the probe times it (every worker pushes at once; the
    slowest, last served, worker's time). The server serves one request at a time (header
    from any source, then that worker's payload: two rendezvous, 2 alpha, n bytes on its
    bridge port); its blocking reply returns once the reply's tail (a share ``overlap`` = phi
    of it, what fits in the socket's send buffer) is queued, and that tail drains on the
    server's egress and the worker's port while the next request comes in on the server's
    port (full duplex). The last worker waits for p-1 requests, p-2 blocking replies and its
    own whole reply: 2p alpha + (2(p-1) - (p-2) phi) max(0, n - B) / beta, each message
    after an idle link passing its first B bytes at line rate."""
    return 2.0 * p, (2.0 * (p - 1) - (p - 2) * overlap) * _after_burst(n, burst)


def ps_server_terms(p: int, n: float, burst: float = 0.0, overlap: float = 0.0) -> tuple[float, float]:
    """The server's time per round of p-1 requests in training (its throughput bound on a
    worker's step): p-1 services of 2 alpha + (2 - phi) max(0, n - B) / beta, each reply's
    tail hidden behind the next request."""
    return 2.0 * (p - 1), (p - 1) * (2.0 - overlap) * _after_burst(n, burst)


def ps_worker_terms(p: int, n: float, burst: float = 0.0) -> tuple[float, float]:
    """One worker's own exchange (its latency bound): its request (2 alpha + n) then the
    whole reply (2 alpha + n), in turn: 4 alpha + 2 max(0, n - B) / beta."""
    del p
    return 4.0, 2.0 * _after_burst(n, burst)


def round_robin_terms(p: int, n: float, burst: float = 0.0, overlap: float = 0.0) -> tuple[float, float]:
    """Original EASGD's round: the master receives x from worker i (one rendezvous, alpha + n)
    and sends d_i back (blocking while (1 - phi) of it is unsent), then worker i + 1; d_i's
    tail drains on the master's egress while x_{i+1} comes in on its port. With p >= 3 the
    last reply's tail drains behind the master's compute and the next round's first
    requests: (p-1)(alpha + (2 - phi) max(0, n - B) / beta); with one worker its push and
    reply are in turn: 2 (alpha + max(0, n - B) / beta)."""
    if p <= 2:
        return 2.0, 2.0 * _after_burst(n, burst)
    return float(p - 1), (p - 1) * (2.0 - overlap) * _after_burst(n, burst)


COLLECTIVES: dict[str, Callable[..., tuple[float, float]]] = {
    "ring": ring_terms,
    "tree": tree_terms,
    "allgather": allgather_terms,
    "broadcast": broadcast_terms,
    "ps": ps_terms,
}
#: formulas with no probe of their own and the probe whose alpha and beta they use
DERIVED = {"round_robin": ("ps", round_robin_terms), "ps_server": ("ps", ps_server_terms),
           "ps_worker": ("ps", ps_worker_terms)}
#: formulas with the server's reply overlap phi (fitted on the ``ps`` probe)
OVERLAPPED = ("ps", "ps_server", "round_robin")


def probe_of(name: str) -> str:
    """The probed collective whose alpha, beta (and phi) formula ``name`` uses."""
    return DERIVED[name][0] if name in DERIVED else name


def collective_terms(name: str, p: int, n: float, burst: float = 0.0,
                     overlap: float = 0.0) -> tuple[float, float]:
    """(k_alpha, k_bytes) of collective ``name`` (a key of :data:`COLLECTIVES` or
    :data:`DERIVED`); ``burst``: the link's token-bucket burst B (0: no bucket, the
    projection); ``overlap``: phi of the server's replies (PS family and round robin)."""
    terms = DERIVED[name][1] if name in DERIVED else COLLECTIVES[name]
    if name in OVERLAPPED:
        return terms(p, n, burst, overlap)
    return terms(p, n, burst)


def collective_time(name: str, p: int, n: float, alpha: float, beta: float,
                    burst: float = 0.0, overlap: float = 0.0) -> float:
    """Seconds of collective ``name`` on p ranks for n bytes: k_alpha alpha + k_bytes / beta.

    Args:
        name: a key of :data:`COLLECTIVES` or :data:`DERIVED`.
        p: ranks taking part (>= 1; one rank costs nothing).
        n: message bytes (per rank for ``allgather``).
        alpha: latency per message, seconds.
        beta: bandwidth, bytes per second.
        burst: the links' token-bucket burst B, bytes (0 outside the emulated cluster).
        overlap: phi, the share of each server reply that drains behind the next request.
    """
    if p <= 1:
        return 0.0
    k_alpha, k_bytes = collective_terms(name, p, n, burst, overlap)
    return k_alpha * alpha + k_bytes / beta


def emulated_burst_bytes(rate_mbit: float) -> float:
    """The token-bucket burst B of the emulated cluster's links at ``rate_mbit``
    (``bench/_netem.py``'s ``tbf_params``, on both the host egress and the bridge port: a
    transfer after an idle gap passes B bytes through both at line rate)."""
    from bench._netem import tbf_params

    return float(tbf_params(rate_mbit)["burst_bytes"])


def hierarchical_allreduce_time(
    p: int, per_node: int, n: float, intra: tuple[float, float], inter: tuple[float, float]
) -> float:
    """Tree reduce + broadcast inside each node (q = per_node workers, shared memory) and a
    ring all-reduce over the N = ceil(p / q) nodes: 2 ceil(log2 q)(alpha_i + n/beta_i) +
    2 (N-1)(alpha_e + n/(N beta_e)). ``intra`` / ``inter``: (alpha, beta)."""
    q = min(p, per_node)
    nodes = math.ceil(p / q)
    return collective_time("tree", q, n, *intra) + collective_time("ring", nodes, n, *inter)


# ---------------------------------------------------------------- the fit
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


def _rate_bps(rate_mbit: float) -> float:
    return rate_mbit * 1e6 / 8.0


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
        rates = [_rate_bps(s["rate_mbit"]) for s in rows]
        times = [s["time_s"] for s in rows]
        extra: dict = {}
        overlap = 0.0
        if op in OVERLAPPED:
            x = [_after_burst(s["bytes"], b) / r for s, b, r in zip(rows, bursts, rates)]
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

    Each loop sample (``bench/costmodel_probe.py --loops``: per iteration, the slowest
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
        x = _after_burst(s["bytes"], burst) / (eta * _rate_bps(s["rate_mbit"]))
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


def loop_shape(row: dict, aggregation: str) -> str | None:
    """The probe loop a row's exchange has the shape of (None: not probed: the parameter
    server and round robin)."""
    opts = row_options(row)
    coll = "allgather" if aggregation == "allgather" and row["compression"] != "none" else "ring"
    if row["strategy"] in ("ddp", "ddp_compressed", "local_sgd"):
        return f"serial_{coll}"
    if row["strategy"] == "sync_easgd":
        return f"{'overlap' if opts['overlap'] else 'serial'}_{coll}"
    return None


# ---------------------------------------------------------------- step time
def step_time(
    strategy: str,
    p: int,
    *,
    n: float,
    m: float,
    t_compute: float,
    t_codec: float,
    net: Callable[[str, int, float], float],
    aggregation: str = "allreduce",
    calls: float = 1,
    tau: int = 1,
    overlap: bool = False,
    sync_cost: float = 0.0,
    hidden: float = 1.0,
) -> dict:
    """Predicted seconds per step of one row (the module docstring's formulas).

    Args:
        strategy: the strategy name (``limit`` for no communication).
        p: ranks (for the parameter-server family the server is one of them).
        n: dense message bytes; m: the row's payload bytes per exchange.
        t_compute: compute seconds per step of one worker; t_codec: codec seconds per step.
        net: ``net(collective, p, bytes) -> seconds``.
        aggregation: ``allreduce`` or ``allgather`` (the compressor's).
        calls: messages per exchange (:func:`count_exchange_messages`; e.g. PowerSGD's P
            and Q rounds per tensor), the payload m split among them.
        tau: steps per exchange.
        overlap: whether the exchange runs behind the next step's compute.
        sync_cost: seconds a compute loop around this exchange's collective loses per
            exchange beyond compute and the idle collective (:func:`fit_loops`; 0 where
            not measured), added per exchange for the synchronous all-reduce family.
        hidden: with ``overlap``, the share h of min(t_c, C) the overlap hides
            (:func:`fit_loops`; 1: max(t_c, C), the ideal).

    Returns:
        ``{"step_s", "comm_s", "formula"}``.
    """
    if strategy == "limit":
        return {"step_s": t_compute, "comm_s": 0.0, "formula": "t_c"}
    if strategy in ("ddp", "ddp_compressed", "sync_easgd"):
        op = "allgather" if aggregation == "allgather" else "ring"
        comm = calls * net(op, p, m / calls)
        form = f"{op}(p, m)" if calls == 1 else f"{calls:g} x {op}(p, m/{calls:g})"
        comm /= tau
        sync = sync_cost / tau
        extra = " + s" if sync_cost else ""
        if strategy == "sync_easgd" and overlap:
            step = t_compute + comm - hidden * min(t_compute, comm) + t_codec + sync
            if hidden == 1.0:
                return {"step_s": step, "comm_s": comm, "formula": f"max(t_c, {form}/tau) + t_k{extra}"}
            return {"step_s": step, "comm_s": comm,
                    "formula": f"t_c + {form}/tau - {hidden:.2f} min(t_c, C) + t_k{extra}"}
        return {"step_s": t_compute + t_codec + comm + sync, "comm_s": comm,
                "formula": f"t_c + t_k + {form}" + ("/tau" if tau > 1 else "") + extra}
    if strategy == "local_sgd":
        comm = net("ring", p, n) / tau
        return {"step_s": t_compute + comm + sync_cost / tau, "comm_s": comm,
                "formula": "t_c + ring(p, n)/tau" + (" + s/tau" if sync_cost else "")}
    if strategy == "easgd_round_robin":
        comm = net("round_robin", p, n) / tau
        return {"step_s": t_compute + comm, "comm_s": comm, "formula": "t_c + rr(p, n)/tau"}
    if strategy.startswith("async_"):
        # a worker's period of tau steps: its own exchange W (behind its compute with
        # overlap), or the server's round S of the p-1 workers' requests, whichever is longer
        server, worker = net("ps_server", p, n), net("ps_worker", p, n)
        if overlap:
            own = (tau - 1) * t_compute + max(t_compute, worker)
            form = "max((tau-1) t_c + max(t_c, W), S)/tau" if tau > 1 else "max(t_c, W, S)"
        else:
            own = tau * t_compute + worker
            form = "max(tau t_c + W, S)/tau"
        step = max(own, server) / tau
        return {"step_s": step, "comm_s": max(worker, server) / tau, "formula": form}
    raise ValueError(f"no cost formula for strategy {strategy!r}")


#: the training-shaped formulas of a server kept busy (phi from ``loop_ps`` where probed)
BUSY_SERVER = ("ps_server", "round_robin")


def fitted_net(model: dict[str, dict], rate_mbit: float,
               busy_overlap: dict[str, dict[str, float]] | None = None) -> Callable[[str, int, float], float]:
    """``net(collective, p, bytes)`` of the emulated cluster at one link rate (alpha
    scaled by the CPU share of p ranks where the fit was made with ``cpus``; the links'
    token-bucket burst B charged where the fit charged it; eta at p where the probe ran p
    (:func:`fit_eta_by_p`); phi of the fitted ``ps``, or
    for a busy server's round (:data:`BUSY_SERVER`) the one measured at p
    (:func:`fit_ps_loop`), at this rate (:func:`busy_phi`))."""
    def net(name: str, p: int, nbytes: float) -> float:
        par = model[probe_of(name)]
        alpha = par["alpha_s"] * (cpu_share(p, par["cpus"]) if par.get("cpus") else 1.0)
        burst = emulated_burst_bytes(rate_mbit) if par.get("burst") else 0.0
        phi = par.get("overlap", 0.0)
        if name in BUSY_SERVER and busy_overlap and str(p) in busy_overlap:
            phi = busy_phi(busy_overlap[str(p)], rate_mbit)
        eta = (par.get("eta_by_p") or {}).get(str(p), par["eta"])
        return collective_time(name, p, nbytes, alpha, eta * _rate_bps(rate_mbit), burst, phi)
    return net


_STRATEGY_DEFAULTS = {  # the strategies' config defaults that the cost formulas read
    "sync_easgd": {"tau": 1, "overlap": True},
    "async_easgd": {"tau": 1, "overlap": True},
    "easgd_round_robin": {"tau": 1, "overlap": False},
    "local_sgd": {"tau": 8, "overlap": False},
}


def row_options(row: dict) -> dict:
    """tau and overlap of a row: the strategy's defaults, then the row's overrides."""
    opts = dict(_STRATEGY_DEFAULTS.get(row["strategy"], {"tau": 1, "overlap": False}))
    for item in row.get("overrides") or []:
        key, _, value = item.partition("=")
        if key == "strategy.tau":
            opts["tau"] = int(value)
        elif key == "strategy.overlap":
            opts["overlap"] = value.lower() == "true"
    return opts


def _computing(row: dict, p: int) -> int:
    """Processes that compute during a step (the parameter server does not)."""
    return p - 1 if row["strategy"].startswith("async_") else p


def _codec_seconds(exchange: dict, p: int) -> float:
    """Codec seconds of one exchange on p ranks, linear in p between the measured world
    sizes (decoding p payloads: the all-gather's codec grows with p), never below the
    smallest world's."""
    pts = sorted((int(w), float(t)) for w, t in exchange["seconds_by_world"].items())
    (w0, t0), (w1, t1) = pts[0], pts[-1]
    slope = max(0.0, (t1 - t0) / (w1 - w0)) if w1 > w0 else 0.0
    return t0 + slope * (p - w0)


def dense_bytes(inputs: dict) -> float:
    """The dense message: 4 bytes per parameter of the model (float32), else the ddp/none
    row's metered bytes per step (older inputs)."""
    shapes = inputs.get("model_shapes")
    if shapes:
        return 4.0 * sum(math.prod(s) for s in shapes)
    return inputs["dense_bytes"]


def _row_inputs(row: dict, inputs: dict) -> dict:
    """The per-row quantities of :func:`step_time`: n, m, t_c, t_k, aggregation, calls.

    With the per-exchange codec measurement (``codec_exchange``: inputs of this
    measurement, not of the row) the codec time is that of the whole exchange on p ranks
    and the messages and payload bytes are counted through the strategies' collective;
    older inputs fall back to the round trip on one tensor, ``calls`` of the compressor
    and the row's metered payload."""
    p, cpus = row["workers"], inputs["cpus"]
    limit = next(r for r in inputs["rows"] if r["strategy"] == "limit" and r.get("workers") == p)
    t_c1 = limit["step_time_s"] / cpu_share(p, cpus)  # one worker with a core of its own
    codec = inputs["codec"].get(row["compression"]) or {}
    exchange = (inputs.get("codec_exchange") or {}).get(row["compression"])
    share = cpu_share(_computing(row, p), cpus)
    n = dense_bytes(inputs)
    round_trip = codec.get("seconds", 0.0)

    def codec1(q: int) -> float:
        """Codec seconds per exchange on q ranks, one worker per core."""
        return _codec_seconds(exchange, q) if exchange else round_trip

    local = local_cost(row, inputs)

    def t_k1(q: int) -> float:
        """The exchange's local seconds per step on q ranks, one worker per core: the local
        run's cost beyond the limit (codec and the strategy's machinery) where there is one,
        plus the codec's growth from its rank count to q; else the codec alone."""
        if local is None:
            return codec1(q)
        q_run, cost = local
        return cost + (codec1(q) - codec1(q_run) if exchange else 0.0)

    if exchange:
        m, calls = exchange["bytes"], exchange["messages"]
    else:
        m, calls = row.get("bytes_per_exchange") or n, codec.get("calls", 1)
    if row["compression"] == "none":
        m, calls = n, 1
    return {
        "n": n, "m": m, "t_compute": t_c1 * share, "t_compute_1": t_c1,
        "t_codec": t_k1(p) * share, "t_codec_1": t_k1, "calls": calls,
        "aggregation": codec.get("aggregation", "allreduce"),
    }


#: strategies whose rows also run on one host (``local_rows``): the codec and the
#: strategy's machinery per step, measured in training
LOCAL_STRATEGIES = ("ddp", "sync_easgd")


def local_cost(row: dict, inputs: dict) -> tuple[int, float] | None:
    """``(q, seconds)``: what a step of ``row``'s configuration takes beyond the limit row
    when both run on one host (``inputs["local_rows"]``: q ranks over the host's loopback,
    no shaped link; q the largest run count up to the row's p), per worker with a core of
    its own (divided by the CPU share of q computing ranks): the codec with every local step
    of its exchange, the strategy's machinery (DDP's reducer and bucket copies, the elastic
    update, the hooks' bookkeeping, the collectives' software cost) and what the other
    ranks' threads take from the cores, none of which the codec timed alone sees. Each
    run's step is taken outside its exposed communication (its meter's ``rest_s``): the
    loopback transfers and the waits for the other ranks inside the collectives are what
    the network model's C and the loops' s charge (batch N, 2-rank ddp/powersgd on one
    host: step 9.6 ms, 3.0 ms of it exposed in the collectives, most of it waiting; with
    the whole step the row was predicted 35% high). None where the configuration did not
    run on one host."""
    runs = {(_label(r), r.get("workers")): _outside_comm(r) for r in inputs.get("local_rows") or []
            if r.get("status") == "ok" and r.get("step_time_s")}
    if row["strategy"] == "limit":
        return None
    for q in sorted({q for _, q in runs if q is not None and q <= row["workers"]}, reverse=True):
        limit, own = runs.get(("limit/none", q)), runs.get((_label(row), q))
        if limit is not None and own is not None:
            return q, max(0.0, own - limit) / cpu_share(_computing(row, q), inputs["cpus"])
    return None


def _outside_comm(run: dict) -> float:
    """A run's steady step time outside its exposed communication (the whole step for
    inputs measured before the runs kept a meter)."""
    rest = (run.get("meter") or {}).get("rest_s")
    return rest if rest is not None else run["step_time_s"]


def predict_rows(model: dict[str, dict], inputs: dict, loops: dict | None = None) -> list[dict]:
    """Predicted against measured step time of every measured training row (with
    ``loops``, :func:`fit_loops`, the synchronisation cost of the row's loop shape and,
    under ``busy_overlap``, :func:`fit_ps_loop`'s phi of a busy server)."""
    out = []
    for row in inputs["rows"]:
        if row.get("status") != "ok" or row.get("step_time_s") is None:
            continue
        x = _row_inputs(row, inputs)
        opts = row_options(row)
        shape = loop_shape(row, x["aggregation"])
        sync = ((loops or {}).get("sync_s", {}).get(shape) or {}).get(str(row["workers"]), 0.0)
        # each blocking round past the first adds the probe's per-round cost: with the
        # codec between the rounds where probed (fit_codec_rounds), else back to back (fit_rounds)
        codec_round = ((loops or {}).get("codec_round_s") or {}).get(str(row["workers"]))
        per_round = codec_round if codec_round is not None else (
            ((loops or {}).get("per_round_s") or {}).get(str(row["workers"]), 0.0))
        rounds_extra = max(0.0, x["calls"] - 1.0) if shape == "serial_ring" else 0.0
        sync += rounds_extra * per_round
        hidden = ((loops or {}).get("hidden", {}).get(shape) or {}).get(str(row["workers"]), 1.0)
        pred = step_time(
            row["strategy"], row["workers"], n=x["n"], m=x["m"], t_compute=x["t_compute"],
            t_codec=x["t_codec"], net=fitted_net(model, row["rate_mbit"], (loops or {}).get("busy_overlap")),
            aggregation=x["aggregation"], calls=x["calls"], sync_cost=sync, hidden=hidden, **opts,
        )
        measured = row["step_time_s"]
        out.append({
            "row": _label(row), "workers": row["workers"], "rate_mbit": row["rate_mbit"],
            "measured_s": measured, "predicted_s": pred["step_s"], "comm_s": pred["comm_s"],
            "t_compute_s": x["t_compute"], "t_codec_s": x["t_codec"], "payload_bytes": x["m"],
            "messages": x["calls"], "sync_s": sync, "hidden": hidden, "loop_shape": shape,
            "per_round_s": per_round if rounds_extra else 0.0,
            "rel_err": (pred["step_s"] - measured) / measured, "formula": pred["formula"],
            "in_fit": row["strategy"] == "limit", "meter": row.get("meter"),
            "spread": row.get("spread"),
        })
    return out


def ablation(model: dict[str, dict], inputs: dict, loops: dict) -> list[dict]:
    """Each held-out row's error as the model's parts are added in turn: the idle
    collectives with the codec round trip on one tensor, the compressor's nominal calls
    and the row's metered payload (the model before the loops); + the exchange's codec,
    messages and bytes measured on the model's tensors; + the loops' synchronisation cost
    (the full model). What each part explains, row by row."""
    old = {k: v for k, v in inputs.items() if k not in ("codec_exchange", "model_shapes", "local_rows")}
    no_local = {k: v for k, v in inputs.items() if k != "local_rows"}
    variants = {
        "idle": predict_rows(model, old),
        "+ exchange": predict_rows(model, no_local),
        "+ loops": predict_rows(model, no_local, loops),
        "+ local runs": predict_rows(model, inputs, loops),
    }
    out = []
    for k, row in enumerate(variants["idle"]):
        if row["in_fit"]:
            continue
        out.append({"row": f"{row['row']} (p={row['workers']})",
                    **{name: preds[k]["rel_err"] for name, preds in variants.items()}})
    return out


def _label(row: dict) -> str:
    return ";".join([f"{row['strategy']}/{row['compression']}", *(row.get("overrides") or [])])


# ---------------------------------------------------------------- projection
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
    intra_beta = _rate_bps(layout["intra_mbit"])

    def params(name: str) -> tuple[float, float]:
        par = model.get(probe_of(name)) or model["ring"]
        alpha = layout.get("inter_alpha_s")
        return par["alpha_s"] if alpha is None else alpha, par["eta"] * _rate_bps(layout["inter_mbit"])

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
    curves: dict[str, dict[str, list]] = {}
    rows = [r for r in inputs["rows"] if r.get("status") == "ok" and r["strategy"] != "limit"]
    # one row per configuration: the one measured on the fewest ranks (one per core where
    # that is this machine's count: the projection's one worker per core)
    fewest = min((r.get("workers", 0) for r in rows), default=0)
    rows = [r for r in rows if r.get("workers", 0) == fewest]
    for lname, layout in layouts.items():
        net = layout_net(model, layout)
        lay: dict[str, list] = {}
        specs = [(_label(r), r, None) for r in rows]
        dense = next((r for r in rows if r["strategy"] == "sync_easgd" and r["compression"] == "none"), None)
        if dense is not None:
            specs += [("sync_easgd/none (SC17 tree)", dense, "tree"),
                      ("sync_easgd/none (hierarchical)", dense, "hierarchical")]
        for label, row, collective in specs:
            x = _row_inputs(row, inputs)
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
            lay[label] = effs
        curves[lname] = lay
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


# ---------------------------------------------------------------- outputs
def markdown(result: dict) -> str:
    """The fit, the predictions and the projection as markdown."""
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
    loops = result.get("loops") or {}
    if loops.get("sync_s"):
        ps = sorted({int(q) for v in loops["sync_s"].values() for q in v})
        lines += [
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
            cells = []
            for q in ps:
                if str(q) not in by_p:
                    cells.append("")
                    continue
                sizes = loops["by_size"][shape][str(q)]
                per = " / ".join(f"{1e3 * v:.1f}" for v in sizes.values())
                h = (loops.get("hidden", {}).get(shape) or {}).get(str(q))
                cells.append(f"{1e3 * by_p[str(q)]:.1f} ({per})" + ("" if h is None else f", h={h:.2f}"))
            lines.append(f"| {shape} | " + " | ".join(cells) + " |")
        if loops.get("per_round_s"):
            lines.append("| each further blocking all-reduce (s_r) | " + " | ".join(
                f"{1e3 * loops['per_round_s'][str(q)]:.1f} (r: " + " / ".join(
                    f"{r}={1e3 * v:.1f}" for r, v in loops["by_rounds"][str(q)].items()) + ")"
                if str(q) in loops["per_round_s"] else "" for q in ps) + " |")
        if loops.get("codec_round_s"):
            lines.append("| each further blocking all-reduce with the codec between (s_c; used) | " + " | ".join(
                f"{1e3 * loops['codec_round_s'][str(q)]:.1f}" if str(q) in loops["codec_round_s"] else ""
                for q in ps) + " |")
    lines += [
        "",
        "| row | ranks | Mbit/s | measured s/step | spread | predicted | error | t_c | t_k | comm | msgs | s | formula | held out |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in result["predictions"]:
        lines.append(
            f"| {r['row']} | {r['workers']} | {r['rate_mbit']:g} | {r['measured_s']:.4f} | "
            f"{_percent(r.get('spread'))} | {r['predicted_s']:.4f} | {100 * r['rel_err']:+.1f}% | {r['t_compute_s']:.4f} | "
            f"{r['t_codec_s']:.4f} | {r['comm_s']:.4f} | {r.get('messages', 1):g} | "
            f"{r.get('sync_s', 0.0):.4f} | {r['formula']} | "
            f"{'no (fit)' if r['in_fit'] else 'yes'} |"
        )
    metered = [r for r in result["predictions"] if r.get("meter")]
    if metered:
        lines += [
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
    if result.get("ablation"):
        lines += [
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
        for a in result["ablation"]:
            lines.append(f"| {a['row']} | {100 * a['idle']:+.1f}% | {100 * a['+ exchange']:+.1f}% | "
                         f"{100 * a['+ loops']:+.1f}% | {100 * a.get('+ local runs', a['+ loops']):+.1f}% |")
    held = [r for r in result["predictions"] if not r["in_fit"]]
    for q in sorted({r["workers"] for r in held}):
        at_q = [r for r in held if r["workers"] == q]
        within = sum(abs(r["rel_err"]) <= 0.15 for r in at_q)
        spreads = sorted(r["spread"] for r in at_q if r.get("spread") is not None)
        lines += ["", f"Held-out rows within 15% on {q} ranks: {within} of {len(at_q)}" + (
            f" (the measurements' own spread between repeats: median {_percent(spreads[len(spreads) // 2])}, "
            f"largest {_percent(spreads[-1])})." if spreads else ".")]
    lines += ["", projection_markdown(result["projection"])]
    return "\n".join(lines) + "\n"


def projection_markdown(projection: dict) -> str:
    """The projection table (efficiency at 64 / 512 / 4096 workers); re-exported by
    ``easgd-report``."""
    from easgd_lightning.cli.report import projection_markdown as render

    return render(projection)


def _percent(x: float | None) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def _loadavg() -> str | None:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return None


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


# ---------------------------------------------------------------- measurement
PROBE_WORKERS = (2, 4, 8)
PROBE_RATES_MBIT = (50.0, 200.0, 1000.0)
ROWS_WORKERS = (2, 4)  # one rank per core here, and twice as many ranks as cores
ROWS_RATE_MBIT = 100.0  # not a probe rate: the rows are predicted at a rate the fit never saw
DEFAULT_ROWS = (
    "ddp/none,limit/none,ddp/powersgd,ddp/dgc;compression.warmup_ratio_steps=0;optim.momentum=0,"
    "sync_easgd/none,sync_easgd/topk,easgd_round_robin/none,async_easgd/none"
)


def parse_workers(text: str) -> list[int]:
    """``"2,4"`` -> ``[2, 4]``: rank counts of at least 2, each once, in the given order."""
    out: list[int] = []
    for item in str(text).split(","):
        w = int(item)
        if w < 2:
            raise ValueError(f"--rows-workers: {w} ranks; each needs at least 2")
        if w not in out:
            out.append(w)
    return out


def probe_sizes(rate_mbit: float, top_ms: float = 40.0) -> list[int]:
    """Message sizes for one link rate: 1 kB (fixes alpha), then a quarter of and all of
    ``top_ms`` of the link: at least 5x the token bucket's 2 ms burst, which lets shorter
    messages through faster than the rate."""
    top = int(_rate_bps(rate_mbit) * top_ms / 1000.0) // 1024 * 1024
    return [1024, max(2048, top // 4), max(4096, top)]


def run_probe(cluster, out: Path, rates: Sequence[float], port: int, timeout_s: float,
              repeats: int = 3, latency_ms: float = 0.1, top_ms: float = 40.0,
              loops: bool = False, kernel_matmuls: int = 32, between_matmuls: int = 0,
              ps_bytes: int = 0) -> list[dict]:
    """Time every collective on ``cluster`` at each rate (one launch, links reshaped
    between phases); one sample per (op, bytes, rate): the slowest rank's median. With
    ``loops``, also the probe's training-shaped loops (ops ``loop_*``; with ``ps_bytes``
    the busy server's loop at that message too, marked ``"at": "workload"``)."""
    from bench._netem import LinkSpec
    from bench._runs import host_rank_env, log_tail, wait_all

    res = out / f"probe_p{cluster.workers}"
    if res.exists():
        import shutil
        shutil.rmtree(res)
    res.mkdir(parents=True)
    script = Path(__file__).resolve().parent / "costmodel_probe.py"
    sizes = ",".join(":".join(str(s) for s in probe_sizes(r, top_ms)) for r in rates)
    cmd = [sys.executable, str(script), "--phases", ",".join(f"{r:g}" for r in rates),
           "--sizes", sizes, "--repeats", str(repeats), "--out", str(res),
           "--timeout-s", str(timeout_s), "--kernel-matmuls", str(kernel_matmuls),
           "--between-matmuls", str(between_matmuls), "--ps-bytes", str(ps_bytes),
           *(["--loops"] if loops else [])]
    cluster.shape(LinkSpec(rates[0], latency_ms))
    procs = [cluster.spawn(r, cmd, host_rank_env(cluster, r, port), res / f"rank{r}.log")
             for r in range(cluster.workers)]
    deadline = time.monotonic() + timeout_s
    for k, rate in enumerate(rates):
        while not (res / f"phase{k}.ready").exists():
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                cluster.kill_procs()
                raise RuntimeError(f"probe failed:\n{log_tail(res / 'rank0.log')}")
            time.sleep(0.05)
        cluster.shape(LinkSpec(rate, latency_ms))
        (res / f"phase{k}.go").write_text("go")
    codes, timed_out = wait_all(procs, max(1.0, deadline - time.monotonic()))
    cluster.kill_procs()
    if timed_out or any(c != 0 for c in codes):
        raise RuntimeError(f"probe failed (rc={codes}):\n{log_tail(res / 'rank0.log')}")
    ranks = [json.loads((res / f"rank{r}.json").read_text())["records"] for r in range(cluster.workers)]
    samples = []
    for recs in zip(*ranks):
        slowest = [max(ts) for ts in zip(*(r["times_s"] for r in recs))]
        samples.append({"op": recs[0]["op"], "p": cluster.workers, "bytes": recs[0]["bytes"],
                        "rate_mbit": float(recs[0]["phase"]), "time_s": statistics.median(slowest),
                        **({"at": recs[0]["at"]} if "at" in recs[0] else {})})
    return samples


def measure_codecs(names: Sequence[str], numel: int, repeats: int = 5) -> dict:
    """Codec round trip (``bench/compressors.py``'s) on one tensor of the model's size."""
    import torch

    from bench.compressors import bench_one, load_config, matrix_shape
    from easgd_lightning.hooks.compressors import build_compressor

    torch.set_num_threads(1)
    x = torch.randn(matrix_shape(numel))
    out = {}
    for name in names:
        if name == "none":
            continue
        res = bench_one(name, x, warmup=2, repeats=repeats)
        comp = build_compressor(**load_config(name))
        out[name] = {
            "seconds": res["seconds"], "payload_bytes": res["payload_bytes"],
            "aggregation": comp.aggregation, "calls": 2 if name == "powersgd" else 1,
        }
    return out


class LocalCollective:
    """The collectives of one exchange without a network: p ranks that all hand in this
    rank's payload (all-reduce: p times it; all-gather: p copies). With it,
    :func:`measure_exchange_codec` times everything an exchange does but the wire."""

    kind = "costmodel_codec"

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def charge_dense(self, nbytes: int, key=None) -> None:
        pass

    def all_reduce_sum(self, tensors):
        return [t * self.world_size for t in tensors]

    def all_reduce_max(self, tensors):
        return [t.clone() for t in tensors]

    def all_gather(self, tensors):
        return [[t.clone() for t in tensors] for _ in range(self.world_size)]


def model_shapes(workload: Sequence[str], in_features: int = 64, num_classes: int = 10) -> list[tuple]:
    """Parameter shapes of the rows' MLP (``model.hidden=...`` of the workload; digits'
    64 inputs and 10 classes), in DDP's gradient order (last layer first)."""
    from easgd_lightning.models.factory import mlp

    hidden: object = 128
    for item in workload:
        key, _, value = item.partition("=")
        if key == "model.hidden":
            hidden = json.loads(value)
    model = mlp(in_features=in_features, hidden=hidden, num_classes=num_classes)
    return [tuple(q.shape) for q in reversed(list(model.parameters()))]


def measure_exchange_codec(name: str, overrides: Sequence[str], shapes: Sequence[tuple], world: int,
                           warmup: int = 3, repeats: int = 7) -> float:
    """Median seconds of one compressed exchange of tensors of ``shapes`` on
    :class:`LocalCollective` (``world`` ranks): error feedback, compression, this rank's
    decode, the decode of every rank's payload (all-gather) or of the sum (all-reduce), the
    small tensors' dense path: the codec work of a training step's exchange, per step."""
    import torch

    from easgd_lightning.hooks._exchange import exchange_tensors

    torch.set_num_threads(1)
    comp, memory = _row_compressor(name, overrides)
    states: dict = {}
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    keys = [f"t{i}" for i in range(len(shapes))]
    coll = LocalCollective(world)
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        exchange_tensors(grads, keys, comp, memory, states, coll)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def count_exchange_messages(name: str, overrides: Sequence[str], shapes: Sequence[tuple],
                            fusion_mb: float = 25.0, exchanges: int = 3) -> dict:
    """Messages (collectives, as the meter counts them) and payload bytes a rank sends in
    one compressed exchange of
    tensors of ``shapes``, through the strategies' own collective
    (``ProcessGroupCollective`` with the ``comm.fusion_mb`` lazy all-reduce and the batched
    all-gather) on a one-rank gloo group: the message structure of the exchange (e.g.
    PowerSGD's P and Q rounds per tensor, a fused or a separate dense part), counted in
    its last of ``exchanges`` exchanges (the first all-gather of a tensor takes two)."""
    import tempfile

    import torch
    import torch.distributed as dist

    from easgd_lightning.comm.meter import get_meter
    from easgd_lightning.hooks._exchange import exchange_tensors
    from easgd_lightning.hooks.collective import ProcessGroupCollective

    kind = "costmodel_count"
    comp, memory = _row_compressor(name, overrides)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    keys = [f"t{i}" for i in range(len(shapes))]
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            coll = ProcessGroupCollective(kind=kind, fusion_bytes=int(fusion_mb * 2**20))
            states: dict = {}
            for _ in range(exchanges - 1):
                exchange_tensors(grads, keys, comp, memory, states, coll)
            totals = get_meter().by_kind[kind]
            calls, sent = totals.calls, totals.bytes_sent
            exchange_tensors(grads, keys, comp, memory, states, coll)
            return {"messages": float(totals.calls - calls), "bytes": float(totals.bytes_sent - sent)}
        finally:
            dist.destroy_process_group()


def _row_compressor(name: str, overrides: Sequence[str]):
    """The row's compressor (its yaml plus the row's ``compression.*`` overrides) and its
    error-feedback memory."""
    import yaml

    from bench.compressors import load_config
    from easgd_lightning.hooks.compressors import build_compressor
    from easgd_lightning.hooks.memory import make_memory

    cfg = load_config(name)
    for item in overrides:
        key, _, value = item.partition("=")
        if key.startswith("compression."):
            cfg[key.split(".", 1)[1]] = yaml.safe_load(value)
    comp = build_compressor(**cfg)
    return comp, make_memory(comp)


def measure(args: argparse.Namespace) -> dict:
    """The whole measurement: the probe at each rank count, the rows, the codecs."""
    from bench._netem import EmulatedCluster, LinkSpec, check_privileges, install_signal_handlers
    from bench._scenarios import WIDE_MLP_WORKLOAD, parse_configs

    check_privileges()
    install_signal_handlers()
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / "costmodel_inputs.partial.json"  # what a timed-out batch leaves
    inputs: dict = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["bench/costmodel.py", *args.argv]),
        "loadavg_before": _loadavg(), "cpus": os.cpu_count() or 1,
        "probe": [], "probe_loops": [], "rows": [], "codec": {}, "timings_s": {},
    }
    t0 = time.monotonic()
    configs = parse_configs(args.rows)
    limit_k = next((k for k, c in enumerate(configs) if c.strategy == "limit"), None)
    if limit_k is None:
        raise ValueError("--rows needs the limit row (limit/none): it measures the compute")
    link = LinkSpec(args.rows_rate, args.latency_ms)
    rows_workers = parse_workers(args.rows_workers)
    # a limit row first: its compute sizes the probe loops' kernel; the predictions take
    # the limit measured again beside the rows (batch K's first one read 7.2 ms per step,
    # twice the 3.4-3.7 ms of H-J and of the rows' own compute, right after the lock)
    with EmulatedCluster(rows_workers[0], link, subnet=args.subnet, fork_ranks=args.fork_ranks) as cluster:
        limit_row = _run_row(cluster, configs[limit_k], 60 + limit_k, args, rows_workers[0], where="kernel")
    inputs["kernel_limit_row"] = limit_row
    matmuls, mm_s = 32, None
    if limit_row["status"] == "ok" and limit_row["step_time_s"]:
        t_c1 = limit_row["step_time_s"] / cpu_share(rows_workers[0], inputs["cpus"])
        matmuls, mm_s = kernel_matmuls(t_c1)
    # the configurations of the all-reduce / all-gather family and the limit on one host
    # (loopback, no shaped link), at most one rank per core (local_cost; more ranks than
    # cores would measure again the waits that the loops' s and the network model charge)
    inputs["local_rows"] = []
    if args.local_runs and any(c.strategy in LOCAL_STRATEGIES for c in configs):
        for j, workers in enumerate(sorted({min(w, inputs["cpus"]) for w in rows_workers})):
            with EmulatedCluster(1, link, subnet=args.subnet, procs_per_host=workers,
                                 fork_ranks=args.fork_ranks) as cluster:
                for k, config in enumerate(configs):
                    if config.strategy == "limit" or config.strategy in LOCAL_STRATEGIES:
                        inputs["local_rows"].append(
                            _run_row(cluster, config, 40 + 10 * j + k, args, workers, where="local"))
    inputs["probe_kernel"] = {"matmuls": matmuls, "matmul_s": mm_s,
                              "what": "256x256 float32 products per loop iteration, sized "
                              "to the limit row's compute per step (one worker per core)"}
    print(f"[costmodel] probe kernel: {matmuls} matmuls ({mm_s} s each)", flush=True)
    t2 = time.monotonic()
    shapes = model_shapes(WIDE_MLP_WORKLOAD)
    inputs["model_shapes"] = shapes
    inputs["codec"] = measure_codecs(sorted({c.compression for c in configs}),
                                     sum(math.prod(s) for s in shapes))
    inputs["codec_exchange"] = {}
    for config in configs:
        if config.compression != "none" and config.compression not in inputs["codec_exchange"]:
            inputs["codec_exchange"][config.compression] = {
                "overrides": [o for o in config.overrides if o.startswith("compression.")],
                "seconds_by_world": {
                    str(w): measure_exchange_codec(config.compression, config.overrides, shapes, w)
                    for w in sorted({1, *rows_workers})
                },
                **count_exchange_messages(config.compression, config.overrides, shapes),
            }
    inputs["timings_s"]["codec"] = time.monotonic() - t2
    # the codec between a multi-round exchange's blocking rounds sizes the probe's
    # loop_serial_ring_codec: (k - 1)/k of the exchange's codec at one rank, k its messages
    between = 0
    if mm_s:
        for exchange in inputs["codec_exchange"].values():
            k_msgs = exchange.get("messages", 1)
            if k_msgs > 1:
                t_between = exchange["seconds_by_world"]["1"] * (k_msgs - 1) / k_msgs
                between = max(between, max(1, round(t_between / mm_s)))
    inputs["probe_kernel"]["between_matmuls"] = between
    rates = [float(r) for r in args.probe_rates.split(",")]
    for k, p in enumerate(int(w) for w in args.probe_workers.split(",")):
        with EmulatedCluster(p, LinkSpec(rates[0], args.latency_ms), subnet=args.subnet) as cluster:
            print(f"[costmodel] probe: {p} ranks at {rates} Mbit/s", flush=True)
            samples = run_probe(
                cluster, args.out, rates, args.port + 10 * k, args.timeout_s,
                repeats=args.probe_repeats, latency_ms=args.latency_ms, top_ms=args.probe_top_ms,
                loops=args.probe_loops, kernel_matmuls=matmuls, between_matmuls=between,
                ps_bytes=int(4 * sum(math.prod(s) for s in shapes)),
            )
            inputs["probe"] += [s for s in samples if not s["op"].startswith("loop_")]
            inputs["probe_loops"] += [s for s in samples if s["op"].startswith("loop_")]
    inputs["timings_s"]["probe"] = time.monotonic() - t0
    partial.write_text(json.dumps(inputs, indent=2))
    t1 = time.monotonic()
    longest = 0.0
    for j, workers in enumerate(rows_workers):
        with EmulatedCluster(workers, link, subnet=args.subnet, fork_ranks=args.fork_ranks) as cluster:
            for k, config in enumerate(configs):
                started = time.monotonic()
                if config.strategy.startswith("async_") and workers < 3:
                    inputs["rows"].append({"strategy": config.strategy, "compression": config.compression,
                                           "overrides": list(config.overrides), "workers": workers,
                                           "status": "skipped (a server and two workers need 3 ranks)"})
                    continue
                if args.budget_s and started - t0 + longest > args.budget_s:
                    print(f"[costmodel] row {config.label} on {workers} ranks: skipped "
                          f"(--budget-s {args.budget_s:g})", flush=True)
                    inputs["rows"].append({"strategy": config.strategy, "compression": config.compression,
                                           "overrides": list(config.overrides), "workers": workers,
                                           "status": "skipped (budget)"})
                    continue
                inputs["rows"].append(_run_row(cluster, config, k + 20 * j, args, workers))
                longest = max(longest, time.monotonic() - started)
                partial.write_text(json.dumps(inputs, indent=2))
    inputs["timings_s"]["rows"] = time.monotonic() - t1
    inputs["dense_bytes"] = dense_bytes(inputs)  # float32 parameters of the model
    for row in inputs["rows"]:
        row["bytes_per_exchange"] = _bytes_per_exchange(row, inputs["dense_bytes"])
    inputs["loadavg_after"] = _loadavg()
    return inputs


def _run_row(cluster, config, k: int, args: argparse.Namespace, workers: int, where: str = "p") -> dict:
    """One training row of ``workers`` ranks on ``cluster`` (one host per rank, or with
    ``where="local"`` all on one host): its step time and meter, from the median of
    ``--repeats`` runs (on this 2-core VM a lone run's steady step time moved by up to 2x:
    the limit row read 3.3-6.3 ms in four runs back to back); every repeat's is kept."""
    from bench._runs import run_config
    from bench._scenarios import WIDE_MLP_WORKLOAD

    print(f"[costmodel] row {config.label} {' '.join(config.overrides)} on {workers} ranks"
          + (" of one host" if where == "local" else ""), flush=True)
    runs = []
    for r in range(max(1, args.repeats)):
        res = run_config(
            cluster, config, steps=args.limit_steps if config.strategy == "limit" else args.steps,
            warmup_steps=args.warmup_steps, workload=list(WIDE_MLP_WORKLOAD), extra=args.extra.split(),
            out_dir=args.out / "runs" / f"{where}{workers}" / f"repeat{r}",
            port=args.port + 100 + k + 200 * r, timeout_s=args.timeout_s,
        )
        runs.append(res)
        print(f"[costmodel]   {res.status}: step {res.figures.get('step_time_s')}", flush=True)
    timed = sorted((res for res in runs if res.status == "ok" and res.figures.get("step_time_s")),
                   key=lambda res: res.figures["step_time_s"])
    res = timed[(len(timed) - 1) // 2] if timed else runs[-1]  # the median run (lower middle)
    fig = res.figures
    steps = [x.figures["step_time_s"] for x in timed]
    return {
        "strategy": config.strategy, "compression": config.compression,
        "overrides": list(config.overrides), "workers": workers,
        "rate_mbit": args.rows_rate, "status": res.status,
        "step_time_s": fig.get("step_time_s"), "measured": fig.get("measured"),
        "step_time_s_repeats": [x.figures.get("step_time_s") for x in runs],
        "spread": (steps[-1] - steps[0]) / fig["step_time_s"] if len(steps) > 1 else None,
        "bytes_per_step_per_worker": fig.get("bytes_per_step_per_worker"),
        "run_dir": res.run_dir,
        "meter": row_meter(Path(res.run_dir), args.warmup_steps) if res.status == "ok" else None,
    }


def kernel_matmuls(t_compute_1: float, repeats: int = 50) -> tuple[int, float]:
    """Products of two 256 x 256 float32 matrices (the probe loops' kernel, one thread)
    that take ``t_compute_1`` seconds here, and the median seconds of one."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    out = torch.empty(256, 256)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - start)
    mm_s = statistics.median(times[5:])
    return max(1, round(t_compute_1 / mm_s)), mm_s


def _find(tree, key: str) -> float:
    """Sum of every number stored under ``key`` anywhere in ``tree`` (dicts and lists)."""
    if isinstance(tree, dict):
        return sum(_find(v, key) for v in tree.values()) + (
            float(tree[key]) if isinstance(tree.get(key), (int, float)) else 0.0)
    if isinstance(tree, list):
        return sum(_find(v, key) for v in tree)
    return 0.0


def row_meter(run_dir: Path, warmup_steps: int) -> dict | None:
    """:func:`_row_meter`, or None where the summaries lack a figure (diagnosis only)."""
    try:
        return _row_meter(run_dir, warmup_steps)
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
        return None


def _row_meter(run_dir: Path, warmup_steps: int) -> dict | None:
    """What a row's own meter saw per steady-state step, for diagnosis only (never an
    input of a prediction): the difference of the full run and its first ``warmup_steps``
    (``run_dir/first<W>``), per step and mean over the ranks that stepped: time inside
    communication (``comm_s``), of it the time the training loop waited (``exposed_s``),
    the hooks' codec time (``codec_s``, where the strategy reports it), messages per step,
    and the step time minus the exposed communication (``rest_s``: compute, codec and
    every other local cost)."""
    from bench._tables import steady_figures

    try:
        long = json.loads((Path(run_dir) / "summary.json").read_text())
        short = json.loads((Path(run_dir) / f"first{warmup_steps}" / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    steady = steady_figures(long, short)
    if steady is None:
        return None
    d_steps = [int(a or 0) - int(b or 0) for a, b in zip(long["steps_per_rank"], short["steps_per_rank"])]
    stepping = [i for i, d in enumerate(d_steps) if d > 0]

    def per_step(key: str) -> float:
        a, b = long["comm"].get(key) or [], short["comm"].get(key) or []
        vals = [(float(a[i] or 0) - float(b[i] or 0)) / d_steps[i] for i in stepping if i < min(len(a), len(b))]
        return sum(vals) / len(vals) if vals else 0.0

    codec = [(_find(long["extras"][i], "codec_time_s") - _find(short["extras"][i], "codec_time_s")) / d_steps[i]
             for i in stepping]
    step = steady["step_time_s"]
    exposed = per_step("exposed_time_s")
    return {
        "step_s": step, "comm_s": per_step("time_s"), "exposed_s": exposed,
        "codec_s": sum(codec) / len(codec) if codec else 0.0,
        "messages_per_step": steady.get("messages_per_step"), "rest_s": step - exposed,
        "per_rank_exposed_s": [
            (float(long["comm"]["exposed_time_s"][i] or 0) - float(short["comm"]["exposed_time_s"][i] or 0))
            / d_steps[i] for i in stepping],
    }


def _bytes_per_exchange(row: dict, dense: float) -> float:
    """Payload a rank hands to one exchange: the row's metered bytes per step for a
    compressed row (x tau), the dense message otherwise."""
    if row["compression"] == "none" or not row.get("bytes_per_step_per_worker"):
        return dense
    return row["bytes_per_step_per_worker"] * row_options(row)["tau"]


def _parser() -> argparse.ArgumentParser:
    from bench._scenarios import REPO

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--measure", action="store_true",
                      help="run the probe and the rows on the emulated cluster (root), then fit")
    mode.add_argument("--fit", type=Path, metavar="INPUTS_JSON",
                      help="fit and project from an existing costmodel_inputs.json")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "costmodel")
    p.add_argument("--probe-workers", default=",".join(str(w) for w in PROBE_WORKERS))
    p.add_argument("--probe-rates", default=",".join(f"{r:g}" for r in PROBE_RATES_MBIT))
    p.add_argument("--probe-repeats", type=int, default=3)
    p.add_argument("--probe-top-ms", type=float, default=40.0,
                   help="largest probe message, in ms of the link at each rate")
    p.add_argument("--probe-loops", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the probe's training-shaped loops (compute + collective)")
    p.add_argument("--layout", action="append", default=[], metavar="LAYOUT.KEY=VALUE",
                   help="replace a projection layout's assumption, e.g. gpu.compute_factor=0.1")
    p.add_argument("--rows", default=DEFAULT_ROWS, help="bench/cluster.py --configs syntax")
    p.add_argument("--rows-workers", default=",".join(str(w) for w in ROWS_WORKERS),
                   help="ranks of the rows' cluster, comma-separated: every row runs at each "
                        "(the first one's limit row, run first, sizes the probe's kernel)")
    p.add_argument("--rows-rate", type=float, default=ROWS_RATE_MBIT)
    p.add_argument("--local-runs", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the limit and the ddp / sync_easgd rows with all their ranks "
                        "on one host (loopback): their cost beyond the limit in training")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each row, limit and local run; its step time is their median")
    p.add_argument("--fork-ranks", action=argparse.BooleanOptionalAction, default=True,
                   help="fork the rows' ranks from a fork server per host (bench/cluster.py "
                        "--fork-ranks): start-up is not in a steady step time, and it is most "
                        "of a fresh run's wall time here")
    p.add_argument("--limit-steps", type=int, default=200,
                   help="steps of the limit row, whose compute every prediction uses: a steady "
                        "window long against the two runs' start-up jitter")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--extra", default="trainer.limit_val_batches=0",
                   help="Hydra overrides for every row (default: no validation passes, which the "
                        "model has no term for: a training step is what it predicts)")
    p.add_argument("--latency-ms", type=float, default=0.1)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="skip the rows that would end past this many seconds of --measure "
                   "(judged by the longest row so far; 0: no budget)")
    p.add_argument("--port", type=int, default=29700)
    p.add_argument("--subnet", default="10.78.0")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; 2 when the emulated network cannot be built here."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    args.out = args.out.resolve()
    try:
        layouts = layouts_with(args.layout)
    except ValueError as exc:
        print(f"bench/costmodel.py: {exc}", file=sys.stderr)
        return 2
    if args.fit is not None:
        inputs = json.loads(args.fit.read_text())
    else:
        from bench._netem import ClusterUnavailable, cleanup_all

        try:
            inputs = measure(args)
        except ClusterUnavailable as exc:
            print(f"bench/costmodel.py: cannot build the emulated cluster: {exc}", file=sys.stderr)
            return 2
        finally:
            cleanup_all()
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "costmodel_inputs.json").write_text(json.dumps(inputs, indent=2))
    result = analyse(inputs, args.out, layouts)
    print(markdown(result))
    print(f"[costmodel] wrote {args.out / 'costmodel.json'}, costmodel.md, costmodel_projection.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
