"""``compression.two_way: true``: compressed, error-compensated communication in both
directions (Zhong et al., 2021, for Adam-type optimizers), on a ring without a server.

Rule, p workers, any sparsifier or sign compressor C, per tensor and step:
  worker -> owners:  p_i = g_i + e_i;  c_i = C(p_i);  e_i <- p_i - c_i  (the attach point's
                     residual memory, as for one-way compression); the c_i are exchanged
                     as C's payloads (all-gathered) and owner j forms its shard of the mean,
                     m_j = (1/p) sum_i c_i[shard j];
  owners -> workers: q_j = m_j + f_j;  d_j = C(q_j);  f_j <- q_j - d_j   (the second
                     residual, kept by the owner of the shard in a
                     :class:`~easgd_lightning.hooks.memory.ResidualMemory`); every d_j
                     is all-gathered and the result is the concatenation of d_0 .. d_{p-1}.
Shard j is entries [j n / p, (j + 1) n / p) of the flattened tensor; each rank owns one,
so no dedicated server is needed. Nothing is lost in either direction: sum_t c_i + e_i =
sum_t g_i and sum_t d_j + f_j = sum_t m_j. This module is the ring form; with the async
parameter server (``async_sgd``, ``async_msgd``) the server keeps f, one per worker:
:mod:`easgd_lightning.strategies.ps.compressed`. The optimizer (Adam, AdamW) then gets
the doubly compressed mean. The first direction uses C's own exchange, so its bytes are
those of one-way compression; the second adds one all-gather of C's payload of each shard.
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors.base import Collective, Compressor, Payload, scratch_of
from easgd_lightning.hooks.memory import ResidualMemory

__all__ = ["TwoWayCompressor", "TWO_WAY_INNER", "shard_bounds"]

#: compressors a two-way exchange can wrap: sparsifiers, sign and quantizers whose payload
#: decodes from itself (random-k's indices come from its own seed stream: not here)
TWO_WAY_INNER = ("gcomp", "qsgd", "redsync", "sidco", "signsgd", "topk")

_DOWN = "two_way:f"  # key of the second residual's memory (in the tensor's scratch)


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


class TwoWayCompressor(Compressor):
    """Wraps ``inner`` so the aggregate is compressed back to the workers, shard by shard,
    with a second residual kept by each shard's owner (see the module docstring)."""

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

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        return self.inner.compress(tensor, state.setdefault("up", {}))

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        return self.inner.decompress(payload, shape)

    def payload_bytes(self, payload: Payload) -> int:
        return self.inner.payload_bytes(payload)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def aggregate(self, tensor: torch.Tensor, state: dict, collective: Collective):
        """Both directions; returns (the doubly compressed mean, this rank's c_i)."""
        world = collective.world_size
        up = state.setdefault("up", {})
        up.setdefault("key_hash", state.get("key_hash", 0))
        mean, local = self.inner.aggregate(tensor, up, collective)
        n = tensor.numel()
        lo, hi = shard_bounds(n, world, collective_rank(collective))
        shard = mean.reshape(-1)[lo:hi]
        memory = _second_residual(state, shard)
        q = memory.compensate(_DOWN, shard)
        down = state.setdefault("down", {})
        down.setdefault("key_hash", state.get("key_hash", 0) + 1)
        payload = self.inner.compress(q, down)
        sent = self.inner.decompress(payload, q.shape)
        memory.update(_DOWN, q, sent)
        state["f"] = memory.residual(_DOWN)
        state["last_down_bytes"] = self.inner.payload_bytes(payload)
        meta = dict(payload.meta)
        meta.pop("out", None)
        out = torch.empty(n, dtype=tensor.dtype, device=tensor.device)
        for rank, parts in enumerate(collective.all_gather(list(payload.tensors))):
            a, b = shard_bounds(n, world, rank)
            part_meta = dict(meta, numel=b - a) if "numel" in meta else meta
            out[a:b] = self.inner.decompress(Payload(tuple(parts), part_meta), torch.Size([b - a])).to(tensor.dtype)
        return out.view(tensor.shape), local
