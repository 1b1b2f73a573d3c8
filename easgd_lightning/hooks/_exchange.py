"""Per-tensor compressed exchange shared by the DDP hook and the elastic exchange.

Which path an exchange takes: a codec with ``fused_segments`` (the list:
:mod:`easgd_lightning.hooks._fused`) and no SeCoPa plan runs the fused exchange of
:mod:`easgd_lightning.hooks._fused` over the attach point's flat buffer (one codec call,
one message, each tensor's own rule kept per segment, the same numbers); every other codec
runs the per-tensor exchange below (its payloads still travel in one batched message or
fused all-reduce buffers per exchange, but the codec is called once per tensor).

Policy: tensors with fewer than ``compressor.min_numel`` elements are concatenated and
sent dense (one message, as DGC and HiPress do for small layers; a compressor with a
``dense_part(tensor, state, world)`` method -- DGC's momentum -- says what they send); every other
tensor is error-compensated by ``memory``, exchanged with ``compressor.aggregate`` (one
``state`` dict per tensor key) and its residual stored. Dense bytes are charged once per
exchange, so the meter's ``dense_bytes`` is what the same tensors cost uncompressed.
With a collective that batches all-gathers (:class:`~easgd_lightning.hooks.collective.
ProcessGroupCollective`), the dense part travels in the same all-gathered message as the
payloads and is summed in rank order: one collective per exchange for the one-round
codecs; otherwise it is one all-reduce of its own. A collective with a ``fused`` context
(GradientFlow's lazy all-reduce, ``comm.fusion_mb``) puts the all-reduce sums of the
exchange in buffers of at least that size.

:func:`start_exchange_tensors` is the same exchange split in two, for overlap with
computation: the launch compensates, compresses, updates the residual and starts the
collectives without blocking; :meth:`PendingExchange.finish` waits, decompresses and sums.
It splits the compressors whose exchange is one collective between ``compress`` and
``decompress`` (the base class's or the sparse base's ``aggregate``). Those with
``aggregate_rounds`` (PowerSGD's two all-reduces, fp16/bf16, csc's chunk scores then its
chosen chunks, sketch's bitmap OR then its sketch sum) are driven round by round
over all the exchange's tensors (:func:`_start_rounds`): each round of every tensor is
launched before any is waited for, so with ``fused`` the exchange sends one lazy
all-reduce buffer per round (and dtype), not one message per tensor and round; their
``locals`` are known at finish. The others that override ``aggregate`` (adaptive, lgc,
sgc, two-way) run it whole at launch (one message per tensor and round) on this path;
every codec but QSGD above 32767 levels takes the fused exchange where it applies
(:mod:`easgd_lightning.hooks._fused`). Both halves run
every rank's arithmetic in the same order
whether they are called back to back or far apart, so an overlapped exchange gives
bitwise the result of one finished at once.

A ``plan`` (HiPress SeCoPa, :mod:`easgd_lightning.hooks.planner`) replaces the
``min_numel`` policy per tensor key: dense or compressed, and in how many partitions.
A tensor planned in K > 1 partitions travels through CaSync's pipeline
(:func:`pipelined_exchange`): it is error-compensated whole, cut along its first dimension
(:func:`split_partitions`), and each partition is exchanged as a tensor of its own (state
key ``"<key>#<j>/<K>"``) with non-blocking collectives: partition j + 1 is encoded and
launched while partition j is on the wire, and partition j is decoded while the later
ones still travel. Each partition's collective rounds are driven by a generator
(:func:`exchange_rounds`): the compressor's ``aggregate_rounds`` when it has one
(PowerSGD: the P all-reduce, then the Q all-reduce), else ``start_aggregate`` (encode and
launch) then its ``finish`` (wait and decode). The result is bitwise that of each
partition exchanged alone, one after the other.
"""

from __future__ import annotations

import time
import zlib
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from easgd_lightning.comm.meter import get_meter
from easgd_lightning.hooks.compressors.base import (
    Compressor,
    scratch_buffer,
    scratch_of,
    start_collective,
    want_local,
)
from easgd_lightning.hooks.memory import Memory

__all__ = [
    "ExchangeStats",
    "PendingExchange",
    "exchange_tensors",
    "exchange_rounds",
    "rounds_of",
    "pipelined_exchange",
    "start_pipeline",
    "split_partitions",
    "partition_key",
    "start_exchange_tensors",
    "key_hash",
]


def key_hash(key) -> int:
    """A stable 31-bit integer for a tensor key (same on every rank)."""
    return zlib.crc32(str(key).encode()) & 0x7FFFFFFF


def _state_of(states: dict, key) -> dict:
    """The codec state of ``key`` in ``states``, created on first use with its stable
    ``key_hash`` (seeded codecs draw from it)."""
    st = states.setdefault(key, {})
    st.setdefault("key_hash", key_hash(key))
    return st


def _compensated_copy(memory: Memory, key, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` plus ``key``'s residual, never the caller's own tensor: without memory a
    copy (a codec's later rounds read it after the caller may have changed its tensor)."""
    comp = memory.compensate(key, tensor)
    return tensor.detach().clone() if comp is tensor else comp


@dataclass
class ExchangeStats:
    """What one call moved and how long the codec (not the wire) took."""

    compressed_tensors: int = 0
    dense_tensors: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    dense_bytes: int = 0
    comm_time_s: float = 0.0
    codec_time_s: float = 0.0

    def add(self, other: ExchangeStats) -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, getattr(self, f) + getattr(other, f))


def _dense_parts(tensors, keys, small, compressor, states, world) -> dict:
    """index -> what each small tensor sends dense: itself, or the compressor's
    ``dense_part(tensor, state, world)`` when it has one (DGC keeps momentum there)."""
    dense_part = getattr(compressor, "dense_part", None)
    if not callable(dense_part):
        return {i: tensors[i] for i in small}
    return {i: dense_part(tensors[i], states.setdefault(keys[i], {}), world) for i in small}


def _kind_totals(kind: str) -> tuple[int, int, int, float, float]:
    t = get_meter().by_kind[kind]
    return t.bytes_sent, t.bytes_recv, t.dense_bytes, t.time_s, t.exposed_s


class PendingExchange:
    """An exchange started by :func:`start_exchange_tensors`; :meth:`finish` completes it."""

    def __init__(self, n: int, collective, before: tuple) -> None:
        self.means: list[torch.Tensor | None] = [None] * n
        self.locals: list[torch.Tensor | None] = [None] * n
        self._finishers: list = []
        self._collective = collective
        self._before = before
        self._busy_s = 0.0
        self.stats = ExchangeStats()

    def finish(self) -> tuple[list[torch.Tensor], list[torch.Tensor], ExchangeStats]:
        """Wait for the collectives; returns (means, this rank's parts, stats)."""
        start = time.perf_counter()
        for fin in self._finishers:
            fin()
        self._finishers = []
        after = _kind_totals(self._collective.kind)
        busy = self._busy_s + time.perf_counter() - start
        st = self.stats
        st.bytes_sent = after[0] - self._before[0]
        st.bytes_recv = after[1] - self._before[1]
        st.dense_bytes = after[2] - self._before[2]
        st.comm_time_s = after[3] - self._before[3]
        st.codec_time_s = max(0.0, busy - (after[4] - self._before[4]))
        return self.means, self.locals, st  # type: ignore[return-value]


def _start_small(pending, tensors, keys, small, compressor, states, collective, fold: bool) -> None:
    """Launch the dense exchange of the small tensors: their parts concatenated into one
    buffer (reused: ``states``' scratch), summed over ranks by an all-reduce, or, when
    ``fold``, sent in the batched all-gather of the payloads and summed here in rank order
    (the same sum on every rank; one collective per exchange instead of two)."""
    world = collective.world_size
    parts = _dense_parts(tensors, keys, small, compressor, states, world)
    n = sum(tensors[i].numel() for i in small)
    first = parts[small[0]]
    scratch = scratch_of(states)
    flat = scratch_buffer(scratch, f"small:{keys[small[0]]}", n, first.dtype, first.device)
    torch.cat([parts[i].reshape(-1) for i in small], out=flat)
    collective.charge_dense(flat.numel() * flat.element_size())
    handle = start_collective(collective, "all_gather" if fold else "all_reduce_sum", [flat])
    offset = 0
    for i in small:  # this rank's parts: views of its message
        pending.locals[i] = flat[offset : offset + tensors[i].numel()].view_as(tensors[i])
        offset += tensors[i].numel()

    def finish_small() -> None:
        if fold:
            rows = handle.wait()
            summed = scratch_buffer(scratch, f"small_sum:{keys[small[0]]}", n, flat.dtype, flat.device)
            summed.copy_(rows[0][0])
            for row in rows[1:]:
                summed.add_(row[0])
        else:
            (summed,) = handle.wait()
        summed /= world
        offset = 0
        for i in small:
            k = tensors[i].numel()
            pending.means[i] = summed[offset : offset + k].view(pending.locals[i].shape)
            offset += k

    pending._finishers.append(finish_small)
    pending.stats.dense_tensors += len(small)


def split_partitions(tensor: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``parts`` contiguous views of ``tensor`` cut along its first dimension (1-D: its
    elements), as equal as ``torch.tensor_split`` makes them (at most one per row)."""
    if tensor.dim() >= 2:
        return list(torch.tensor_split(tensor, min(parts, tensor.shape[0]), dim=0))
    flat = tensor.reshape(-1)
    return list(torch.tensor_split(flat, max(1, min(parts, flat.numel()))))


def partition_key(key, j: int, parts: int) -> str:
    """The state key of partition ``j`` of ``parts`` of the tensor ``key``."""
    return f"{key}#{j}/{parts}"


def rounds_of(compressor: Compressor):
    """``compressor.aggregate_rounds`` when it is the generator of the compressor's own
    ``aggregate`` (the class that defines ``aggregate`` defines it too), else None: a
    subclass that replaces ``aggregate`` (ACP-SGD's one collective under PowerSGD) does not
    inherit its parent's rounds."""
    owner = next((c for c in type(compressor).__mro__ if "aggregate" in vars(c)), None)
    if owner is None or "aggregate_rounds" not in vars(owner):
        return None
    return compressor.aggregate_rounds


def exchange_rounds(compressor: Compressor, tensor: torch.Tensor, state: dict, collective):
    """One tensor's exchange as a generator: it yields after launching each non-blocking
    collective round and returns (mean, local) when the last one is decoded.
    ``compressor.aggregate_rounds`` (same protocol, :func:`rounds_of`) when it has one,
    else ``start_aggregate`` then its ``finish``."""
    rounds = rounds_of(compressor)
    if rounds is not None:
        return (yield from rounds(tensor, state, collective))
    local, finish = compressor.start_aggregate(tensor, state, collective)
    yield
    return finish(), local


def start_pipeline(
    compressor: Compressor,
    parts: list[torch.Tensor],
    states: list[dict],
    collective,
    dense_bytes: list[int] | None = None,
    *,
    fuse: bool = False,
):
    """CaSync's pipeline over the partitions of one tensor, launched: every partition's
    first round is encoded and launched, in order (``dense_bytes``, per partition, charged
    before each launch). Returns ``finish``: it advances the partitions round by round in
    order (wait, decode or encode the next round and launch it) and returns, per
    partition, (mean, local). With ``fuse``, each of those passes runs inside the
    collective's ``fused`` context: the rounds launched in one pass share lazy all-reduce
    buffers (the tensors of an exchange driven round by round, :func:`_start_rounds`)."""
    streams = [exchange_rounds(compressor, p, st, collective) for p, st in zip(parts, states, strict=True)]
    results: list = [None] * len(streams)

    def advance(j: int) -> bool:
        try:
            next(streams[j])
            return True
        except StopIteration as done:
            results[j] = done.value
            return False

    live = []
    for j in range(len(streams)):
        if dense_bytes is not None:
            collective.charge_dense(dense_bytes[j], key=states[j].get("_partition_key"))
        if advance(j):
            live.append(j)

    fused = getattr(collective, "fused", nullcontext) if fuse else nullcontext

    def finish() -> list:
        nonlocal live
        while live:
            with fused():
                live = [j for j in live if advance(j)]
        return results

    return finish


def pipelined_exchange(compressor: Compressor, parts, states, collective, dense_bytes=None) -> list:
    """:func:`start_pipeline` finished at once: per partition, (mean, local)."""
    return start_pipeline(compressor, parts, states, collective, dense_bytes)()


def _start_partitioned(pending, i, tensor, key, parts, compressor, memory, states, collective) -> None:
    """Launch tensor ``i``'s pipelined exchange in ``parts`` partitions (module docstring);
    the pipeline is driven to its end, the residual updated and the mean joined at finish."""
    _state_of(states, key)  # the whole tensor keeps its entry too, as an unpartitioned one
    comp = _compensated_copy(memory, key, tensor)
    pieces = split_partitions(comp, parts)
    pstates = []
    for j in range(len(pieces)):
        pk = partition_key(key, j, len(pieces))
        pst = _state_of(states, pk)
        pst["_partition_key"] = pk
        pstates.append(pst)
    dense = [p.numel() * p.element_size() for p in pieces]
    pending.stats.compressed_tensors += 1
    finish = start_pipeline(compressor, pieces, pstates, collective, dense)

    def finish_partitioned() -> None:
        results = finish()
        cat = (lambda ts: torch.cat(ts, dim=0)) if comp.dim() >= 2 else (lambda ts: torch.cat([t.reshape(-1) for t in ts]))
        local = cat([loc.reshape(p.shape) for (_, loc), p in zip(results, pieces)]).view(comp.shape)
        memory.update(key, comp, local)
        pending.locals[i] = local
        pending.means[i] = cat([m.reshape(p.shape) for (m, _), p in zip(results, pieces)]).view(comp.shape)

    pending._finishers.append(finish_partitioned)


def _start_rounds(pending, idx, tensors, keys, compressor, memory, states, collective, want_locals: bool) -> None:
    """Launch the compressed tensors ``idx`` of a codec with ``aggregate_rounds`` (several
    collective rounds: PowerSGD's P and Q, csc's scores and chunks, sketch's OR and sum,
    fp16's one all-reduce) round by round over all
    of them: every tensor's first round now (inside the exchange's ``fused`` context: one
    lazy all-reduce buffer with the dense small tensors), each later round of every tensor
    in one pass of ``finish`` (GradientFlow's lazy all-reduce for multi-round codecs: the
    messages of an exchange are its rounds' buffers, not rounds x tensors). Each tensor's
    arithmetic is that of its own ``aggregate``; its residual is updated at finish."""
    comps, pstates, dense = [], [], []
    for i in idx:
        key, t = keys[i], tensors[i]
        st = _state_of(states, key)
        want_local(st, want_locals)
        comp = _compensated_copy(memory, key, t)
        comps.append(comp)
        pstates.append(st)
        dense.append(t.numel() * t.element_size())
    pending.stats.compressed_tensors += len(idx)
    finish = start_pipeline(compressor, comps, pstates, collective, dense, fuse=True)

    def finish_rounds() -> None:
        for i, comp, (mean, local) in zip(idx, comps, finish(), strict=True):
            memory.update(keys[i], comp, local)
            pending.locals[i], pending.means[i] = local, mean

    pending._finishers.append(finish_rounds)


def _policy(tensors, keys, limit: int, plan) -> tuple[list[int], list[int], dict[int, int]]:
    """(dense, compressed whole, {index: partitions > 1}): ``plan``'s decision per key where
    it has one, else dense under ``limit`` elements."""
    small, big, piped = [], [], {}
    for i, t in enumerate(tensors):
        d = plan.get(keys[i]) if plan is not None else None
        if d is None:
            (small if t.numel() < limit else big).append(i)
        elif not d.compress:
            small.append(i)
        elif d.partitions > 1:
            piped[i] = d.partitions
        else:
            big.append(i)
    return small, big, piped


def start_exchange_tensors(
    tensors: list[torch.Tensor],
    keys: list,
    compressor: Compressor,
    memory: Memory,
    states: dict,
    collective,
    min_numel: int | None = None,
    plan=None,
    want_locals: bool = False,
) -> PendingExchange:
    """Launch the exchange of the module docstring; :meth:`PendingExchange.finish` ends it.

    Every rank must call this with tensors of the same shapes in the same order; ``min_numel``
    overrides ``compressor.min_numel``; ``plan`` (a :class:`~easgd_lightning.hooks.planner.
    Plan`, the same on every rank) decides per key instead. The input tensors are read
    during the launch only (they may change afterwards). Unless ``want_locals``, a
    compressed tensor's part in ``PendingExchange.locals`` may be None (a codec that
    writes its residual in place skips forming it: :func:`~easgd_lightning.hooks.
    compressors.base.wants_local`).
    """
    kind = collective.kind
    start = time.perf_counter()
    pending = PendingExchange(len(tensors), collective, _kind_totals(kind))
    limit = compressor.min_numel if min_numel is None else int(min_numel)
    small, big, piped = _policy(tensors, keys, limit, plan)
    staged = big if rounds_of(compressor) is not None else []  # multi-round codecs (PowerSGD, fp16)
    big = [] if staged else big
    batched = getattr(collective, "batched", None)  # one message for all payloads
    fold = bool(batched and big and small)  # the small tensors ride in that message too
    fused = getattr(collective, "fused", nullcontext)  # lazy all-reduce of the sums (comm.fusion_mb)
    with batched(tuple(keys[i] for i in big)) if batched and big else nullcontext(), fused():
        if small:
            _start_small(pending, tensors, keys, small, compressor, states, collective, fold)
        for i in big:
            t, key = tensors[i], keys[i]
            st = _state_of(states, key)
            want_local(st, want_locals)
            comp = memory.compensate(key, t)
            collective.charge_dense(t.numel() * t.element_size(), key=key)
            local, finish = compressor.start_aggregate(comp, st, collective)
            memory.update(key, comp, local)
            pending.locals[i] = local
            pending.stats.compressed_tensors += 1

            def finish_big(i=i, finish=finish) -> None:
                pending.means[i] = finish()

            pending._finishers.append(finish_big)
        if staged:
            _start_rounds(pending, staged, tensors, keys, compressor, memory, states, collective, want_locals)
    for i, parts in piped.items():
        _start_partitioned(pending, i, tensors[i], keys[i], parts, compressor, memory, states, collective)
    pending._busy_s = time.perf_counter() - start
    return pending


def exchange_tensors(*args, locals_out: list | None = None, **options) -> tuple[list[torch.Tensor], ExchangeStats]:
    """Mean over ranks of each tensor (same order, same shapes) under the policy above:
    :func:`start_exchange_tensors` (same arguments) finished at once.

    When ``locals_out`` is a list, it receives this rank's transmitted (decompressed)
    contribution per tensor.
    """
    means, mine, stats = start_exchange_tensors(*args, want_locals=locals_out is not None, **options).finish()
    if locals_out is not None:
        locals_out.extend(mine)
    return means, stats
