"""SeCoPa: the compression-aware plan of HiPress (Bai et al., SOSP 2021; TPDS 2023).

At start-up (and every ``replan_steps``) the attach point measures, on its own process
group, the three primitives of a compressed exchange for a few tensor sizes, fits each as
a line ``T(x) = A + B x`` by least squares (:func:`fit_line`), and decides per tensor
whether compressing it pays off and into how many partitions K to cut it so that the
partitions' encode, transfer and decode overlap (CaSync's pipeline,
:func:`easgd_lightning.hooks._exchange.start_exchange_tensors`).

Fitted lines (:class:`CostModel`; n: elements of the dense tensor, x: bytes):

* ``send_dense(x)``: the dense all-reduce of x bytes (the ``none`` path);
* ``send_payload(x)``: the codec's collective for a payload of x bytes per rank (an
  all-gather for sparse codecs, an all-reduce for linear ones; the (N - 1) factor of an
  all-gather is inside the fitted B);
* ``encode(n)``, ``decode(n)``: compress an n-element tensor, decompress one payload of it;
* ``payload(n)``: payload bytes of an n-element tensor (exact for PowerSGD's factors,
  :meth:`CostModel.payload_bytes`).

Cost of one tensor of n elements (element size e) on N ranks, HiPress's formulas for our
exchange:

    T_dense(n)    = send_dense(e n)
    enc(m)        = encode(m)
    snd(m)        = R A_payload + B_payload payload(m)      (R collectives per exchange:
                                                           PowerSGD 2, others 1)
    dec(m)        = D decode(m)                             (D = N for all-gather payloads:
                                                           every rank's is decoded; 1 for
                                                           all-reduce payloads: the sum once)
    T_comp(n, K)  = enc(n/K) + snd(n/K) + dec(n/K) + (K - 1) max(enc, snd, dec)(n/K)

(a K-stage pipeline: the first partition passes the three stages, each further one adds
the slowest stage). K runs over 1, 2, 4, ... up to ``max_partitions`` while a partition
keeps at least ``min_partition_numel`` elements; K* is the smallest K of least T_comp. A
tensor is compressed iff n >= ``min_numel`` (small tensors travel dense, fused in one
message) and T_comp(n, K*) < T_dense(n); otherwise it travels dense (K = 1).

Every rank must reach the same plan: the measured times are max-reduced over ranks before
fitting, so every rank fits the same lines and :func:`make_plan` (a pure function) gives
the same decisions. The plan is logged to ``plan.json`` in the run directory by rank 0
(atomically) and summarised in the run's ``summary.json``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from easgd_lightning.comm import ops
from easgd_lightning.utils.checks import check_choice, check_int

__all__ = [
    "NO_PLAN",
    "PLANS",
    "Line",
    "fit_line",
    "CostModel",
    "TensorSpec",
    "Decision",
    "Plan",
    "stage_times",
    "compressed_time",
    "plan_tensor",
    "make_plan",
    "partition_counts",
    "measure_costs",
    "check_plan_options",
]

#: ``compression.plan`` values: ``none`` (the fixed ``min_numel`` policy) or ``secopa``
#: ``compression.plan`` of no planning (the ``min_numel`` policy)
NO_PLAN = "none"
PLANS = (NO_PLAN, "secopa")

#: meter kind of the planner's probes (kept apart from the training traffic)
PLAN_KIND = "plan"

#: the largest probe (elements): bigger tensors are planned on the fitted lines' extrapolation
MAX_PROBE_NUMEL = 1 << 22


@dataclass(frozen=True)
class Line:
    """``a + b x``."""

    a: float
    b: float

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Line:
    """Least-squares fit of ``y = a + b x`` (closed form, float64).

    Raises:
        ValueError: fewer than two points, different lengths, or all ``xs`` equal.
    """
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"fit_line needs >= 2 (x, y) pairs of equal length, got {len(xs)} and {len(ys)}")
    n = len(xs)
    mx = sum(xs) / n
    my = sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("fit_line needs at least two different x values")
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx
    return Line(my - b * mx, b)


@dataclass(frozen=True)
class CostModel:
    """The fitted lines of one codec on one process group (see the module docstring)."""

    send_dense: Line
    send_payload: Line
    encode: Line
    decode: Line
    payload: Line
    world: int
    aggregation: str = "allgather"
    rounds: int = 1
    #: PowerSGD's rank (payload (rows + cols) r elements exact); None: the fitted line
    factor_rank: int | None = None

    def payload_bytes(self, numel: float, shape: Sequence[int] | None, element_size: int, parts: int) -> float:
        """Payload bytes of one of ``parts`` partitions of a tensor of ``numel`` elements."""
        if self.factor_rank is not None and shape is not None and len(shape) >= 2:
            rows = shape[0] / parts
            cols = numel / shape[0]
            r = min(self.factor_rank, rows, cols)
            if (rows + cols) * r < rows * cols:
                return (rows + cols) * r * element_size
            return rows * cols * element_size  # PowerSGD sends such a block dense
        return max(0.0, self.payload(numel / parts))

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TensorSpec:
    """What the planner knows of a tensor: its key, shape and element size."""

    key: str
    shape: tuple[int, ...]
    element_size: int = 4

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n


@dataclass(frozen=True)
class Decision:
    """One tensor's plan: compressed or dense, in how many partitions, and the model's times."""

    key: str
    numel: int
    compress: bool
    partitions: int
    t_dense_s: float
    t_compressed_s: float | None


@dataclass
class Plan:
    """Decisions by tensor key, with the model they came from."""

    decisions: dict[str, Decision]
    costs: CostModel | None = None
    iteration: int = 0
    probes: dict = field(default_factory=dict)

    def get(self, key) -> Decision | None:
        return self.decisions.get(key)

    def summary(self) -> dict:
        ds = list(self.decisions.values())
        return {
            "planner": "secopa",
            "iteration": self.iteration,
            "tensors": len(ds),
            "compressed": sum(d.compress for d in ds),
            "dense": sum(not d.compress for d in ds),
            "partitioned": sum(d.partitions > 1 for d in ds),
            "max_partitions": max((d.partitions for d in ds), default=1),
        }

    def to_dict(self) -> dict:
        return {
            **self.summary(),
            "costs": self.costs.to_dict() if self.costs is not None else None,
            "probes": self.probes,
            "decisions": [asdict(d) for d in self.decisions.values()],
        }


def stage_times(costs: CostModel, spec: TensorSpec, parts: int) -> tuple[float, float, float]:
    """(enc, snd, dec) of one of ``parts`` partitions of ``spec`` (module docstring)."""
    m = spec.numel / parts
    enc = costs.encode(m)
    payload = costs.payload_bytes(spec.numel, spec.shape, spec.element_size, parts)
    snd = costs.rounds * costs.send_payload.a + costs.send_payload.b * payload
    dec = (costs.world if costs.aggregation == "allgather" else 1) * costs.decode(m)
    return enc, snd, dec


def compressed_time(costs: CostModel, spec: TensorSpec, parts: int) -> float:
    """T_comp(n, K): the K-stage pipeline of the module docstring."""
    enc, snd, dec = stage_times(costs, spec, parts)
    return enc + snd + dec + (parts - 1) * max(enc, snd, dec)


def partition_counts(spec: TensorSpec, max_partitions: int, min_partition_numel: int) -> list[int]:
    """K = 1, 2, 4, ... <= ``max_partitions`` while a partition keeps ``min_partition_numel``
    elements and, for a tensor of two or more dimensions, one row (partitions cut dim 0)."""
    rows = spec.shape[0] if len(spec.shape) >= 2 else spec.numel
    out, k = [1], 2
    while k <= max_partitions and k <= rows and spec.numel / k >= min_partition_numel:
        out.append(k)
        k *= 2
    return out


def plan_tensor(
    costs: CostModel,
    spec: TensorSpec,
    *,
    min_numel: int,
    max_partitions: int = 8,
    min_partition_numel: int = 16384,
) -> Decision:
    """The decision for one tensor (module docstring)."""
    t_dense = costs.send_dense(spec.numel * spec.element_size)
    if spec.numel < min_numel:
        return Decision(spec.key, spec.numel, False, 1, t_dense, None)
    best_k, best_t = 1, compressed_time(costs, spec, 1)
    for k in partition_counts(spec, max_partitions, min_partition_numel)[1:]:
        t = compressed_time(costs, spec, k)
        if t < best_t:
            best_k, best_t = k, t
    if best_t < t_dense:
        return Decision(spec.key, spec.numel, True, best_k, t_dense, best_t)
    return Decision(spec.key, spec.numel, False, 1, t_dense, best_t)


def make_plan(
    costs: CostModel,
    specs: Sequence[TensorSpec],
    *,
    min_numel: int,
    max_partitions: int = 8,
    min_partition_numel: int = 16384,
    iteration: int = 0,
    probes: dict | None = None,
) -> Plan:
    """Every tensor's :func:`plan_tensor` decision."""
    decisions = {
        s.key: plan_tensor(
            costs, s, min_numel=min_numel, max_partitions=max_partitions,
            min_partition_numel=min_partition_numel,
        )
        for s in specs
    }
    return Plan(decisions, costs, iteration, dict(probes or {}))


def check_plan_options(plan, replan_steps, max_partitions) -> None:
    """``compression.plan`` / ``replan_steps`` / ``max_partitions``; ValueError naming the key."""
    check_choice("compression.plan", plan, PLANS)
    check_int("compression.replan_steps", replan_steps, 0)
    check_int("compression.max_partitions", max_partitions, 1)


# ----------------------------------------------------------------------------- measurement


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: allocations, a varlen gather's capacity
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_sizes(largest: int, count: int = 4, smallest: int = 4096) -> list[int]:
    """``count`` sizes from ``smallest`` up to ``largest`` (multiples of 256, geometric)."""
    largest = max(largest, 2 * smallest)
    ratio = (largest / smallest) ** (1.0 / max(1, count - 1))
    sizes = sorted({max(256, int(smallest * ratio**i) // 256 * 256) for i in range(count)})
    return sizes if len(sizes) >= 2 else [smallest, 2 * smallest]


def measure_costs(
    compressor,
    *,
    group: dist.ProcessGroup | None = None,
    sizes: Sequence[int],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    repeats: int = 3,
    cols: int = 256,
) -> tuple[CostModel, dict]:
    """Measure and fit the :class:`CostModel` of ``compressor`` on ``group`` (a collective
    call: every rank of the group, same ``sizes``). Probes are matrices ``(n / cols, cols)``
    (PowerSGD needs two dimensions) of seeded normal values; their traffic is metered
    under kind ``plan``. Returns (the model, the raw probe times)."""
    world = dist.get_world_size(group)
    gen = torch.Generator().manual_seed(1234)
    rows: list[list[float]] = []
    for n in sizes:
        x = torch.randn(n // cols, cols, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
        state: dict = {"key_hash": 0}
        holder: dict = {}

        def encode(x=x, state=state, holder=holder):
            holder["p"] = compressor.compress(x, state)

        t_enc = _median_time(encode, repeats)
        payload = holder["p"]
        t_dec = _median_time(lambda payload=payload, x=x: compressor.decompress(payload, x.shape), repeats)
        nbytes = compressor.payload_bytes(payload)
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in payload.tensors])
        if compressor.aggregation == "allgather":
            slot: dict = {}
            t_snd = _median_time(
                lambda flat=flat, slot=slot: ops.all_gather_varlen([flat], kind=PLAN_KIND, group=group, slot=slot),
                repeats,
            )
        else:
            buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
            t_snd = _median_time(lambda buf=buf: ops.all_reduce(buf, kind=PLAN_KIND, group=group), repeats)
        dense = x.reshape(-1).clone()
        t_den = _median_time(lambda dense=dense: ops.all_reduce(dense, kind=PLAN_KIND, group=group), repeats)
        rows.append([float(n), float(n * x.element_size()), float(nbytes), t_enc, t_dec, t_snd, t_den])
    table = torch.tensor(rows, dtype=torch.float64)
    if world > 1:  # every rank fits the same lines: the slowest rank's times
        ops.all_reduce(table, kind=PLAN_KIND, op=dist.ReduceOp.MAX, group=group)
    ns, dbytes, pbytes, enc, dec, snd, den = (table[:, j].tolist() for j in range(7))
    costs = CostModel(
        send_dense=fit_line(dbytes, den),
        send_payload=fit_line(pbytes, snd) if len(set(pbytes)) > 1 else Line(statistics.mean(snd), 0.0),
        encode=fit_line(ns, enc),
        decode=fit_line(ns, dec),
        payload=fit_line(ns, pbytes),
        world=world,
        aggregation=compressor.aggregation,
        rounds=compressor.exchange_rounds,
        factor_rank=getattr(compressor, "rank", None) if hasattr(compressor, "factor_shapes") else None,
    )
    probes = {
        "sizes": [int(n) for n in ns],
        "dense_bytes": [int(b) for b in dbytes],
        "payload_bytes": [int(b) for b in pbytes],
        "encode_s": enc,
        "decode_s": dec,
        "send_payload_s": snd,
        "send_dense_s": den,
    }
    return costs, probes
