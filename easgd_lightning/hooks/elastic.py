"""Exchange of elastic differences (EASGD, local SGD), optionally compressed.

``exchange_sum(diff, ...)`` returns sum_i diff_i over ranks. Uncompressed it is one
all-reduce of the flat buffer ("single-layer communication", You et al. SC17). With a
compressor, every rank compresses its error-compensated difference
p_i = d_i + e_i (e_i in ``memory``), the exchange returns sum_i C(p_i) (decompressed) and
keeps e_i <- p_i - C(p_i). Pass ``shapes`` (the parameters' shapes, in flat order) to
compress per parameter: tensors under ``compressor.min_numel`` then travel dense in one
message, and matrix compressors (PowerSGD) see matrices instead of one flat vector.
Metered under ``kind`` (default ``elastic``): bytes sent = the payload, dense bytes = the
flat buffer.

Lazy all-reduce (GradientFlow; ``comm.fusion_mb``, :mod:`easgd_lightning.comm.fusion`):
with ``layout`` (a :class:`~easgd_lightning.comm.layout.CommLayout`) and ``shapes``, the
dense flat buffer travels as buckets of whole tensors of at least ``fusion_mb`` (views of
``diff``, summed in place; hierarchically with ``comm.hierarchy=node``), and the
compressed path fuses the one-round all-reduce payloads of its tensors the same way
(:meth:`~easgd_lightning.hooks.collective.ProcessGroupCollective.fused`). Without a
layout the dense buffer is one message.

``start_exchange_sum`` is the same exchange without waiting: it returns a
:class:`PendingSum` whose ``wait()`` gives the sum (Sync EASGD's overlap). Uncompressed it
is a non-blocking all-reduce in place on ``diff`` (leave ``diff`` alone until ``wait``);
compressed, :func:`~easgd_lightning.hooks._exchange.start_exchange_tensors` compresses
and updates the residual at once and waits, decompresses and sums in ``wait``; a codec
that runs over whole buffers (``fused_segments``: top-k, DGC, EF-signSGD, random-k, QSGD,
fp16 / bf16, Sparse GC, RedSync, SIDCo, SparseLoCo, ACP-SGD, GComp, adaptive, PowerSGD, csc, sketch, LGC, two-way) exchanges ``diff`` as one
flat buffer instead (:mod:`easgd_lightning.hooks._fused`: one codec call, one message,
the same numbers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from easgd_lightning.comm import ops
from easgd_lightning.comm.layout import CommLayout
from easgd_lightning.hooks._exchange import start_exchange_tensors
from easgd_lightning.hooks._fused import fusable, layout_for, start_exchange_flat
from easgd_lightning.hooks.collective import ProcessGroupCollective
from easgd_lightning.hooks.compressors.base import scratch_buffer, scratch_of
from easgd_lightning.hooks.compressors.none import NoneCompressor
from easgd_lightning.hooks.memory import ResidualMemory, make_memory

__all__ = [
    "exchange_sum",
    "start_exchange_sum",
    "PendingSum",
    "check_exchange_compressor",
    "bind_exchange_compressor",
]


def check_exchange_compressor(compressor, strategy: str) -> None:
    """Refuse a compressor whose rule is for gradients only (``gradients_only``: e.g. SGC's
    skipped aggregation, where each rank keeps its own value) for an exchange of elastic or
    parameter differences, which must reach every rank's center alike.

    Raises:
        ValueError: one line naming the compressor, the strategy and what is allowed.
    """
    if compressor is not None and getattr(compressor, "gradients_only", False):
        name = getattr(compressor, "name", type(compressor).__name__)
        raise ValueError(
            f"compression={name} applies to gradients only (strategy=ddp): strategy={strategy} "
            f"exchanges differences that every rank's center must receive alike; use strategy=ddp "
            f"with compression={name}, or another compressor with strategy={strategy}"
        )


def bind_exchange_compressor(compressor, steps_per_epoch: int | None, step_of=None) -> list[str]:
    """Tell ``compressor`` it serves an elastic exchange (its ``bind_exchange``, when it has
    one: DGC turns its gradient rules off and counts its warm-up in ``step_of()``, the
    0-based optimizer step, with ``steps_per_epoch`` for ``warmup_ratio_epochs``). Returns
    the warnings to log."""
    bind = getattr(compressor, "bind_exchange", None)
    return list(bind(steps_per_epoch, step_of)) if callable(bind) else []


def _memory_for(compressor, memory, state: dict | None):
    """The error-feedback memory to use (kept in ``state`` when not given)."""
    if state is None:
        raise ValueError(
            "exchange_sum with a compressor needs a persistent `state` dict (one per buffer)"
        )
    if memory is None:
        memory = state.get("_memory")
        if memory is None:
            memory = state["_memory"] = make_memory(compressor)
    if isinstance(memory, ResidualMemory) and not compressor.allows_memory:
        raise ValueError(compressor.memory_error())
    return memory


def _pieces(diff: torch.Tensor, shapes: list | None, key: str, scratch: dict | None = None):
    """``diff`` cut into per-parameter views (with ``shapes``) and their state keys; the
    views are kept in ``scratch`` and reused while ``diff`` is the same buffer."""
    flat = diff.reshape(-1)
    if not shapes:
        return [flat], [key]
    # the cached views hold the buffer they view, so an equal address is the same buffer
    ident = (diff.data_ptr(), diff.numel(), diff.dtype, key, tuple(tuple(s) for s in shapes))
    cached = scratch.get("pieces") if scratch is not None else None
    if cached is not None and cached[0] == ident:
        return cached[1], cached[2]
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    if sum(sizes) != flat.numel():
        raise ValueError(
            f"exchange_sum: shapes cover {sum(sizes)} elements, diff has {flat.numel()}"
        )
    pieces = [p.view(torch.Size(s)) for p, s in zip(torch.split(flat, sizes), shapes)]
    keys = [f"{key}.{i}" for i in range(len(pieces))]
    if scratch is not None:
        scratch["pieces"] = (ident, pieces, keys)
    return pieces, keys


def _collective_for(state: dict, group, kind: str, fusion_bytes: int | None) -> ProcessGroupCollective:
    """The collective of ``state``'s exchanges, kept in its scratch so that the message
    capacities of its all-gathers persist from one exchange to the next."""
    scratch = scratch_of(state)
    coll = scratch.get("collective")
    if coll is None or coll.group is not group or coll.kind != kind or coll.fusion_bytes != fusion_bytes:
        coll = scratch["collective"] = ProcessGroupCollective(group, kind=kind, fusion_bytes=fusion_bytes)
    return coll


class PendingSum:
    """A sum over ranks in flight; :meth:`wait` returns it (once). ``local`` is this rank's
    transmitted part when it was asked for (else None; a multi-round codec's is set by
    :meth:`wait`)."""

    def __init__(self, finish, local: torch.Tensor | None = None) -> None:
        self._finish = finish
        self.local = local

    def wait(self) -> torch.Tensor:
        return self._finish()


def start_exchange_sum(
    diff: torch.Tensor,
    *,
    compressor=None,
    memory=None,
    state: dict | None = None,
    group: dist.ProcessGroup | None = None,
    kind: str = "elastic",
    key: str = "flat",
    shapes: list | None = None,
    keep_local: bool = False,
    layout: CommLayout | None = None,
) -> PendingSum:
    """Start summing ``diff`` over the ranks of ``group``; arguments as :func:`exchange_sum`
    (``keep_local``: set ``PendingSum.local``, this rank's transmitted part).

    Uncompressed, the sum is formed in place in ``diff`` (do not touch it before
    ``wait()``); compressed, ``diff`` is read now and ``wait()`` returns a buffer of
    ``state`` (valid until the next exchange of ``key`` with that state).
    """
    if compressor is None or isinstance(compressor, NoneCompressor):
        local = diff.clone() if keep_local else None
        if layout is None:
            fut = ops.all_reduce_async(diff, kind=kind, group=group)
        else:
            numels = None if shapes is None else [int(torch.Size(s).numel()) for s in shapes]
            fut = layout.all_reduce_flat_async(diff, numels, kind=kind, group=group)
        return PendingSum(lambda: (ops.wait(fut, kind=kind), diff)[1], local)
    memory = _memory_for(compressor, memory, state)
    pieces, keys = _pieces(diff, shapes, key, scratch_of(state))
    collective = _collective_for(state, group, kind, None if layout is None else layout.fusion_bytes)
    if fusable(compressor, collective) and diff.is_contiguous():
        return _start_fused_sum(diff, pieces, keys, compressor, memory, state, collective, key, keep_local)
    pending = start_exchange_tensors(pieces, keys, compressor, memory, state, collective, want_locals=keep_local)
    ready = keep_local and all(m is not None for m in pending.locals)  # multi-round codecs: at finish
    local = torch.cat([m.reshape(-1) for m in pending.locals]).view_as(diff) if ready else None

    def finish() -> torch.Tensor:
        means, mine, _ = pending.finish()
        if keep_local and result.local is None:
            result.local = torch.cat([m.reshape(-1) for m in mine]).view_as(diff)
        out = scratch_buffer(scratch_of(state), f"{key}.sum", diff.numel(), diff.dtype, diff.device)
        world, offset = collective.world_size, 0
        for m in means:  # sum = mean * world, written piece by piece (one pass, no concatenation)
            k = m.numel()
            torch.mul(m.reshape(-1), world, out=out[offset : offset + k])
            offset += k
        return out.view_as(diff)

    result = PendingSum(finish, local)
    return result


def _start_fused_sum(diff, pieces, keys, compressor, memory, state, collective, key, keep_local) -> PendingSum:
    """:func:`start_exchange_sum` over ``diff`` as one flat buffer
    (:func:`~easgd_lightning.hooks._fused.start_exchange_flat`); the sum is the mean times
    the world size, as the per-tensor path forms it. A multi-round codec's local part is
    known at the finish (PowerSGD's Q round), as on the per-tensor path."""
    layout = layout_for(state, [p.shape for p in pieces], keys, compressor.min_numel)
    pending = start_exchange_flat(diff.reshape(-1), layout, compressor, memory, state, collective, want_local=keep_local)
    world = collective.world_size

    def finish() -> torch.Tensor:
        mean, mine, _ = pending.finish()
        if keep_local and result.local is None:
            result.local = mine.clone().view_as(diff)
        out = scratch_buffer(scratch_of(state), f"{key}.sum", diff.numel(), diff.dtype, diff.device)
        return torch.mul(mean, world, out=out).view_as(diff)

    result = PendingSum(finish, None if pending.local is None else pending.local.clone().view_as(diff))
    return result


def exchange_sum(diff: torch.Tensor, *, return_local: bool = False, **options):
    """Sum ``diff`` over the ranks of ``group`` (in place when uncompressed):
    :func:`start_exchange_sum` waited for at once.

    Args (keyword ``options`` other than ``return_local`` are :func:`start_exchange_sum`'s):
        diff: this rank's flat difference.
        compressor: a compressor or None (``none`` is the dense path too).
        memory: error-feedback memory; None: one kept in ``state`` per
            ``compressor.memory`` (:func:`easgd_lightning.hooks.memory.make_memory`).
        state: a dict that persists across calls (required with a compressor): per-tensor
            compressor state (and the default memory) live in it.
        group: process group; kind: meter traffic class; key: state key prefix.
        shapes: optional parameter shapes partitioning ``diff`` (compress per parameter;
            the tensors of the lazy all-reduce buckets).
        layout: the ``comm`` layout (fusion, hierarchy); None: one dense message.
        return_local: also return this rank's transmitted (decompressed) part, so the
            caller can apply exactly what was sent.

    Returns:
        The sum over ranks (compressed: a buffer of ``state``, valid until the next
        exchange of ``key``), or ``(sum, local)`` with ``return_local``.
    """
    pending = start_exchange_sum(diff, keep_local=return_local, **options)
    total = pending.wait()
    return (total, pending.local) if return_local else total
