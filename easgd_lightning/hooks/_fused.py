"""One fused exchange per step: one codec call over one flat buffer, one message.

The exchange of a flat buffer (DDP's bucket, which DDP's gradients are views of; the
elastic difference of ``sync_easgd`` / ``local_sgd``) cut into tensors of known shapes:

* the tensors under ``min_numel`` elements travel dense: their runs of the buffer are
  copied into one message (DGC's ``dense_part`` -- its momentum -- applied to it as a
  whole: the rule is element-wise);
* the others are the :class:`~easgd_lightning.hooks.compressors.segments.Segments` of the
  buffer: the memory compensates them in one buffer of the flat size
  (:meth:`~easgd_lightning.hooks.memory.Memory.compensate_runs`, one residual for the
  exchange) and the codec compresses all of them in one call
  (``compressor.compress_segments``: the rule still per tensor where the paper defines it
  per layer -- top-k's sample and threshold, DGC's k = ceil(ratio * n) and rounds,
  EF-signSGD's scale, random-k's seeded draw, QSGD's buckets and noise --, computed per
  segment inside one native kernel), giving one payload for the buffer;
* all-gather codecs: the dense message and the payload are one all-gather (one message
  per rank, as the per-tensor path's batched gather); at the end the codec adds every
  rank's payload in rank order into the output (``compressor.mean_segments``; DDP: the
  bucket itself, no copy back) and divides by the world size (a rule that acts on that
  mean -- sparse_gc's global momentum -- follows in ``compressor.finish_segments``), and
  the dense runs get the rank-order sum of the dense messages over the world size;
* all-reduce codecs (random-k, fp16 / bf16): the payload is summed by one all-reduce and
  decoded once; the dense message is still all-gathered and summed in rank order;
* multi-round codecs, whose exchange needs an agreement or several collectives (``powersgd``:
  every P, then every Q; ``csc``: every tensor's chunk scores, then its chosen chunks;
  ``sketch``: every bitmap's OR, then every count sketch's sum; ``sgc``:
  every tensor's summary, then the tensors that aggregate; ``adaptive``: the density vote,
  then the payload): ``compressor.rounds_segments(p, segments, state, collective, out)`` is
  a generator with the protocol of the per-tensor ``aggregate_rounds`` -- it launches a
  non-blocking collective, yields, waits for it when advanced again -- over all the
  segments at once, writes their mean into ``out`` and returns this rank's transmitted
  buffer (None unless the state's ``want_local`` flag asks for it:
  :func:`~easgd_lightning.hooks.compressors.base.wants_local`). Its first round runs at the
  launch and the others at :meth:`PendingFlat.finish`, where the residual is updated (at
  the launch when its rounds end there: adaptive's calls are blocking, measured); it reads
  a private copy of the buffer when the memory hands back the caller's own. The dense
  message is all-gathered at the launch and summed in rank order -- with lazy all-reduce
  buffers (``comm.fusion_mb``) it rides the first round's buffer instead, summed, as on the
  per-tensor path.

Every number is the one the per-tensor exchange (:mod:`easgd_lightning.hooks._exchange`)
computes for each tensor alone (the unit and distributed tests compare them bitwise), so
the fused path is a change of speed only (an all-reduce codec's sum over more than two
ranks may round differently: a ring sums in an order of its own; ``adaptive`` proposes its
density once per exchange: see its module). It applies where ``compressor.fused_segments``
is true (``topk``, ``dgc``, ``signsgd``, ``randomk``, ``qsgd`` (s <= 32767), ``fp16``,
``bf16``, ``sparse_gc``, ``redsync``, ``sidco``, ``sparseloco``, ``acpsgd``, ``gcomp``; in the multi-round form,
:func:`has_fused_rounds`: ``sgc``, ``adaptive``, ``powersgd``, ``csc``, ``sketch``, ``lgc``, two-way
compression over a codec with a fused form), with no SeCoPa
plan and a collective that batches its all-gathers (:class:`~easgd_lightning.hooks.collective.
ProcessGroupCollective`); every other codec takes the per-tensor exchange.

State: the codec's per-exchange state (DGC's u and v, one flat buffer each, and its step
counter) lives under the exchange's group key (:attr:`FlatLayout.group`) in the attach
point's ``states`` (a rule with state of each tensor's own -- SIDCo's stages, RedSync's
reused threshold, SGC's skip counts, PowerSGD's and ACP-SGD's factors and steps, sketch's
and csc's steps -- keeps it per member: ``segment_states``); per-tensor entries of an older checkpoint (or of the per-tensor path)
are moved into it on first use (:func:`group_state`), and the residual memory does the
same for its residuals, whose checkpoint stays per tensor
(:class:`~easgd_lightning.hooks.memory.ResidualMemory`).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from easgd_lightning.hooks._exchange import ExchangeStats, _kind_totals, key_hash
from easgd_lightning.hooks.compressors.base import (
    _PER_TENSOR_RULE,
    defining_depth,
    has_fused_form,
    may_write_residual,
    scratch_buffer,
    scratch_of,
    start_collective,
)
from easgd_lightning.hooks.compressors.base import want_local as ask_local
from easgd_lightning.hooks.compressors.segments import SEGMENT_STATES, Segments, merged_runs

__all__ = [
    "FlatLayout", "PendingFlat", "fusable", "has_fused_rounds", "layout_for", "group_state", "start_exchange_flat",
]


class FlatLayout:
    """Where each tensor of an exchange's flat buffer lies and how it travels.

    Args:
        shapes: the tensors' shapes, in buffer order (they cover the buffer).
        keys: their state keys (parameter names; the same on every rank).
        limit: tensors with fewer elements travel dense.
    """

    def __init__(self, shapes, keys, limit: int) -> None:
        shapes = [torch.Size(s) for s in shapes]
        sizes = [s.numel() for s in shapes]
        offsets = [sum(sizes[:j]) for j in range(len(sizes))]
        self.numel = sum(sizes)
        dense = [j for j, n in enumerate(sizes) if n < limit]
        comp = [j for j, n in enumerate(sizes) if n >= limit]
        self.dense_count, self.comp_count = len(dense), len(comp)
        self.dense_runs = merged_runs([offsets[j] for j in dense], [sizes[j] for j in dense])
        self.comp_runs = merged_runs([offsets[j] for j in comp], [sizes[j] for j in comp])
        self.dense_numel = sum(sizes[j] for j in dense)
        self.segments = Segments([offsets[j] for j in comp], [sizes[j] for j in comp], self.numel,
                                 [key_hash(keys[j]) for j in comp], [shapes[j] for j in comp])
        tag = f"{key_hash('|'.join(map(str, keys))):08x}"
        self.group = f"fused:{keys[comp[0]]}..{keys[comp[-1]]}#{tag}" if comp else None
        self.dense_group = f"fused-dense:{keys[dense[0]]}..{keys[dense[-1]]}#{tag}" if dense else None
        #: (key, offset, shape) of each compressed tensor in the buffer
        self.members = tuple((keys[j], offsets[j], shapes[j]) for j in comp)
        pos = [sum(sizes[i] for i in dense[:q]) for q in range(len(dense))]
        #: (key, offset in the dense message, shape) of each dense tensor
        self.dense_members = tuple((keys[j], p, shapes[j]) for j, p in zip(dense, pos))


def layout_for(states: dict, shapes, keys, limit: int) -> FlatLayout:
    """The :class:`FlatLayout` of these tensors, kept in ``states``' scratch."""
    cache = scratch_of(states).setdefault("fused_layouts", {})
    ident = (tuple(keys), tuple(tuple(s) for s in shapes), int(limit))
    layout = cache.get(ident)
    if layout is None:
        layout = cache[ident] = FlatLayout(shapes, keys, limit)
    return layout


def has_fused_rounds(compressor) -> bool:
    """Whether ``compressor`` runs the fused exchange's multi-round form: it says
    ``fused_segments`` and defines ``rounds_segments`` in a class no further up than any
    method of its per-tensor rule (a subclass that changes ``aggregate`` or ``compress``
    takes the per-tensor path, as for :func:`~easgd_lightning.hooks.compressors.base.
    has_fused_form`)."""
    if not getattr(compressor, "fused_segments", False):
        return False
    return defining_depth(compressor, ("rounds_segments",)) <= defining_depth(compressor, _PER_TENSOR_RULE)


def fusable(compressor, collective, plan=None) -> bool:
    """Whether an exchange runs fused: a codec with a fused form (``fused_segments``, not
    overridden below it: :func:`~easgd_lightning.hooks.compressors.base.has_fused_form`, or
    its multi-round form, :func:`has_fused_rounds`), no SeCoPa plan, and
    a collective that batches all-gathers (the per-tensor path's one-message form)."""
    return (
        (has_fused_form(compressor) or has_fused_rounds(compressor))
        and plan is None
        and callable(getattr(collective, "batched", None))
    )


def _dissolve(states: dict, key: str) -> None:
    """Split the group ``key`` back into per-tensor states (copies of its members' parts;
    each member's own state, where the group kept one per member)."""
    st = states.pop(key)
    numel = st.get("numel")
    own = st.get(SEGMENT_STATES)
    for j, (mkey, off, n) in enumerate(st.get("members", ())):
        per = states.setdefault(mkey, {})
        if own is not None:
            per.update({k: v for k, v in own[j].items() if not k.startswith("_")})
        for name, val in st.items():
            if name in ("members", "numel", SEGMENT_STATES):
                continue
            if isinstance(val, torch.Tensor) and val.dim() > 0 and val.numel() == numel:
                per[name] = val[off : off + n].clone()
            else:
                per.setdefault(name, val)


def group_state(states: dict, key: str, members, numel: int, per_segment: bool = False) -> dict:
    """``states[key]``, the codec state of a group of tensors (its ``members``, as plain
    data: [key, offset, numel] each, for checkpoints). Created on first use from the
    members' per-tensor states -- a tensor entry of a member's size is placed at the
    member's offset of a flat one of ``numel`` entries (zeros elsewhere), other entries are
    taken from the first member that has them (``per_segment``: kept per member instead, in
    ``state["segment_states"][j]``, for a rule that carries state of its own per tensor), and
    the per-tensor states are removed -- after dissolving any other group that holds one of
    them (DDP rebuilds its buckets after the first iteration: the same parameters, other
    groups)."""
    st = states.get(key)
    if st is not None:
        return st
    names = {m[0] for m in members}
    for other in [k for k, v in states.items() if isinstance(v, dict) and "members" in v]:
        if names.intersection(m[0] for m in states[other]["members"]):
            _dissolve(states, other)
    st = states[key] = {"members": [[m, off, shape.numel()] for m, off, shape in members], "numel": numel}
    own = None
    if per_segment:
        own = st[SEGMENT_STATES] = [{} for _ in members]
    for j, (mkey, off, shape) in enumerate(members):
        old = states.get(mkey)
        if not isinstance(old, dict):
            continue
        n = shape.numel()
        for name, val in old.items():
            if name.startswith("_") or name in ("key_hash", "members", "numel"):
                continue
            if isinstance(val, torch.Tensor) and val.dim() > 0 and val.numel() == n:
                flat = st.get(name)
                if flat is None:
                    flat = st[name] = torch.zeros(numel, dtype=val.dtype, device=val.device)
                flat[off : off + n] = val.reshape(-1)
            elif own is not None:
                own[j][name] = val
            else:
                st.setdefault(name, val)
        del states[mkey]
    return st


class PendingFlat:
    """A fused exchange in flight; :meth:`finish` waits and returns (mean, local, stats):
    the mean over ranks as one flat buffer, this rank's transmitted buffer (None unless it
    was asked for; a multi-round codec's is known at finish unless its rounds ended at
    launch) and the exchange's :class:`~easgd_lightning.hooks._exchange.ExchangeStats`."""

    def __init__(self, collective, finish, local, stats: ExchangeStats, before: tuple, busy: float) -> None:
        self._collective, self._finish = collective, finish
        self.local, self.stats = local, stats
        self._before, self._busy_s = before, busy

    def finish(self) -> tuple[torch.Tensor, torch.Tensor | None, ExchangeStats]:
        start = time.perf_counter()
        mean, local = self._finish()
        if local is not None:
            self.local = local
        after = _kind_totals(self._collective.kind)
        st, b = self.stats, self._before
        st.bytes_sent, st.bytes_recv, st.dense_bytes = after[0] - b[0], after[1] - b[1], after[2] - b[2]
        st.comm_time_s = after[3] - b[3]
        busy = self._busy_s + time.perf_counter() - start
        st.codec_time_s = max(0.0, busy - (after[4] - b[4]))
        return mean, self.local, st


def _dense_message(flat, layout, compressor, states, world) -> torch.Tensor:
    """The dense runs of ``flat`` in one buffer, through the codec's ``dense_part``."""
    scratch = scratch_of(states)
    msg = scratch_buffer(scratch, f"dense:{layout.dense_group}", layout.dense_numel, flat.dtype, flat.device)
    pos = 0
    for off, n in layout.dense_runs:
        msg[pos : pos + n] = flat[off : off + n]
        pos += n
    dense_part = getattr(compressor, "dense_part", None)
    if callable(dense_part):
        st = group_state(states, layout.dense_group, layout.dense_members, layout.dense_numel)
        msg = dense_part(msg, st, world).reshape(-1)
    return msg


def _local(compressor, payload, gstate, layout, dense_msg, want: bool) -> torch.Tensor:
    """This rank's transmitted buffer: its payload decoded (and, when ``want``ed, its dense
    message in the dense runs)."""
    local = compressor.local_segments(payload, layout.segments, gstate)
    return _with_dense(local, layout, dense_msg) if want else local


def _with_dense(local: torch.Tensor, layout, dense_msg) -> torch.Tensor:
    """``local`` with this rank's dense message in its dense runs."""
    if dense_msg is not None:
        pos = 0
        for off, k in layout.dense_runs:
            local[off : off + k] = dense_msg[pos : pos + k]
            pos += k
    return local


def _advance(rounds) -> tuple[bool, object]:
    """Run a ``rounds_segments`` generator to its next yield: (False, None) while rounds
    remain, (True, what it returned) once it has ended."""
    try:
        next(rounds)
        return False, None
    except StopIteration as end:
        return True, end.value


def _mean_dense(total, rows, layout, world, scratch) -> None:
    """The dense runs of ``total`` <- the rank-order sum of the dense messages / world
    (``rows``: each rank's, or one row holding their all-reduced sum)."""
    summed = scratch_buffer(scratch, f"dense_sum:{layout.dense_group}", layout.dense_numel, total.dtype, total.device)
    summed.copy_(rows[0][0])
    for row in rows[1:]:
        summed.add_(row[0])
    summed /= world
    pos = 0
    for off, n in layout.dense_runs:
        total[off : off + n] = summed[pos : pos + n]
        pos += n


def start_exchange_flat(
    flat: torch.Tensor,
    layout: FlatLayout,
    compressor,
    memory,
    states: dict,
    collective,
    *,
    want_local: bool = False,
    out: torch.Tensor | None = None,
) -> PendingFlat:
    """Launch the fused exchange of the 1-D ``flat`` (module docstring): dense message,
    compensation, one codec call, residual update and one all-gather now; the mean at
    :meth:`PendingFlat.finish`, written into ``out`` when given (it may be ``flat`` itself:
    ``flat`` is only read here), else into a buffer of ``states`` (valid until the next
    exchange of this layout). ``want_local``: ``PendingFlat.local`` is this rank's
    transmitted buffer. A codec with ``rounds_segments`` runs its first round now and the
    others at finish, where its residual is updated (unless its rounds ended here)."""
    start = time.perf_counter()
    kind = collective.kind
    before = _kind_totals(kind)
    world = collective.world_size
    scratch = scratch_of(states)
    stats = ExchangeStats(compressed_tensors=layout.comp_count, dense_tensors=layout.dense_count)
    collective.charge_dense(flat.numel() * flat.element_size(), key=layout.group or layout.dense_group)
    dense_msg = _dense_message(flat, layout, compressor, states, world) if layout.dense_runs else None
    parts = [] if dense_msg is None else [dense_msg]
    total = out if out is not None else scratch_buffer(
        scratch, f"mean:{layout.group or layout.dense_group}", layout.numel, flat.dtype, flat.device)
    payload, local, gstate, rounds, p = None, None, None, None, None
    if layout.comp_count:
        gstate = group_state(states, layout.group, layout.members, layout.numel,
                             per_segment=getattr(compressor, "segment_state", False))
        gstate["world_size"] = world
        p = memory.compensate_runs(layout.group, flat, layout.comp_runs, layout.members)
        if has_fused_rounds(compressor):
            if p is flat:  # its later rounds read it at finish, when ``flat`` may have changed
                p = scratch_buffer(scratch, f"rounds_in:{layout.group}", flat.numel(), flat.dtype, flat.device)
                p.copy_(flat)
            ask_local(gstate, want_local or may_write_residual(p))  # the memory needs p - local
            rounds = compressor.rounds_segments(p, layout.segments, gstate, collective, total)
        else:
            ask_local(gstate, want_local)  # a codec may write the residual in place otherwise (ACP-SGD)
            payload = compressor.compress_segments(p, layout.segments, gstate)
            parts.extend(payload.tensors)
            if want_local or may_write_residual(p):  # the memory needs p - local
                local = _local(compressor, payload, gstate, layout, dense_msg, want_local)
            memory.update(layout.group, p, local)
    elif want_local:
        local = dense_msg.clone()
    reduce = payload is not None and compressor.aggregation == "allreduce"
    if reduce:  # the summed payload; the dense message still summed in rank order
        handle_p = start_collective(collective, "all_reduce_sum", list(payload.tensors))
        parts = parts[:1] if dense_msg is not None else []
    elif rounds is not None:  # the rounds carry the segments; the dense message is gathered
        parts = parts[:1] if dense_msg is not None else []
    # with lazy all-reduce buffers (comm.fusion_mb) the dense message rides the rounds' first
    # buffer, summed, as on the per-tensor path: one message fewer than a gather of its own
    lazy = rounds is not None and bool(parts) and getattr(collective, "fusion_bytes", None) is not None
    parts = [] if lazy else parts
    handle = start_collective(collective, "all_gather", parts) if parts else None
    ndense = 0 if dense_msg is None else 1

    def end_rounds(mine) -> torch.Tensor | None:
        """The rounds are over: residual update; this rank's buffer when it is wanted."""
        if want_local:
            mine = _with_dense(mine, layout, dense_msg)
        memory.update(layout.group, p, mine)
        return mine if want_local else None

    ended, handle_d = False, None
    if rounds is not None:
        with collective.fused() if lazy else nullcontext():
            handle_d = start_collective(collective, "all_reduce_sum", [dense_msg]) if lazy else None
            ended, mine = _advance(rounds)
        if ended:
            local = end_rounds(mine)

    def finish() -> tuple[torch.Tensor, torch.Tensor | None]:
        mine = None
        if rounds is not None and not ended:
            done = False
            while not done:
                done, mine = _advance(rounds)
            mine = end_rounds(mine)
        rows = handle.wait() if handle is not None else None
        if payload is not None:
            received = handle_p.wait() if reduce else [row[ndense:] for row in rows]
            compressor.mean_segments(received, payload.meta, layout.segments, total, world)
            compressor.finish_segments(total, layout.segments, gstate)
        if dense_msg is not None:
            _mean_dense(total, rows if handle_d is None else [handle_d.wait()], layout, world, scratch)
        return total, mine

    return PendingFlat(collective, finish, local, stats, before, time.perf_counter() - start)
