"""The compressor interface shared by every scheme (DESIGN.md 4.3).

A compressor is pure tensor code. It never calls ``torch.distributed``: the communication
pattern it needs is expressed against a :class:`Collective`, which the attach points
(DDP hook, elastic exchange, pipeline hook) implement over :mod:`easgd_lightning.comm`.

* ``compress(tensor, state) -> Payload``: ``payload.tensors`` travel on the wire,
  ``payload.meta`` (shape, numel, dtype, ...) stays local.
* ``decompress(payload, shape) -> Tensor``.
* ``aggregation``: ``"allreduce"`` when payloads of different ranks can be summed
  element-wise and then decompressed (fp16, random-k with a shared seed, PowerSGD
  factors); ``"allgather"`` for payloads that are not linear (index/value pairs, per-rank
  scales).
* ``payload_bytes(payload)``: the bytes that travel.
* ``aggregate(tensor, state, collective) -> (mean, local)``: the whole exchange: the mean
  over ranks of everybody's decompressed contribution, and this rank's own decompressed
  contribution (for error feedback: residual = input - local). The default implements
  the two aggregation kinds; multi-round schemes (PowerSGD, sketch) override it.
* ``state_dict() / load_state_dict(state)``: compressor-wide state a resume needs (QSGD's
  noise generator, the adaptive compressor's measurements); the attach points checkpoint
  it beside the per-tensor states. Empty by default.

``state`` is a mutable ``dict`` owned by the caller, one per communicated tensor (bucket,
flat parameter buffer), so a compressor instance can serve many tensors. Error feedback
is not part of a compressor: see :mod:`easgd_lightning.hooks.memory`. Full-size working
buffers reused from step to step live in ``state["_scratch"]`` (a dict); checkpoints drop
that key, so nothing that must survive a resume is kept there. ``decompress`` returns a
new tensor unless the caller put a dense buffer in ``payload.meta["out"]`` (the compressors
that support it write into that buffer and return it). Payload tensors may be scratch
buffers too (QSGD's levels, signSGD's bits). The two tensors ``aggregate``
returns are such scratch buffers: valid until the next call with the same ``state``; copy
them to keep them longer.

Residual hand-off (one pass instead of three): :class:`~easgd_lightning.hooks.memory.
ResidualMemory` marks the compensated tensor p it returns (:func:`offer_residual`). A
compressor that gets such a tensor may overwrite it with p - decompress(its own payload),
bit for bit what the memory would compute, and say so with :func:`residual_written`; the
memory then keeps p as the residual without another pass (a sparsifier zeroes the sent
entries, EF-signSGD subtracts the scaled signs).

Every compressor also carries the two attach-point policies configured with it
(``conf/compression/*.yaml``): ``min_numel`` (tensors with fewer elements travel dense,
default :data:`DEFAULT_MIN_NUMEL` = 16384 as in DGC) and ``memory`` (whether the attach
point keeps residual error feedback for it; the default is per compressor,
``default_memory``). Attach points may store ``state["key_hash"]`` (a stable integer per
tensor) so seeded compressors draw different patterns for different tensors.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Protocol

import torch

from easgd_lightning.utils.checks import (  # re-exported: the compressors' vocabulary
    check_bool,
    check_choice,
    check_int,
    check_momentum,
    check_positive,
    check_ratio,
)

__all__ = [
    "DEFAULT_MIN_NUMEL",
    "Payload",
    "Collective",
    "LinkTraffic",
    "MeasuredCollective",
    "Compressor",
    "tensor_bytes",
    "num_selected",
    "check_ratio",
    "check_momentum",
    "check_int",
    "check_positive",
    "check_bool",
    "check_choice",
    "pack_sparse",
    "unpack_sparse",
    "pack_bits",
    "unpack_bits",
    "index_dtype_for",
    "offer_residual",
    "may_write_residual",
    "residual_written",
    "take_residual_written",
    "want_local",
    "wants_local",
    "scratch_of",
    "dense_out",
    "scratch_buffer",
    "with_out",
    "sparse_out",
    "record_sparse",
    "start_collective",
    "run_rounds",
    "mean_of",
]

#: Tensors with fewer elements than this travel dense (DGC, Lin et al. 2018, use ~16k).
DEFAULT_MIN_NUMEL = 16384

Aggregation = Literal["allreduce", "allgather"]


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the given tensors' storage as sent (numel * element size)."""
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Payload:
    """What a compressor produces: ``tensors`` go on the wire, ``meta`` stays local."""

    tensors: tuple[torch.Tensor, ...]
    meta: dict = field(default_factory=dict)


class Collective(Protocol):
    """The communication a compressor may ask for; implemented by the attach points."""

    world_size: int

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Element-wise sum over ranks of each tensor (same shapes on every rank)."""

    def all_reduce_max(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Element-wise max over ranks of each tensor (same shapes on every rank)."""

    def all_gather(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's list of tensors (shapes may differ per rank); index ``[rank][i]``."""

    def all_to_all(self, sends: list[torch.Tensor]) -> list[torch.Tensor]:
        """``sends[j]`` (1-D, one dtype for all, lengths free) to rank j; returns, per source
        rank i, the tensor i sent to this rank (its own piece is its input). A world of one
        returns its input."""

    # Optional: ``all_reduce_bor(tensors)`` -- bitwise OR over ranks of integer tensors
    # (the sketch compressor's bit-packed bitmaps); without it they are max-reduced unpacked.


@dataclass
class LinkTraffic:
    """Payload bytes this rank sent plus received, and seconds spent, in some collectives."""

    nbytes: int = 0
    seconds: float = 0.0


class MeasuredCollective:
    """The collective a compressor was handed, with its blocking calls counted in
    ``traffic``: how a compressor that adapts to the link (``adaptive``) measures it,
    from its own exchanges and never from the global meter (which only observes).

    An all-reduce moves its tensor out and the sum back (2x its bytes); an all-gather
    moves this rank's tensor out and the others' in (the sum of every rank's part); an
    all-to-all moves the pieces for the other ranks out and theirs in (this rank's own
    piece stays: it is left out when the collective knows its ``rank`` or is one rank).
    Non-blocking twins (``*_async``) are not offered, so every call here is counted.
    """

    def __init__(self, collective: Collective) -> None:
        self._inner = collective
        self.world_size = collective.world_size
        self.traffic = LinkTraffic()
        if getattr(collective, "rank", None) is not None:
            self.rank = collective.rank
        if getattr(collective, "all_reduce_bor", None) is not None:
            self.all_reduce_bor = lambda tensors: self._reduce("all_reduce_bor", tensors)

    def _count(self, nbytes: int, start: float) -> None:
        self.traffic.nbytes += int(nbytes)
        self.traffic.seconds += time.perf_counter() - start

    def _reduce(self, name: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        start = time.perf_counter()
        out = getattr(self._inner, name)(tensors)
        self._count(2 * tensor_bytes(*tensors), start)
        return out

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._reduce("all_reduce_sum", tensors)

    def all_reduce_max(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._reduce("all_reduce_max", tensors)

    def all_gather(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        start = time.perf_counter()
        out = self._inner.all_gather(tensors)
        self._count(sum(tensor_bytes(*parts) for parts in out), start)
        return out

    def all_to_all(self, sends: list[torch.Tensor]) -> list[torch.Tensor]:
        start = time.perf_counter()
        out = self._inner.all_to_all(sends)
        own = getattr(self, "rank", 0 if self.world_size == 1 else None)
        moved = [tensor_bytes(s, r) for j, (s, r) in enumerate(zip(sends, out)) if j != own]
        self._count(sum(moved), start)
        return out


class Compressor(ABC):
    """Base class. Subclasses set ``name`` and ``aggregation`` and implement the codec.

    Args:
        min_numel: tensors with fewer elements travel dense at the attach points
            (``None``: :data:`DEFAULT_MIN_NUMEL`).
        memory: keep residual error feedback at the attach points (``None``: the class's
            ``default_memory``).
    """

    name: ClassVar[str] = ""
    aggregation: ClassVar[Aggregation] = "allreduce"
    default_memory: ClassVar[bool] = False
    #: False when the compressor keeps its own residual (DGC), so error feedback on top
    #: of it would count the dropped mass twice.
    allows_memory: ClassVar[bool] = True
    #: collectives one exchange of a tensor makes in sequence (PowerSGD: P then Q; csc:
    #: scores then chunks); the SeCoPa planner charges each its start-up latency.
    exchange_rounds: ClassVar[int] = 1
    #: per-tensor ``state`` entries that are this worker's own accumulation of its gradients
    #: (error feedback kept inside the compressor: DGC's u and v), not the same on every
    #: rank; a worker that joins a running training (``ft=torchft``) starts them empty, as
    #: it starts the attach point's residual memory, instead of counting a peer's twice.
    worker_state: ClassVar[tuple[str, ...]] = ()
    #: the parameter a compression search varies (cli/search.py): ``ratio`` (log-uniform in
    #: ``search.ratio``), ``rank`` (one of ``search.ranks``), ``levels`` (one of
    #: ``search.levels``); None: the search varies nothing of it
    search_knob: ClassVar[str | None] = None
    #: True for a codec only a pipeline strategy applies (Optimus-CC: strategy=pipeline_3d
    #: reads its settings): no search chooses it, and the attach points' ``min_numel`` rule
    #: does not describe where it engages
    pipeline_only: ClassVar[bool] = False
    #: True for a codec that runs once over the flat buffer of a whole exchange
    #: (``compress_segments(flat, segments, state)``, :mod:`~easgd_lightning.hooks.
    #: compressors.segments`), each tensor keeping its own rule: the attach points then make
    #: one codec call and one message per exchange (:mod:`easgd_lightning.hooks._fused`);
    #: a multi-round codec writes ``rounds_segments`` instead (one collective per round)
    fused_segments: ClassVar[bool] = False

    def compress_segments(self, flat: torch.Tensor, segments, state: dict) -> Payload:
        """One payload for every segment of the 1-D ``flat`` (a codec with
        ``fused_segments``), each encoded by the codec's per-tensor rule; the residual may
        be written in place when ``flat`` was offered (as :meth:`compress`)."""
        raise NotImplementedError(f"{self.name}: no fused exchange")

    def local_segments(self, payload: Payload, segments, state: dict) -> torch.Tensor:
        """This rank's transmitted buffer (1-D, ``segments.numel`` entries, zeros outside
        the segments) decoded from :meth:`compress_segments`' ``payload``; it may be a
        scratch buffer of ``state``, valid until the next exchange."""
        raise NotImplementedError(f"{self.name}: no fused exchange")

    def mean_segments(self, received, meta: dict, segments, out: torch.Tensor, world: int) -> None:
        """``out``'s segments <- the mean over ranks of the payloads: ``received`` is, for
        ``aggregation = "allgather"``, each rank's payload tensors in rank order, and for
        ``"allreduce"`` the summed payload tensors; ``meta`` is this rank's payload meta.
        The entries of ``out`` outside the segments may be overwritten."""
        raise NotImplementedError(f"{self.name}: no fused exchange")

    def finish_segments(self, out: torch.Tensor, segments, state: dict) -> None:  # noqa: B027
        """After :meth:`mean_segments`: a rule that acts on the mean over ranks (sparse_gc's
        global momentum and local update) turns ``out``'s segments into what the attach
        point hands on; nothing by default."""

    def __init__(self, *, min_numel: int | None = None, memory: bool | None = None) -> None:
        self.min_numel = DEFAULT_MIN_NUMEL if min_numel is None else check_int("compression.min_numel", min_numel, 0)
        if memory is None:
            memory = self.default_memory
        check_bool("compression.memory", memory)
        if memory and not self.allows_memory:
            raise ValueError(self.memory_error())
        self.memory = memory

    def memory_error(self) -> str:
        """The error for residual memory requested on a compressor that keeps its own."""
        return (
            f"compression.memory must be false for {self.name}: it keeps its own residual "
            "(error feedback on top would count the dropped entries twice)"
        )

    @abstractmethod
    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        """Encode ``tensor`` (any shape). ``state`` persists across calls for this tensor."""

    @abstractmethod
    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        """Decode a payload (possibly summed over ranks) into a dense tensor of ``shape``."""

    def state_dict(self) -> dict:
        """Compressor-wide state that a resume must restore (tensors and plain data), beside
        the per-tensor ``state`` dicts the attach points checkpoint; none by default."""
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 - a no-op unless overridden
        """Restore what :meth:`state_dict` returned."""

    def payload_bytes(self, payload: Payload) -> int:
        """Bytes that travel for this payload."""
        return tensor_bytes(*payload.tensors)

    def aggregate(
        self, tensor: torch.Tensor, state: dict, collective: Collective
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exchange ``tensor``; return (mean over ranks, this rank's decompressed part)."""
        local, finish = self._launch(tensor, state, collective)
        return finish(), local

    def start_aggregate(
        self, tensor: torch.Tensor, state: dict, collective: Collective
    ) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """:meth:`aggregate` in two halves: compress, decode this rank's part and launch the
        collective now (non-blocking where the collective can); returns (this rank's part,
        ``finish``), and ``finish()`` waits and returns the mean over ranks.

        Multi-round schemes that override :meth:`aggregate` run it whole here."""
        if type(self).aggregate is not Compressor.aggregate:
            mean, local = self.aggregate(tensor, state, collective)
            return local, lambda: mean
        return self._launch(tensor, state, collective)

    def _launch(
        self, tensor: torch.Tensor, state: dict, collective: Collective
    ) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """The one-collective exchange of :meth:`start_aggregate`: summed payloads decoded
        once (``allreduce``) or every rank's payload decoded and added (``allgather``)."""
        shape = tensor.shape
        n, dt, dev = tensor.numel(), tensor.dtype, tensor.device
        payload = self.compress(tensor, state)
        meta = payload.meta
        local = self.decompress(Payload(payload.tensors, with_out(meta, state, "local", n, dt, dev)), shape)
        world = collective.world_size
        if self.aggregation == "allreduce":
            pending = start_collective(collective, "all_reduce_sum", list(payload.tensors))
        else:
            pending = start_collective(collective, "all_gather", list(payload.tensors))

        def finish() -> torch.Tensor:
            if self.aggregation == "allreduce":
                total = self.decompress(
                    Payload(tuple(pending.wait()), with_out(meta, state, "total", n, dt, dev)), shape
                )
            else:
                total = dense_out(with_out(meta, state, "total", n, dt, dev), n, dt, dev).view(shape)
                part_meta = with_out(meta, state, "part", n, dt, dev)
                for rank_tensors in pending.wait():
                    total += self.decompress(Payload(tuple(rank_tensors), part_meta), shape).to(dt)
            return mean_of(total, dt, world, state)

        return local.to(dt), finish

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


# ----------------------------------------------------------------------------- helpers


class _Done:
    """A blocking collective's result, in the shape of a pending one."""

    def __init__(self, value) -> None:
        self._value = value

    def wait(self):
        return self._value


def run_rounds(rounds):
    """Drive an ``aggregate_rounds`` generator (it yields after each non-blocking launch)
    to its end at once; returns what it returns (mean, local)."""
    while True:
        try:
            next(rounds)
        except StopIteration as done:
            return done.value


#: the methods that state a codec's rule for one tensor, and those of its fused form
_PER_TENSOR_RULE = ("compress", "decompress", "select", "select_values", "aggregate", "_launch")
_FUSED_RULE = ("compress_segments", "select_segments", "local_segments", "mean_segments")


def has_fused_form(compressor) -> bool:
    """Whether ``compressor`` runs the fused exchange: it says ``fused_segments`` and no
    method of its per-tensor rule is overridden below the class that wrote its fused form
    (a subclass that changes ``compress`` or ``select_values`` -- a user's own codec under a
    shipped one, unless it writes its own fused form as SparseLoCo does under top-k -- would otherwise be bypassed by its parent's
    ``compress_segments`` and send the parent's payload). A ``select_segments`` marked
    ``follows_select_values`` (the sparse base's loop: each segment through the codec's own
    :meth:`select_values`) bypasses no selection rule, so overriding ``select`` /
    ``select_values`` does not count against it."""
    if not getattr(compressor, "fused_segments", False):
        return False
    rule = _PER_TENSOR_RULE
    if getattr(getattr(type(compressor), "select_segments", None), "follows_select_values", False):
        rule = tuple(n for n in rule if n not in ("select", "select_values"))
    return defining_depth(compressor, _FUSED_RULE) <= defining_depth(compressor, rule)


def defining_depth(compressor, names) -> int:
    """How far up ``compressor``'s class chain the nearest class defining one of ``names``
    is (0: its own class; the chain's length: none does)."""
    mro = type(compressor).__mro__
    return min((i for i, c in enumerate(mro) for n in names if n in vars(c)), default=len(mro))


def start_collective(collective: Collective, name: str, tensors: list[torch.Tensor]):
    """Launch ``collective.<name>(tensors)`` without waiting when the collective has a
    ``<name>_async`` twin; returns a handle whose ``wait()`` gives the result."""
    launch = getattr(collective, f"{name}_async", None)
    if launch is not None:
        return launch(tensors)
    return _Done(getattr(collective, name)(tensors))


def mean_of(total: torch.Tensor, dtype: torch.dtype, world: int, state: dict | None) -> torch.Tensor:
    """``total / world`` as ``dtype`` (into the ``mean`` scratch buffer of ``state`` when
    ``total`` has that dtype already)."""
    if state is None or total.dtype != dtype:
        return total.to(dtype) / world
    mean = scratch_buffer(scratch_of(state), "mean", total.numel(), total.dtype, total.device)
    return torch.div(total.reshape(-1), world, out=mean).view(total.shape)

_OFFER = "_easgd_residual_offer"  # attribute on an offered tensor: 1 offered, 2 written


def offer_residual(t: torch.Tensor) -> None:
    """Mark ``t`` (a memory-owned compensated buffer) as writable with its residual."""
    setattr(t, _OFFER, 1)


def may_write_residual(t: torch.Tensor) -> bool:
    """Whether ``t`` was offered and not yet written."""
    return getattr(t, _OFFER, 0) == 1


def residual_written(t: torch.Tensor) -> None:
    """A compressor overwrote the offered ``t`` with t - decompress(its payload)."""
    if getattr(t, _OFFER, 0) == 1:
        setattr(t, _OFFER, 2)


def take_residual_written(t: torch.Tensor) -> bool:
    """Whether ``t`` holds its residual already; clears the mark either way."""
    flag = getattr(t, _OFFER, 0)
    if flag:
        setattr(t, _OFFER, 0)
    return flag == 2


_WANT_LOCAL = "want_local"  # scratch flag: the caller reads this rank's part of the tensor


def want_local(state: dict, wanted: bool) -> None:
    """Say whether the caller of the next exchange of ``state``'s tensor reads this rank's
    decompressed part (the exchange's ``locals``); kept in the scratch (not checkpointed)."""
    scratch_of(state)[_WANT_LOCAL] = bool(wanted)


def wants_local(state: dict) -> bool:
    """Whether this rank's decompressed part must be returned (yes unless the exchange said
    otherwise: a direct ``aggregate`` caller always gets it). When it need not be and the
    residual memory offered the compensated buffer, a codec whose local part is a full-size
    product (PowerSGD, ACP-SGD) writes the residual in place and returns None for it."""
    scratch = state.get("_scratch")
    return bool(scratch is None or scratch.get(_WANT_LOCAL, True))


def scratch_of(state: dict) -> dict:
    """The per-tensor scratch dict ``state["_scratch"]`` (created on first use)."""
    scratch = state.get("_scratch")
    if scratch is None:
        scratch = state["_scratch"] = {}
    return scratch


def scratch_buffer(
    scratch: dict | None, slot: str, numel: int, dtype: torch.dtype, device
) -> torch.Tensor:
    """A reusable 1-D buffer of at least ``numel`` elements from ``scratch[slot]`` (first
    ``numel`` returned; contents undefined); a fresh one when ``scratch`` is None."""
    if scratch is None:
        return torch.empty(numel, dtype=dtype, device=device)
    buf = scratch.get(slot)
    if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != torch.device(device):
        buf = scratch[slot] = torch.empty(max(numel, 1), dtype=dtype, device=device)
    return buf[:numel]


def with_out(meta: dict, state: dict | None, slot: str, numel: int, dtype, device) -> dict:
    """``meta`` plus ``"out"``: the scratch buffer ``slot`` of ``state`` that a decode writes
    into (several live outputs of one exchange -- local part, total, per-rank parts -- use
    different slots); ``meta`` itself when ``state`` is None."""
    if state is None:
        return meta
    scratch = scratch_of(state)
    record = scratch.setdefault(f"{slot}:record", {})
    return dict(meta, out=scratch_buffer(scratch, slot, numel, dtype, device), out_record=record)


def sparse_out(meta: dict, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed dense output for a sparse decode. When ``meta["out"]`` still holds the
    previous sparse decode untouched (same storage, same version counter: no in-place op
    since), only the entries that decode wrote are cleared instead of the whole buffer."""
    out = meta.get("out")
    record = meta.get("out_record")
    if out is None or record is None or out.numel() != numel or out.dtype != dtype:
        return dense_out(meta, numel, dtype, device)
    out = out.reshape(-1)
    if (
        record.get("ptr") == out.data_ptr()
        and record.get("numel") == numel
        and record.get("version") == out._version
        and "idx" in record
    ):
        from easgd_lightning.hooks.compressors import _native

        return _native.zero_at(out, record["idx"])
    return out.zero_()


def record_sparse(meta: dict, out: torch.Tensor, idx: torch.Tensor) -> None:
    """Note that ``out`` (from :func:`sparse_out`) is zero outside ``idx``."""
    record = meta.get("out_record")
    if record is None or meta.get("out") is None or out.data_ptr() != meta["out"].data_ptr():
        return
    record.update(ptr=out.data_ptr(), numel=out.numel(), version=out._version,
                  idx=idx.to(device=out.device, dtype=torch.int64).reshape(-1).clone())


def dense_out(meta: dict, numel: int, dtype: torch.dtype, device, *, zero: bool = True) -> torch.Tensor:
    """The dense 1-D output of a decode: the caller's buffer ``meta["out"]`` when it is there
    (zeroed if ``zero``), else a new tensor."""
    out = meta.get("out")
    if out is None or out.numel() != numel or out.dtype != dtype:
        return torch.zeros(numel, dtype=dtype, device=device) if zero else torch.empty(
            numel, dtype=dtype, device=device)
    out = out.reshape(-1)
    return out.zero_() if zero else out


def num_selected(numel: int, ratio: float) -> int:
    """k = ceil(ratio * numel) clamped to [1, numel] (0 for an empty tensor)."""
    if numel <= 0:
        return 0
    k = math.ceil(ratio * numel - 1e-9)
    return max(1, min(numel, k))


def index_dtype_for(numel: int) -> torch.dtype:
    """int32 indices when they fit (honest 4-byte indices), int64 otherwise."""
    return torch.int32 if numel < 2**31 else torch.int64


def pack_sparse(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One uint8 message: the value bytes then the index bytes (one all-gather, not two).

    ``indices`` and ``values`` are 1-D of equal length; bytes = nnz * (index + value size).
    """
    return torch.cat(
        [values.contiguous().view(torch.uint8), indices.contiguous().view(torch.uint8)]
    )


def _view_bytes(chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty((), dtype=dtype).element_size()
    if chunk.storage_offset() % size:
        chunk = chunk.clone()  # realign (e.g. 2-byte values before 4-byte indices)
    return chunk.view(dtype)


def unpack_sparse(
    buf: torch.Tensor, index_dtype: torch.dtype, value_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_sparse`; returns (indices, values). nnz = len / (isz + vsz)."""
    isz = torch.empty((), dtype=index_dtype).element_size()
    vsz = torch.empty((), dtype=value_dtype).element_size()
    if buf.numel() % (isz + vsz):
        raise ValueError(
            f"sparse message of {buf.numel()} bytes is not a multiple of {isz + vsz}"
        )
    nnz = buf.numel() // (isz + vsz)
    buf = buf.contiguous()
    val = _view_bytes(buf[: nnz * vsz], value_dtype)
    idx = _view_bytes(buf[nnz * vsz :], index_dtype)
    return idx, val


_BIT_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = _BIT_WEIGHTS[device] = (2 ** torch.arange(8, device=device)).to(torch.uint8)
    return w


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a 1-D bool tensor into uint8, 8 entries per byte (little-endian bit order)."""
    n = bits.numel()
    pad = (-n) % 8
    b = bits.reshape(-1).to(torch.uint8)
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    return (b.view(-1, 8) * _bit_weights(b.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` bits as a bool tensor."""
    w = _bit_weights(packed.device)
    return ((packed.view(-1, 1) & w) != 0).view(-1)[:numel]
