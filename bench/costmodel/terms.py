r"""The cost model's terms: what each collective costs on p ranks for n bytes.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable

from bench._netem import tbf_params

__all__ = [
    "COLLECTIVES",
    "DERIVED",
    "OVERLAPPED",
    "after_burst",
    "allgather_terms",
    "broadcast_terms",
    "collective_terms",
    "collective_time",
    "emulated_burst_bytes",
    "hierarchical_allreduce_time",
    "probe_of",
    "ps_server_terms",
    "ps_terms",
    "ps_worker_terms",
    "rate_bps",
    "ring_terms",
    "round_robin_terms",
    "tree_terms",
]


def _log2(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def after_burst(nbytes: float, burst: float) -> float:
    """Bytes a token bucket of ``burst`` bytes, full after an idle link, makes wait for
    its rate: the first ``burst`` bytes of a transfer pass at line rate."""
    return max(0.0, nbytes - burst)


def rate_bps(rate_mbit: float) -> float:
    return rate_mbit * 1e6 / 8.0


def ring_terms(p: int, n: float, burst: float = 0.0) -> tuple[float, float]:
    """Ring all-reduce (reduce-scatter + all-gather): 2(p-1) steps of n/p bytes; each link
    carries the steps back to back, so its bucket's burst counts once."""
    return 2.0 * (p - 1), after_burst(2.0 * (p - 1) * n / p, burst)


def tree_terms(p: int, n: float, burst: float = 0.0) -> tuple[float, float]:
    """Binomial-tree reduce then broadcast: 2 ceil(log2 p) steps of n bytes. The root's
    port receives every reduce level and its egress sends every broadcast level back to
    back: one burst per phase."""
    return 2.0 * _log2(p), 2.0 * after_burst(_log2(p) * n, burst)


def allgather_terms(p: int, m: float, burst: float = 0.0) -> tuple[float, float]:
    """Ring all-gather of m bytes per rank: p-1 steps of m (the received bytes grow with p),
    back to back on each link: one burst."""
    return float(p - 1), after_burst(float(p - 1) * m, burst)


def broadcast_terms(p: int, n: float, burst: float = 0.0) -> tuple[float, float]:
    """gloo's broadcast: the root sends n to each of the p-1 others over its own link, back
    to back: one burst."""
    return float(p - 1), after_burst(float(p - 1) * n, burst)


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
    return 2.0 * p, (2.0 * (p - 1) - (p - 2) * overlap) * after_burst(n, burst)


def ps_server_terms(p: int, n: float, burst: float = 0.0, overlap: float = 0.0) -> tuple[float, float]:
    """The server's time per round of p-1 requests in training (its throughput bound on a
    worker's step): p-1 services of 2 alpha + (2 - phi) max(0, n - B) / beta, each reply's
    tail hidden behind the next request."""
    return 2.0 * (p - 1), (p - 1) * (2.0 - overlap) * after_burst(n, burst)


def ps_worker_terms(p: int, n: float, burst: float = 0.0) -> tuple[float, float]:
    """One worker's own exchange (its latency bound): its request (2 alpha + n) then the
    whole reply (2 alpha + n), in turn: 4 alpha + 2 max(0, n - B) / beta."""
    del p
    return 4.0, 2.0 * after_burst(n, burst)


def round_robin_terms(p: int, n: float, burst: float = 0.0, overlap: float = 0.0) -> tuple[float, float]:
    """Original EASGD's round: the master receives x from worker i (one rendezvous, alpha + n)
    and sends d_i back (blocking while (1 - phi) of it is unsent), then worker i + 1; d_i's
    tail drains on the master's egress while x_{i+1} comes in on its port. With p >= 3 the
    last reply's tail drains behind the master's compute and the next round's first
    requests: (p-1)(alpha + (2 - phi) max(0, n - B) / beta); with one worker its push and
    reply are in turn: 2 (alpha + max(0, n - B) / beta)."""
    if p <= 2:
        return 2.0, 2.0 * after_burst(n, burst)
    return float(p - 1), (p - 1) * (2.0 - overlap) * after_burst(n, burst)


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
