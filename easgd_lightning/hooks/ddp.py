"""Compressor -> torch DDP communication hook, registered on every backend (gloo too).

Lightning's ``DDPStrategy`` only registers comm hooks on CUDA; ``CompressedDDPStrategy``
calls :func:`register_compression_hook` itself, so the hook runs on CPU/gloo as well.

* Without a compressor (or with ``none``) the hook is a metered dense all-reduce of the
  bucket (divide by the world size first, as PyTorch's default hook does), asynchronous.
* With a compressor, :func:`compressed_allreduce_hook` runs per bucket: the bucket's
  per-parameter gradients (views of the bucket buffer) go through the per-tensor policy
  of :mod:`easgd_lightning.hooks._exchange` (tensors under ``min_numel`` dense in one
  message, the others error-compensated and compressed; all-reduce for linear payloads,
  all-gather of (index, value) for sparse ones). The exchange runs synchronously inside
  the hook, writes the averaged gradients into the bucket and returns a completed
  future. With a codec that runs over whole buffers (``fused_segments``: top-k, DGC, EF-signSGD, random-k, QSGD, Sparse GC,
  RedSync, SIDCo, SparseLoCo, ACP-SGD, GComp, SGC, adaptive, PowerSGD, csc, sketch,
  LGC, two-way; :mod:`~easgd_lightning.hooks._fused`) and
  no SeCoPa plan, the bucket buffer itself is the exchange's flat buffer
  (:mod:`easgd_lightning.hooks._fused`): one codec call, one message, the mean written
  back into the bucket in place. The first ``warmup_steps`` iterations are dense (DDP rebuilds its buckets after
  the first iteration, like PyTorch's PowerSGD ``start_powerSGD_iter``); compressor and
  residual state is keyed by parameter name, so it survives the rebuild.
* A 16-bit cast (``fp16``, ``bf16``) without residuals or a plan (and not under
  ``ft=torchft``, whose steps commit around a synchronous exchange) runs
  :func:`cast_allreduce_hook` instead, asynchronous as the dense hook (PyTorch's
  ``fp16_compress_hook``): per bucket, the tensors of ``min_numel`` elements or more are cast
  (after the division by the world size) into one 16-bit message, the smaller ones travel
  in one fp32 message, both all-reduces run behind the rest of backward and the bucket is
  written back when they complete; the same numbers as the synchronous path. This is the
  dense 16-bit baseline of the benchmarks (issue 29): with the synchronous hook every bucket
  would wait for its exchange before backward goes on, and no DDP overlap would be left.

* With ``allreduce="switch"`` (``comm.allreduce: switch``), the dense hook sums each bucket
  through the emulated in-network aggregator of :mod:`easgd_lightning.comm.switch`
  (NetReduce: one send and one receive per worker) instead of gloo's ring all-reduce.
* With ``plan="secopa"`` (``compression.plan: secopa``), the compressed hook measures and
  fits the cost model of :mod:`easgd_lightning.hooks.planner` at its first compressed
  iteration (and every ``replan_steps`` iterations after it, 0: never again) and
  exchanges each parameter as the plan says: dense, compressed whole, or compressed in
  K partitions through CaSync's pipeline (:mod:`easgd_lightning.hooks._exchange`). Rank 0
  writes the plan to ``<plan_dir>/plan.json`` (atomically); ``compression_stats()``
  carries its summary into ``summary.json``.

Metering (kind ``data_parallel``): ``bytes_sent`` is the real payload (indices, values,
scales, factors, length headers), ``dense_bytes`` the bucket bytes.

Exposed time (the part of communication the training loop waited for): the compressed
hook is synchronous, so all its time is exposed. The dense and the cast hooks' bucket all-reduces run
behind the rest of backward; its exposed time is the time from the end of the backward
computation to the completion of every bucket of that backward. It is measured by an
autograd-engine callback queued at the first bucket: the engine runs it once the
backward graph is done (before DDP's own finalizer, which is queued at the last bucket),
and it waits for the backward's bucket futures (:func:`easgd_lightning.comm.ops.wait`).
"""

# NOTE: no ``from __future__ import annotations`` here: DDP's register_comm_hook checks
# that the hook's ``bucket`` annotation *is* ``dist.GradBucket``, which string annotations fail.
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from easgd_lightning.comm import ops
from easgd_lightning.comm.managed import ManagedGroup
from easgd_lightning.hooks import planner
from easgd_lightning.hooks._exchange import ExchangeStats, exchange_tensors
from easgd_lightning.hooks._fused import fusable, layout_for, start_exchange_flat
from easgd_lightning.hooks.collective import ProcessGroupCollective
from easgd_lightning.hooks.compressors.base import Compressor
from easgd_lightning.hooks.compressors.none import NoneCompressor
from easgd_lightning.hooks.memory import Memory, NoMemory, ResidualMemory, make_memory
from easgd_lightning.utils.atomic import atomic_write_json
from easgd_lightning.utils.checkpoint import from_plain, to_plain
from easgd_lightning.utils.checks import check_choice, check_int

__all__ = [
    "check_allreduce",
    "DenseHookState",
    "CompressionHookState",
    "dense_allreduce_hook",
    "compressed_allreduce_hook",
    "CastHookState",
    "cast_allreduce_hook",
    "register_compression_hook",
]


class DenseHookState:
    """State of the metered dense hook."""

    __slots__ = ("group", "world_size", "kind", "calls", "_inflight", "_comm_mark", "layout", "switch")

    def __init__(
        self, group: dist.ProcessGroup | None = None, kind: str = "data_parallel", layout=None, switch=None
    ):
        self.group = group
        self.layout = layout  # comm.layout.CommLayout: hierarchical reduction (comm.hierarchy)
        self.world_size = dist.get_world_size(group)
        self.kind = kind
        self.calls = 0
        self.switch = switch  # a comm.switch.SwitchClient: sum through the aggregator
        self._inflight: list[torch.futures.Future] | None = None
        self._comm_mark = 0.0

    def _start_inflight(self) -> None:
        """First bucket of a backward: wait for its buckets when the backward is done."""
        self._inflight, self._comm_mark = [], ops.comm_time(self.kind)
        torch.autograd.Variable._execution_engine.queue_callback(self._wait_inflight)

    def _wait_inflight(self) -> None:
        """End of backward computation: wait for this backward's buckets (exposed time, at
        most their communication time: :func:`easgd_lightning.comm.ops.wait_launched`)."""
        pending, self._inflight = self._inflight or [], None
        ops.wait_launched(pending, kind=self.kind, since=self._comm_mark)

    def compression_stats(self) -> dict:
        return {"compressor": "none", "calls": self.calls, **({"allreduce": "switch"} if self.switch else {})}


def dense_allreduce_hook(
    state: DenseHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with one metered asynchronous all-reduce."""
    state.calls += 1
    buf = bucket.buffer()
    buf.div_(state.world_size)
    if state.switch is not None:
        fut = state.switch.all_reduce_async(buf, kind=state.kind)
    else:
        fut = (state.layout or ops).all_reduce_async(buf, kind=state.kind, group=state.group)
    if state._inflight is None:  # first bucket of this backward
        state._start_inflight()
    state._inflight.append(fut)
    return fut.then(lambda f: f.value()[0])


class CompressionHookState:
    """State of :func:`compressed_allreduce_hook` (PyTorch ``PowerSGDState`` style).

    Args:
        compressor: the compressor (its ``min_numel`` is the dense-size policy).
        memory: error-feedback memory (default: :func:`make_memory` of the compressor).
        group: process group (None: the default group).
        kind: meter traffic class.
        warmup_steps: dense iterations before compression starts (>= 0; default 1).
        param_names: ``id(param) -> name`` used as state keys (from the model).
        auto_observe: feed the compressor's ``observe_compute_time`` (the gap between
            the previous iteration's last bucket and this iteration's first bucket) when
            it has one (``adaptive``).
        min_numel: overrides ``compressor.min_numel`` (tensors below travel dense).
        fusion_bytes: lazy all-reduce buffer size of the bucket's payloads (None: none).
        plan: ``none`` (the ``min_numel`` policy) or ``secopa`` (:mod:`~easgd_lightning.
            hooks.planner`); default: ``compressor.plan``.
        replan_steps: measure and plan again every this many iterations (0: once);
            default: ``compressor.replan_steps``.
        max_partitions: the most partitions a tensor is cut into; default:
            ``compressor.max_partitions``.
        param_specs: the parameters the planner plans (``TensorSpec`` per name).
        plan_dir: where rank 0 writes ``plan.json`` (None: not written).
    """

    __slots__ = (
        # hyper-parameters
        "compressor",
        "memory",
        "group",
        "kind",
        "warmup_steps",
        "min_numel",
        "auto_observe",
        "plan",
        "replan_steps",
        "max_partitions",
        "plan_dir",
        "param_specs",
        # internal state
        "collective",
        "iteration",
        "param_names",
        "tensor_states",
        "_new_iteration",
        "_last_end",
        "active_plan",
        "planned_at",
        "replans",
        # statistics
        "calls",
        "compressed_calls",
        "dense_calls",
        "bucket_stats",
        "totals",
    )

    def __init__(
        self,
        compressor: Compressor,
        memory: Memory | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        kind: str = "data_parallel",
        warmup_steps: int = 1,
        param_names: dict[int, str] | None = None,
        auto_observe: bool = True,
        min_numel: int | None = None,
        fusion_bytes: int | None = None,
        plan: str | None = None,
        replan_steps: int | None = None,
        max_partitions: int | None = None,
        param_specs: list | None = None,
        plan_dir: str | None = None,
    ) -> None:
        warmup_steps = check_int("hook warmup_steps", warmup_steps, 0)
        self.compressor = compressor
        self.memory = memory if memory is not None else make_memory(compressor)
        self.group = group
        self.kind = kind
        self.warmup_steps = warmup_steps
        min_numel = check_int("compression.min_numel", min_numel, 0, nullable=True)
        self.min_numel = compressor.min_numel if min_numel is None else min_numel
        self.auto_observe = auto_observe
        self.plan = getattr(compressor, "plan", "none") if plan is None else plan
        self.replan_steps = getattr(compressor, "replan_steps", 0) if replan_steps is None else replan_steps
        self.max_partitions = getattr(compressor, "max_partitions", 8) if max_partitions is None else max_partitions
        planner.check_plan_options(self.plan, self.replan_steps, self.max_partitions)
        self.param_specs = list(param_specs or [])
        self.plan_dir = plan_dir
        self.active_plan: planner.Plan | None = None
        self.planned_at = -1
        self.replans = 0
        self.collective = ProcessGroupCollective(group, kind=kind, fusion_bytes=fusion_bytes)
        self.iteration = 0
        self.param_names = dict(param_names or {})
        self.tensor_states: dict[str, dict] = {}
        self._new_iteration = True
        self._last_end: float | None = None
        self.calls = 0
        self.compressed_calls = 0
        self.dense_calls = 0
        self.bucket_stats: dict[int, ExchangeStats] = {}
        self.totals = ExchangeStats()

    @property
    def world_size(self) -> int:
        """The ranks exchanging now (the collective's group; under ``ft=torchft`` the step's
        quorum)."""
        return self.collective.world_size

    def compression_stats(self) -> dict:
        """Totals: calls, bytes (sent / dense) and times (comm / codec) of this hook."""
        t = self.totals
        return {
            "compressor": self.compressor.name,
            "calls": self.calls,
            "compressed_calls": self.compressed_calls,
            "dense_calls": self.dense_calls,
            "iterations": self.iteration,
            "bytes_sent": t.bytes_sent,
            "dense_bytes": t.dense_bytes,
            "compression_ratio": (t.dense_bytes / t.bytes_sent) if t.bytes_sent else None,
            "compressed_tensors": t.compressed_tensors,
            "dense_tensors": t.dense_tensors,
            "comm_time_s": t.comm_time_s,
            "codec_time_s": t.codec_time_s,
            "last_density": self._last_density(),
            # compressor-specific counters (lgc: the share of steps in its learned phase)
            **(self.compressor.run_stats() if hasattr(self.compressor, "run_stats") else {}),
            **({"plan": self.active_plan.summary() | {"replans": self.replans}} if self.active_plan else {}),
        }

    def maybe_plan(self) -> None:
        """Measure and plan (``plan="secopa"``) when none is active or ``replan_steps``
        iterations passed since the last one: a collective call on every rank."""
        if self.plan != "secopa" or not self.param_specs:
            return
        due = self.active_plan is None or (
            self.replan_steps > 0 and self.iteration - self.planned_at >= self.replan_steps
        )
        if not due:
            return
        largest = min(max(s.numel for s in self.param_specs), planner.MAX_PROBE_NUMEL)
        costs, probes = planner.measure_costs(
            self.compressor, group=self.group, sizes=planner.probe_sizes(largest)
        )
        self.active_plan = planner.make_plan(
            costs, self.param_specs, min_numel=self.min_numel, max_partitions=self.max_partitions,
            iteration=self.iteration, probes=probes,
        )
        self.replans += self.active_plan is not None and self.planned_at >= 0
        self.planned_at = self.iteration
        if self.plan_dir is not None and dist.get_rank(self.group) == 0:
            atomic_write_json(
                f"{self.plan_dir}/plan.json",
                {"compressor": self.compressor.name, **self.active_plan.to_dict(), "replans": self.replans},
            )

    def _last_density(self) -> float | None:
        """The density a scheduled sparsifier (DGC's warm-up) used in its last step (the
        largest over tensors), None for compressors without a schedule."""
        dens = [st["last_density"] for st in self.tensor_states.values() if "last_density" in st]
        return max(dens) if dens else None

    def state_dict(self) -> dict:
        """Checkpointable state (tensors and plain data): iteration counter, per-tensor
        compressor state (scratch buffers dropped), the compressor's own state, memory."""
        return to_plain(
            {
                "compressor": self.compressor.name,
                "iteration": self.iteration,
                "tensor_states": self.tensor_states,
                "compressor_state": self.compressor.state_dict(),
                "memory": self.memory.state_dict(),
            },
            "ddp hook state",
        )

    def load_state_dict(self, state: dict, device: torch.device | str | None = None) -> None:
        """Restore what :meth:`state_dict` saved, tensors onto ``device`` (the model's)."""
        state = from_plain(state, device)
        self.iteration = int(state.get("iteration", 0))
        self.tensor_states = dict(state.get("tensor_states", {}))
        self.compressor.load_state_dict(state.get("compressor_state") or {})
        self.memory.load_state_dict(state.get("memory", {}))

    def snapshot(self, *, shared_only: bool = False) -> dict:
        """A copy of everything an iteration changes: :meth:`state_dict` and the all-gather
        capacities (``ft=torchft``: put back by :meth:`restore` when a step is not committed).

        ``shared_only``: without what only this worker accumulated from its own gradients --
        the residual memory and the compressor's ``worker_state`` entries (DGC's u and v) --
        keeping what every rank holds alike (PowerSGD's Q, step counters, seeds,
        capacities): what a worker that joins a running training receives from a peer, so
        that its own error feedback starts from zero, as at the start of a run, instead of
        sending the peer's owed gradient a second time.
        """
        hook = self.state_dict()
        if shared_only:
            hook["memory"] = {}  # a Memory loads {} as "nothing owed"
            drop = self.compressor.worker_state
            hook["tensor_states"] = {
                key: {k: v for k, v in st.items() if k not in drop} if isinstance(st, dict) else st
                for key, st in hook["tensor_states"].items()
            }
        return {"hook": hook, "caps": self.collective.capacities()}

    def restore(self, snap: dict, device: torch.device | str | None = None) -> None:
        """Return to a :meth:`snapshot` (this rank's own, or a peer's)."""
        self.load_state_dict(snap["hook"], device)
        self.collective.load_capacities(snap["caps"])

    def _key(self, param: torch.Tensor, bucket_index: int, pos: int) -> str:
        return self.param_names.get(id(param)) or f"bucket{bucket_index}.{pos}"


def _exchange_per_tensor(state: CompressionHookState, buf: torch.Tensor, grads: list, keys: list) -> ExchangeStats:
    """The bucket's tensors exchanged one by one (:func:`~easgd_lightning.hooks._exchange.
    exchange_tensors`), their means written into the bucket."""
    means, stats = exchange_tensors(
        grads,
        keys,
        state.compressor,
        state.memory,
        state.tensor_states,
        state.collective,
        min_numel=state.min_numel,
        plan=state.active_plan,
    )
    for g, m in zip(grads, means):
        if g.data_ptr() != m.data_ptr():
            g.copy_(m)
    if grads and grads[0].data_ptr() != buf.data_ptr():  # not views: write back
        torch.cat([g.reshape(-1) for g in grads], out=buf)
    return stats


def compressed_allreduce_hook(
    state: CompressionHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket through ``state.compressor`` (synchronous; completed future)."""
    state.calls += 1
    now = time.perf_counter()
    first_bucket = state._new_iteration
    if state._new_iteration:
        state._new_iteration = False
        observe = getattr(state.compressor, "observe_compute_time", None)
        if state.auto_observe and callable(observe) and state._last_end is not None:
            observe(now - state._last_end)
    buf = bucket.buffer()
    if state.iteration < state.warmup_steps:
        state.dense_calls += 1
        buf.div_(state.world_size)
        ops.all_reduce(buf, kind=state.kind, group=state.group)
    else:
        state.compressed_calls += 1
        if first_bucket or state.active_plan is None:
            state.maybe_plan()
        grads = bucket.gradients()
        params = bucket.parameters()
        idx = bucket.index()
        keys = [state._key(p, idx, i) for i, p in enumerate(params)]
        if grads and grads[0].data_ptr() == buf.data_ptr() and fusable(
            state.compressor, state.collective, state.active_plan
        ):  # the bucket is the flat buffer: one codec call, the mean written into it
            layout = layout_for(state.tensor_states, [g.shape for g in grads], keys, state.min_numel)
            _, _, stats = start_exchange_flat(
                buf, layout, state.compressor, state.memory, state.tensor_states, state.collective, out=buf
            ).finish()
        else:
            stats = _exchange_per_tensor(state, buf, grads, keys)
        state.bucket_stats.setdefault(idx, ExchangeStats()).add(stats)
        state.totals.add(stats)
    if bucket.is_last():
        state.iteration += 1
        state._new_iteration = True
        state._last_end = time.perf_counter()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


class CastHookState(CompressionHookState):
    """State of :func:`cast_allreduce_hook`: :class:`CompressionHookState`'s options and
    statistics, plus the bucket futures of the running backward (exposed time, as
    :class:`DenseHookState`)."""

    __slots__ = ("_inflight", "_comm_mark")

    def __init__(self, compressor: Compressor, *args, **kwargs) -> None:
        super().__init__(compressor, *args, **kwargs)
        self._inflight: list[torch.futures.Future] | None = None
        self._comm_mark = 0.0

    _start_inflight = DenseHookState._start_inflight
    _wait_inflight = DenseHookState._wait_inflight


def casts_whole_tensors(compressor: Compressor, memory: Memory, plan: str | None, group=None) -> bool:
    """Whether ``compressor`` runs as :func:`cast_allreduce_hook`: a 16-bit cast
    (``wire_dtype``, one all-reduce, :class:`~easgd_lightning.hooks.compressors.fp16.
    FP16Compressor` and ``bf16``) with no residual memory and no SeCoPa plan, over a plain
    process group (under ``ft=torchft``'s quorum, a ``ManagedGroup``, the step is committed
    or rolled back around a synchronous exchange: the compressed hook stays)."""
    planned = (getattr(compressor, "plan", "none") if plan is None else plan) != "none"
    return (
        getattr(compressor, "wire_dtype", None) is not None
        and isinstance(memory, NoMemory)
        and not planned
        and not isinstance(group, ManagedGroup)
    )


def _segments(sizes: list[int], keep) -> list[tuple[int, int]]:
    """(offset, length) runs of the bucket covering every tensor whose size ``keep(size)``
    accepts, adjacent tensors merged into one run (one copy per run on the hot path: a bucket
    whose tensors are all kept is one run)."""
    out: list[tuple[int, int]] = []
    offset = 0
    for n in sizes:
        if keep(n):
            if out and sum(out[-1]) == offset:
                out[-1] = (out[-1][0], out[-1][1] + n)
            else:
                out.append((offset, n))
        offset += n
    return out


def _gather(buf: torch.Tensor, segments: list[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
    """The ``segments`` of ``buf`` in one new tensor of ``dtype`` (a cast copy)."""
    out = torch.empty(sum(n for _, n in segments), dtype=dtype, device=buf.device)
    pos = 0
    for offset, n in segments:
        out[pos : pos + n].copy_(buf[offset : offset + n])
        pos += n
    return out


def _scatter(buf: torch.Tensor, segments: list[tuple[int, int]], summed: torch.Tensor) -> None:
    """Inverse of :func:`_gather`: write ``summed`` back into ``buf``'s segments."""
    pos = 0
    for offset, n in segments:
        buf[offset : offset + n].copy_(summed[pos : pos + n])
        pos += n


def cast_allreduce_hook(
    state: CastHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with 16-bit values on the wire, without waiting (module docstring).

    Rule (per tensor, as :class:`~easgd_lightning.hooks.compressors.fp16.FP16Compressor`):
    mean = float(sum_i half(g_i / p)) for tensors of ``min_numel`` elements or more, the
    fp32 mean for the others; the first ``warmup_steps`` iterations are all fp32.
    """
    state.calls += 1
    start = time.perf_counter()
    buf = bucket.buffer()
    buf.div_(state.world_size)
    if state.iteration < state.warmup_steps:
        state.dense_calls += 1
        parts = [(_segments([buf.numel()], lambda n: True), buf.dtype)]
    else:
        state.compressed_calls += 1
        sizes = [g.numel() for g in bucket.gradients()]
        wire = state.compressor.wire_dtype
        parts = [
            (_segments(sizes, lambda n: n < state.min_numel), buf.dtype),
            (_segments(sizes, lambda n: n >= state.min_numel), wire),
        ]
        compressed = sum(n >= state.min_numel for n in sizes)
        state.totals.dense_tensors += len(sizes) - compressed
        state.totals.compressed_tensors += compressed
    sent = [(segs, _gather(buf, segs, dtype)) for segs, dtype in parts if segs]
    futs = [
        ops.all_reduce_async(msg, kind=state.kind, group=state.group,
                             dense_bytes=msg.numel() * buf.element_size())
        for _, msg in sent
    ]
    stats = state.totals
    stats.bytes_sent += sum(m.numel() * m.element_size() for _, m in sent)
    stats.dense_bytes += buf.numel() * buf.element_size()
    stats.codec_time_s += time.perf_counter() - start

    def write_back(_) -> torch.Tensor:
        for (segs, _msg), fut in zip(sent, futs):
            _scatter(buf, segs, fut.value()[0])
        stats.comm_time_s += time.perf_counter() - start
        return buf

    done = torch.futures.collect_all(futs).then(write_back)
    if state._inflight is None:  # first bucket of this backward
        state._start_inflight()
    state._inflight.append(done)
    if bucket.is_last():
        state.iteration += 1
    return done


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    inner = getattr(model, "module", model)
    return {id(p): name for name, p in inner.named_parameters()}


def check_allreduce(allreduce: str, aggregator: str, compressor) -> None:
    """``comm.allreduce`` / ``comm.aggregator`` values; ValueError naming the key."""
    from easgd_lightning.comm.layout import AGGREGATORS, ALLREDUCES

    check_choice("comm.allreduce", allreduce, ALLREDUCES)
    check_choice("comm.aggregator", aggregator, AGGREGATORS)
    if allreduce == "switch" and not (compressor is None or isinstance(compressor, NoneCompressor)):
        raise ValueError(
            "comm.allreduce=switch sums dense gradients; it needs compression=none, got "
            f"compression={compressor.name}"
        )


def _param_specs(model: torch.nn.Module) -> list[planner.TensorSpec]:
    inner = getattr(model, "module", model)
    return [
        planner.TensorSpec(name, tuple(p.shape), p.element_size())
        for name, p in inner.named_parameters()
        if p.requires_grad
    ]


def register_compression_hook(
    model: DistributedDataParallel,
    compressor: Compressor | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    memory: Memory | bool | None = None,
    warmup_steps: int = 1,
    kind: str = "data_parallel",
    auto_observe: bool = True,
    min_numel: int | None = None,
    layout=None,
    allreduce: str = "ring",
    aggregator: str = "rank0",
    plan: str | None = None,
    replan_steps: int | None = None,
    max_partitions: int | None = None,
    plan_dir: str | None = None,
    timeout_s: float = 300.0,
):
    """Register the hook for ``compressor`` on ``model`` and return its state.

    ``None`` or a ``none`` compressor registers the metered dense hook
    (:class:`DenseHookState`); any other compressor registers
    :func:`compressed_allreduce_hook` with a :class:`CompressionHookState` (statistics via
    ``state.compression_stats()``, checkpoint via ``state.state_dict()``).

    Args:
        model: the ``DistributedDataParallel`` module.
        compressor: from :func:`easgd_lightning.hooks.build_compressor`, or None.
        group: process group.
        memory: error-feedback memory, or a bool (residuals on / off); default: from
            ``compressor.memory``.
        warmup_steps: dense iterations first (DDP rebuilds buckets after iteration 1).
        kind: meter traffic class.
        auto_observe: feed measured compute time to adaptive compressors.
        min_numel: overrides ``compressor.min_numel``.
        layout: the ``comm`` layout (:class:`easgd_lightning.comm.layout.CommLayout`): the
            dense hook reduces hierarchically with ``hierarchy=node``; the compressed hook
            fuses the payloads of a bucket into ``fusion_mb`` buffers.
        allreduce: ``ring`` (gloo's all-reduce) or ``switch`` (the emulated in-network
            aggregator, :class:`~easgd_lightning.comm.switch.SwitchClient`; dense only).
        aggregator: where the switch's aggregator runs (``rank0`` or ``external``).
        plan, replan_steps, max_partitions, plan_dir: the SeCoPa planner's options
            (:class:`CompressionHookState`).
        timeout_s: how long the switch group's members wait for each other.
    """
    check_allreduce(allreduce, aggregator, compressor)
    if compressor is None or isinstance(compressor, NoneCompressor):
        switch = None
        if allreduce == "switch":
            from easgd_lightning.comm.switch import SwitchClient

            switch = SwitchClient(aggregator, timeout_s=timeout_s)
        state = DenseHookState(group, kind=kind, layout=layout, switch=switch)
        model.register_comm_hook(state, dense_allreduce_hook)
        return state
    if not isinstance(compressor, Compressor):
        raise ValueError(
            f"compression must be a Compressor (see easgd_lightning.hooks.build_compressor), "
            f"got {type(compressor).__name__}"
        )
    if isinstance(memory, bool):
        memory = ResidualMemory() if memory else NoMemory()
    if isinstance(memory, ResidualMemory) and not compressor.allows_memory:
        raise ValueError(compressor.memory_error())
    if memory is None:
        memory = make_memory(compressor)
    cast = casts_whole_tensors(compressor, memory, plan, group)
    state = (CastHookState if cast else CompressionHookState)(
        compressor,
        memory,
        group=group,
        kind=kind,
        warmup_steps=warmup_steps,
        param_names=_param_names(model),
        auto_observe=auto_observe,
        min_numel=min_numel,
        fusion_bytes=None if layout is None else layout.fusion_bytes,
        plan=plan,
        replan_steps=replan_steps,
        max_partitions=max_partitions,
        param_specs=_param_specs(model),
        plan_dir=plan_dir,
    )
    model.register_comm_hook(state, cast_allreduce_hook if cast else compressed_allreduce_hook)
    return state
