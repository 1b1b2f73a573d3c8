"""Per-tensor compressed exchange shared by the DDP hook and the elastic exchange.

Policy: tensors with fewer than ``compressor.min_numel`` elements are concatenated and
all-reduced dense (one message, as DGC and HiPress do for small layers); every other
tensor is error-compensated by ``memory``, exchanged with ``compressor.aggregate`` (one
``state`` dict per tensor key) and its residual stored. Dense bytes are charged once per
exchange, so the meter's ``dense_bytes`` is what the same tensors cost uncompressed.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import torch

from easgd_lightning.comm.meter import get_meter
from easgd_lightning.hooks.compressors.base import Compressor
from easgd_lightning.hooks.memory import Memory

__all__ = ["ExchangeStats", "exchange_tensors", "key_hash"]


def key_hash(key) -> int:
    """A stable 31-bit integer for a tensor key (same on every rank)."""
    return zlib.crc32(str(key).encode()) & 0x7FFFFFFF


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


def _kind_totals(kind: str) -> tuple[int, int, int, float]:
    t = get_meter().by_kind[kind]
    return t.bytes_sent, t.bytes_recv, t.dense_bytes, t.time_s


def exchange_tensors(
    tensors: list[torch.Tensor],
    keys: list,
    compressor: Compressor,
    memory: Memory,
    states: dict,
    collective,
    locals_out: list | None = None,
    min_numel: int | None = None,
) -> tuple[list[torch.Tensor], ExchangeStats]:
    """Mean over ranks of each tensor (same order, same shapes) under the policy above.

    Every rank must call this with tensors of the same shapes in the same order. When
    ``locals_out`` is a list, it receives this rank's transmitted (decompressed)
    contribution per tensor. ``min_numel`` overrides ``compressor.min_numel``.
    """
    kind = collective.kind
    stats = ExchangeStats()
    out: list[torch.Tensor | None] = [None] * len(tensors)
    mine: list[torch.Tensor | None] = [None] * len(tensors)
    world = collective.world_size
    limit = compressor.min_numel if min_numel is None else int(min_numel)
    small = [i for i, t in enumerate(tensors) if t.numel() < limit]
    big = [i for i, t in enumerate(tensors) if t.numel() >= limit]
    before = _kind_totals(kind)
    start = time.perf_counter()
    if small:
        flat = torch.cat([tensors[i].reshape(-1) for i in small])
        collective.charge_dense(flat.numel() * flat.element_size())
        (summed,) = collective.all_reduce_sum([flat])
        summed /= world
        offset = 0
        for i in small:
            n = tensors[i].numel()
            out[i] = summed[offset : offset + n].view_as(tensors[i])
            mine[i] = tensors[i]
            offset += n
        stats.dense_tensors += len(small)
    observe_bw = getattr(compressor, "observe_bandwidth", None)
    for i in big:
        t, key = tensors[i], keys[i]
        st = states.setdefault(key, {})
        st.setdefault("key_hash", key_hash(key))
        m0 = _kind_totals(kind)
        comp = memory.compensate(key, t)
        collective.charge_dense(t.numel() * t.element_size())
        mean, local = compressor.aggregate(comp, st, collective)
        memory.update(key, comp, local)
        out[i] = mean
        mine[i] = local
        stats.compressed_tensors += 1
        if callable(observe_bw):
            m1 = _kind_totals(kind)
            observe_bw((m1[0] - m0[0]) + (m1[1] - m0[1]), m1[3] - m0[3])
    after = _kind_totals(kind)
    elapsed = time.perf_counter() - start
    stats.bytes_sent = after[0] - before[0]
    stats.bytes_recv = after[1] - before[1]
    stats.dense_bytes = after[2] - before[2]
    stats.comm_time_s = after[3] - before[3]
    stats.codec_time_s = max(0.0, elapsed - stats.comm_time_s)
    if locals_out is not None:
        locals_out.extend(mine)
    return out, stats  # type: ignore[return-value]
