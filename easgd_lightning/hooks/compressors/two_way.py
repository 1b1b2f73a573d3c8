"""``compression.two_way: true``: compressed, error-compensated communication in both
directions (Zhong et al., 2021, for Adam-type optimizers), on a ring without a server.

Rule, p workers, any sparsifier or sign compressor C, per tensor and step. Shard j is
entries [j n / p, (j + 1) n / p) of the flattened tensor; rank j owns it.
  worker -> owners (a reduce-scatter of compressed shards):
                     p_i = g_i + e_i;  c_i^j = C(p_i[shard j]) for every j (the inner
                     compressor's own state per shard, ``state["up"][j]``);
                     e_i <- p_i - concat_j c_i^j  (over the whole tensor: the attach
                     point's residual memory, as for one-way compression); c_i^j goes to
                     owner j only (one all-to-all), and owner j forms its shard of the mean,
                     m_j = (1/p) sum_i c_i^j  (summed in rank order);
  owners -> workers: q_j = m_j + f_j;  d_j = C(q_j);  f_j <- q_j - d_j   (the second
                     residual, kept by the owner of the shard in a
                     :class:`~easgd_lightning.hooks.memory.ResidualMemory`); every d_j
                     is all-gathered and the result is the concatenation of d_0 .. d_{p-1}.
No dedicated server is needed. Nothing is lost in either direction: sum_t concat_j c_i^j +
e_i = sum_t g_i and sum_t d_j + f_j = sum_t m_j. The optimizer (Adam, AdamW) then gets the
doubly compressed mean. With the async parameter server (``async_sgd``, ``async_msgd``)
the server keeps f, one per worker: :mod:`easgd_lightning.strategies.ps.compressed`.

Bytes, per rank and step, C(n) the payload of the whole tensor: up, the pieces for the
other owners, about C(n) (p - 1) / p, and as many in (this rank's own piece never leaves
it); down, its shard's payload d_j, about C(n) / p, all-gathered. On a ring that is about
2 C(n) (p - 1) / p sent whatever p, where one-way compression's all-gather of whole
payloads receives (p - 1) C(n) (and forwards as much). The meter counts the logical
messages, as for every collective (:mod:`easgd_lightning.comm.meter`): sent = the pieces
for the other owners (each with an 8-byte length per payload tensor, :func:`pack_parts`)
plus d_j (with the all-gather's header); ``state["last_up_bytes"]`` and
``state["last_down_bytes"]`` are the same without the headers (C's ``payload_bytes``).
Fused exchange (:mod:`easgd_lightning.hooks._fused`, ``rounds_segments``, where C has a fused
form): the shards stay each tensor's own, and owner j's pieces of every tensor of the
exchange's buffer are encoded by ONE call of C's fused form (each piece its own rule and
key), so one all-to-all carries one piece per owner; the owner decodes and averages them
in one call, compensates its pieces with its second residual (one buffer, its pieces end to
end), encodes them in one call, and one all-gather brings every owner's payload back: the
numbers of the per-tensor exchange (its states, ``up`` / ``down`` / ``f`` per tensor, are
taken over from a per-tensor checkpoint). Should an owner hold no piece at all (every
tensor shorter than the world), the exchange runs per tensor.
"""

from __future__ import annotations

import zlib

import torch

from easgd_lightning.hooks.compressors.base import (
    Collective,
    Compressor,
    Payload,
    has_fused_form,
    scratch_buffer,
    scratch_of,
    wants_local,
)
from easgd_lightning.hooks.compressors.segments import SEGMENT_STATES, Segments
from easgd_lightning.hooks.memory import ResidualMemory

__all__ = ["TwoWayCompressor", "TWO_WAY_INNER", "shard_bounds", "pack_parts", "unpack_parts"]

#: compressors a two-way exchange can wrap: sparsifiers, sign and quantizers whose payload
#: decodes from itself (random-k's indices come from its own seed stream: not here). Their
#: payload meta is the same on every rank for a tensor of a given size (numel, dtype, index
#: dtype; the sparsifiers' nnz is not read by their decode), so an owner decodes every
#: rank's piece of its shard with the meta of its own piece.
TWO_WAY_INNER = ("gcomp", "qsgd", "redsync", "sidco", "signsgd", "topk")

_DOWN = "two_way:f"  # key of the second residual's memory (in the tensor's scratch)
_LENGTH = 8  # bytes of each payload tensor's length in a packed piece


def shard_bounds(numel: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of the shard ``rank`` owns: entries [r n / p, (r + 1) n / p)."""
    return rank * numel // world, (rank + 1) * numel // world


def collective_rank(collective: Collective) -> int:
    """This rank's index in the collective's group (0 when the world is one rank)."""
    rank = getattr(collective, "rank", None)
    if rank is not None:
        return int(rank)
    if collective.world_size == 1:
        return 0
    raise ValueError("compression.two_way needs a collective that knows its rank")


def pack_parts(tensors) -> torch.Tensor:
    """One uint8 message of a payload's tensors: their byte lengths (int64 each), then
    their bytes in order."""
    datas = [t.reshape(-1).contiguous().view(torch.uint8) for t in tensors]
    head = torch.tensor([d.numel() for d in datas], dtype=torch.int64, device=datas[0].device)
    return torch.cat([head.view(torch.uint8), *datas])


def _view_as(chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The uint8 ``chunk`` read as ``dtype`` (copied first when it is not aligned for it)."""
    if chunk.storage_offset() % dtype.itemsize:
        chunk = chunk.clone()
    return chunk.view(dtype)


def unpack_parts(message: torch.Tensor, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """Inverse of :func:`pack_parts`: the 1-D tensors, given their dtypes."""
    head = _LENGTH * len(dtypes)
    lengths = _view_as(message[:head], torch.int64).tolist()
    parts, offset = [], head
    for nbytes, dtype in zip(lengths, dtypes):
        parts.append(_view_as(message[offset : offset + nbytes], dtype))
        offset += nbytes
    return parts


def _shard_states(state: dict, world: int) -> list[dict]:
    """The inner compressor's state for each shard compressed on the way up,
    ``state["up"][j]`` (fresh ones when there are none for this world size), each with a
    ``key_hash`` of its own for seeded compressors."""
    ups = state.get("up")
    if not isinstance(ups, list) or len(ups) != world:
        base = int(state.get("key_hash", 0))
        ups = state["up"] = [
            {"key_hash": zlib.crc32(f"{base}:up{j}".encode()) & 0x7FFFFFFF} for j in range(world)
        ]
    return ups


def _second_residual(state: dict, shard: torch.Tensor) -> ResidualMemory:
    """The memory of the second residual f for ``state``'s tensor, holding ``state["f"]``
    (the checkpointed copy) when it fits ``shard``, else nothing. The memory itself is
    scratch (``state["_scratch"]``): it only reuses f's buffers from step to step."""
    scratch = scratch_of(state)
    memory = scratch.get(_DOWN)
    if memory is None:
        memory = scratch[_DOWN] = ResidualMemory()
    f = state.get("f")
    if f is not None and f.shape == shard.shape and f.dtype == shard.dtype:
        memory.adopt(_DOWN, f)
    else:
        memory.reset()
    return memory


def _local_meta(meta: dict) -> dict:
    """``meta`` without the caller's output buffer."""
    return {k: v for k, v in meta.items() if k not in ("out", "out_record")}


class TwoWayCompressor(Compressor):
    """Wraps ``inner`` so that each shard of the tensor travels compressed to its owner and
    the owner's mean comes back compressed again, with a second residual kept by the owner
    (see the module docstring)."""

    exchange_rounds = 3  # the pieces' lengths, the pieces (all-to-all), the owners' shards
    segment_state = True  # each tensor's up / down states and second residual (segment_states)

    def __init__(self, inner: Compressor) -> None:
        if inner.name not in TWO_WAY_INNER:
            raise ValueError(
                f"compression.two_way needs compression.name in {list(TWO_WAY_INNER)}, got {inner.name!r}"
            )
        self.inner = inner
        self.name = inner.name  # the config name stays the compressor's
        self.aggregation = inner.aggregation
        self.allows_memory = inner.allows_memory
        self.default_memory = inner.default_memory
        self.min_numel = inner.min_numel
        self.memory = inner.memory
        self.two_way = True
        self.worker_state = ("f",)  # the second residual, the shard owner's own (TWO_WAY_INNER keep none)

    @property
    def fused_segments(self) -> bool:
        """The fused exchange's multi-round form, where the inner codec has a fused form."""
        return has_fused_form(self.inner)

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        return self.inner.compress(tensor, state.setdefault("whole", {}))

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        return self.inner.decompress(payload, shape)

    def payload_bytes(self, payload: Payload) -> int:
        return self.inner.payload_bytes(payload)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def aggregate(self, tensor: torch.Tensor, state: dict, collective: Collective):
        """Both directions; returns (the doubly compressed mean, concat_j c_i^j)."""
        world, rank = collective.world_size, collective_rank(collective)
        flat = tensor.reshape(-1)
        bounds = [shard_bounds(flat.numel(), world, j) for j in range(world)]
        pieces, local = self._compress_shards(flat, state, bounds)
        received = collective.all_to_all([pack_parts(p.tensors) for p in pieces])
        state["last_up_bytes"] = sum(self.inner.payload_bytes(p) for j, p in enumerate(pieces) if j != rank)
        a, b = bounds[rank]
        mean = self._owner_mean(received, pieces[rank], local[a:b], rank)
        out = self._send_back(mean, state, collective, bounds, rank)
        return out.view(tensor.shape), local.view(tensor.shape)

    def _compress_shards(self, flat: torch.Tensor, state: dict, bounds) -> tuple[list[Payload], torch.Tensor]:
        """c^j = C(flat[shard j]) for every shard, and their decoded concatenation (this
        rank's transmitted part, for its residual), in a scratch buffer."""
        ups = _shard_states(state, len(bounds))
        local = scratch_buffer(scratch_of(state), "two_way:local", flat.numel(), flat.dtype, flat.device)
        pieces = []
        for (a, b), up in zip(bounds, ups):
            piece = self.inner.compress(flat[a:b], up)
            dst = local[a:b]
            part = self.inner.decompress(Payload(piece.tensors, dict(piece.meta, out=dst)), dst.shape)
            if part.data_ptr() != dst.data_ptr():
                dst.copy_(part.reshape(-1))
            pieces.append(piece)
        return pieces, local

    def _owner_mean(self, received: list[torch.Tensor], mine: Payload, mine_decoded: torch.Tensor,
                    rank: int) -> torch.Tensor:
        """m_j = (1/p) sum_i decode(c_i^j), summed in rank order; every piece decodes with
        the meta of this rank's own piece of the shard, which was decoded already (for the
        residual: ``mine_decoded``)."""
        numel, dtype = mine.meta["numel"], mine.meta["dtype"]
        dtypes = [t.dtype for t in mine.tensors]
        meta = _local_meta(mine.meta)
        total = torch.zeros(numel, dtype=dtype, device=mine.tensors[0].device)
        for i, message in enumerate(received):
            if i == rank:
                total += mine_decoded
                continue
            parts = tuple(unpack_parts(message.to(total.device), dtypes))
            total += self.inner.decompress(Payload(parts, meta), torch.Size([numel])).reshape(-1).to(dtype)
        return total.div_(len(received))

    def _send_back(self, mean: torch.Tensor, state: dict, collective: Collective, bounds,
                   rank: int) -> torch.Tensor:
        """q = m + f, d = C(q), f <- q - d on this rank's shard; the d of every owner,
        all-gathered and decoded into one tensor (this rank's own d as decoded for f)."""
        memory = _second_residual(state, mean)
        q = memory.compensate(_DOWN, mean)
        down = state.setdefault("down", {})
        down.setdefault("key_hash", state.get("key_hash", 0) + 1)
        payload = self.inner.compress(q, down)
        sent = self.inner.decompress(payload, q.shape)
        memory.update(_DOWN, q, sent)
        state["f"] = memory.residual(_DOWN)
        state["last_down_bytes"] = self.inner.payload_bytes(payload)
        meta = _local_meta(payload.meta)
        n = bounds[-1][1]
        out = torch.empty(n, dtype=mean.dtype, device=mean.device)
        for j, ((a, b), parts) in enumerate(zip(bounds, collective.all_gather(list(payload.tensors)))):
            if j == rank:
                out[a:b] = sent.reshape(-1).to(mean.dtype)
                continue
            part_meta = dict(meta, numel=b - a) if "numel" in meta else meta
            out[a:b] = self.inner.decompress(Payload(tuple(parts), part_meta), torch.Size([b - a])).to(mean.dtype)
        return out

    # ------------------------------------------------------------ fused exchange
    def _owners(self, segments: Segments, world: int) -> list[tuple[Segments, Segments, list[int]]]:
        """Per owner j: its pieces (shard j of every tensor) as segments of the flat buffer,
        with the per-tensor path's keys of each piece's up state; the same pieces end to end
        (its compact buffer), with the keys of each tensor's down state; the tensors with a
        piece (cached)."""

        def make():
            hashes = segments.key_hashes or (0,) * len(segments)
            owners = []
            for j in range(world):
                shards = [shard_bounds(n, world, j) for n in segments.lengths]
                members = [t for t, (a, b) in enumerate(shards) if b > a]
                bounds = [shards[t] for t in members]
                lens = [b - a for a, b in bounds]
                up = Segments([segments.offsets[t] + a for t, (a, _) in zip(members, bounds)], lens, segments.numel,
                              [zlib.crc32(f"{hashes[t]}:up{j}".encode()) & 0x7FFFFFFF for t in members])
                down = Segments([sum(lens[:q]) for q in range(len(lens))], lens, sum(lens),
                                [hashes[t] + 1 for t in members])
                owners.append((up, down, members))
            return owners

        return segments.cached(("two_way", world), make)

    def _inner_state(self, state: dict, name: str, own: list[dict], members: list[int], pick) -> dict:
        """The inner codec's group state ``state[name]`` for the pieces of ``members``; on
        first use built from their per-tensor states (``pick(own[t])``: a per-tensor
        checkpoint's), per piece where the inner rule keeps state per tensor."""
        st = state.get(name)
        if st is None:
            olds = [pick(own[t]) or {} for t in members]
            st = state[name] = {k: v for k, v in (olds[0] if olds else {}).items()
                                if not k.startswith("_") and k != "key_hash"}
            if getattr(self.inner, "segment_state", False):
                st[SEGMENT_STATES] = [{k: v for k, v in o.items() if not k.startswith("_")} for o in olds]
        return st

    def rounds_segments(self, flat: torch.Tensor, segments: Segments, state: dict, collective, out: torch.Tensor):
        """Both directions over the whole buffer (module docstring); every segment's doubly
        compressed mean written into ``out``; returns this rank's transmitted buffer (the
        decoded pieces it sent; None unless :func:`~.base.wants_local`). Its collectives
        block, so the generator ends at its first advance."""
        world, rank = collective.world_size, collective_rank(collective)
        own = state.setdefault(SEGMENT_STATES, [{} for _ in range(len(segments))])
        owners = self._owners(segments, world)
        if any(not len(up) for up, _, _ in owners):
            return self._per_tensor(flat, segments, own, collective, out, state)
        view = flat.view(-1)  # not the memory's offered buffer: e = p - local, as per tensor
        local = scratch_buffer(scratch_of(state), "two_way:local", flat.numel(), flat.dtype, flat.device).zero_()
        pieces = []
        for j, (up, _, members) in enumerate(owners):
            st = self._inner_state(state, f"up{j}", own, members, lambda o, j=j: (o.get("up") or [None] * world)[j])
            piece = self.inner.compress_segments(view, up, st)
            index = up.index(flat.device)
            local.index_copy_(0, index, self.inner.local_segments(piece, up, st).index_select(0, index))
            pieces.append(piece)
        received = collective.all_to_all([pack_parts(p.tensors) for p in pieces])
        state["last_up_bytes"] = sum(self.inner.payload_bytes(p) for j, p in enumerate(pieces) if j != rank)
        up, down, members = owners[rank]
        mine = pieces[rank]
        dtypes = [t.dtype for t in mine.tensors]
        rows = [mine.tensors if i == rank else tuple(unpack_parts(m.to(flat.device), dtypes))
                for i, m in enumerate(received)]
        whole = scratch_buffer(scratch_of(state), "two_way:m", flat.numel(), flat.dtype, flat.device)
        self.inner.mean_segments(rows, mine.meta, up, whole, world)
        self._send_back_segments(whole.index_select(0, up.index(flat.device)), state, own, owners, rank,
                                 collective, out)
        return local if wants_local(state) else None
        yield  # a generator (the fused rounds' protocol), with no round left for finish

    def _send_back_segments(self, mean, state: dict, own, owners, rank: int, collective, out) -> None:
        """q = m + f, d = C(q), f <- q - d over this owner's pieces end to end; every owner's
        d all-gathered and decoded into its pieces' places in ``out``."""
        up, down, members = owners[rank]
        memory = scratch_of(state).setdefault(_DOWN, ResidualMemory())
        fs = [own[t].get("f") for t in members]  # each tensor's piece of f, as per tensor
        f = torch.cat([x.reshape(-1) for x in fs]) if all(isinstance(x, torch.Tensor) for x in fs) else None
        if f is not None and f.shape == mean.shape and f.dtype == mean.dtype:
            memory.adopt(_DOWN, f)
        else:
            memory.reset()
        q = memory.compensate(_DOWN, mean)
        dst = self._inner_state(state, "down", own, members, lambda o: o.get("down"))
        payload = self.inner.compress_segments(q, down, dst)
        sent = self.inner.local_segments(payload, down, dst)
        out.index_copy_(0, up.index(out.device), sent[: down.numel].to(out.dtype))
        memory.update(_DOWN, q, sent)
        f, pos = memory.residual(_DOWN), 0
        for t, n in zip(members, down.lengths):  # kept per tensor: a regrouped or per-tensor exchange reads it
            own[t]["f"] = f[pos : pos + n]
            pos += n
        state["last_down_bytes"] = self.inner.payload_bytes(payload)
        meta = _local_meta(payload.meta)
        spare = scratch_of(state).setdefault("two_way:decode", {})
        for j, parts in enumerate(collective.all_gather(list(payload.tensors))):
            if j == rank:
                continue
            up_j, down_j, _ = owners[j]
            part_meta = dict(meta, numel=down_j.numel) if "numel" in meta else meta
            got = self.inner.local_segments(Payload(tuple(parts), part_meta), down_j, spare)
            out.index_copy_(0, up_j.index(out.device), got[: down_j.numel].to(out.dtype))

    def _per_tensor(self, flat, segments: Segments, own, collective, out, state):
        """Each segment through :meth:`aggregate` with its own state (an owner without a
        piece: every tensor shorter than the world)."""
        local = scratch_buffer(scratch_of(state), "two_way:local", flat.numel(), flat.dtype, flat.device).zero_()
        for (off, n), st, h in zip(segments, own, segments.key_hashes or (0,) * len(segments)):
            st["key_hash"] = h
            mean, mine = self.aggregate(flat[off : off + n].clone(), st, collective)
            out[off : off + n] = mean.reshape(-1)
            local[off : off + n] = mine.reshape(-1)
        return local if wants_local(state) else None
