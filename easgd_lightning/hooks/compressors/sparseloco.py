"""``sparseloco``: top-k of the pseudo-gradient with its kept values in 2 bits, with error
feedback (SparseLoCo: Sarfi, Thérien, Lidin, Belilovsky et al., "Communication Efficient
LLM Pre-training with SparseLoCo", 2025, arXiv 2508.15706).

Rule, per tensor: p = v + e (residual, :mod:`easgd_lightning.hooks.memory`); keep the k =
ceil(ratio * n) largest |p_i| (``topk``'s selection: sampled threshold, or exact); the
kept values are coded in 2 bits each -- a sign bit and a magnitude bit, set when |p_i| is at
or above the median of the kept magnitudes -- and decode to sign(p_i) * m_lo or
sign(p_i) * m_hi, the mean kept magnitude of each half (the two-level code that minimises
the squared error for that split); e <- p - C(p), so both what was dropped and the
quantisation error are sent later. Wire: an 8-byte count, the two scales (value dtype),
the indices (int32) and the codes (k / 4 bytes), one message per rank, all-gathered.
Defaults: ratio = 0.01 (the paper keeps 1-3%), memory = true.
Fused exchange (:mod:`easgd_lightning.hooks._fused`): one selection call over the
exchange's flat buffer (``topk``'s segmented kernel, each tensor its own sample and
threshold), then each tensor's own 2-bit code (its median and two magnitudes: a loop over
the tensors, one median each); one payload per rank -- the count of each tensor, its two
scales, the indices relative to the buffer and all code bits --, each rank's payload
decoded and added in one pass.
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors import _native
from easgd_lightning.hooks.compressors.base import (
    Compressor,
    Payload,
    dense_out,
    index_dtype_for,
    pack_bits,
    scratch_buffer,
    scratch_of,
    unpack_bits,
)
from easgd_lightning.hooks.compressors.segments import Segments
from easgd_lightning.hooks.compressors.sparse import divide_at
from easgd_lightning.hooks.compressors.topk import TopKCompressor

__all__ = ["SparseLoCoCompressor", "two_bit_code", "two_bit_decode"]


def two_bit_code(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(negative, high, scales): the sign and magnitude bits of ``values`` and the two
    magnitudes [m_lo, m_hi] they decode to (the mean |v| below / at-or-above the median)."""
    mag = values.abs()
    if values.numel() == 0:
        return mag.bool(), mag.bool(), values.new_zeros(2)
    median = mag.median()
    high = mag >= median
    low = ~high
    m_hi = mag[high].mean()
    m_lo = mag[low].mean() if bool(low.any()) else m_hi
    return values < 0, high, torch.stack([m_lo, m_hi]).to(values.dtype)


def two_bit_decode(negative: torch.Tensor, high: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The values of :func:`two_bit_code`'s bits: +-m_lo or +-m_hi."""
    mag = torch.where(high, scales[1], scales[0])
    return torch.where(negative, -mag, mag)


class SparseLoCoCompressor(TopKCompressor):
    """Top-k with 2-bit values and error feedback (SparseLoCo).

    Args:
        ratio: fraction of entries kept, in (0, 1].
        sample_size, exact: ``topk``'s selection (sampled threshold or exact top-k).
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "sparseloco"
    search_knob = "ratio"

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        flat = tensor.reshape(-1)
        idx, val = self.select_values(flat, state)
        state["last_nnz"] = int(idx.numel())
        negative, high, scales = two_bit_code(val)
        codes = torch.stack([negative, high], dim=1).reshape(-1)
        idt = index_dtype_for(flat.numel())
        count = torch.tensor([idx.numel()], dtype=torch.int64, device=flat.device)
        message = torch.cat([
            count.view(torch.uint8),
            scales.contiguous().view(torch.uint8),
            idx.to(idt).contiguous().view(torch.uint8),
            pack_bits(codes),
        ])
        return Payload((message,), {"numel": flat.numel(), "dtype": flat.dtype, "index_dtype": idt})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        meta = payload.meta
        buf = payload.tensors[0]
        vsz = torch.empty((), dtype=meta["dtype"]).element_size()
        isz = torch.empty((), dtype=meta["index_dtype"]).element_size()
        k = int(buf[:8].clone().view(torch.int64)[0])
        scales = buf[8 : 8 + 2 * vsz].clone().view(meta["dtype"])
        start = 8 + 2 * vsz
        idx = buf[start : start + k * isz].clone().view(meta["index_dtype"]).long()
        bits = unpack_bits(buf[start + k * isz :], 2 * k).view(k, 2)
        out = dense_out(meta, meta["numel"], meta["dtype"], buf.device)
        out[idx] = two_bit_decode(bits[:, 0], bits[:, 1], scales)
        return out.reshape(shape)

    def _launch(self, tensor, state, collective):
        """The generic all-gather exchange (every rank's message decoded and added)."""
        return Compressor._launch(self, tensor, state, collective)

    def compress_segments(self, flat: torch.Tensor, segments: Segments, state: dict) -> Payload:
        """(count per segment, its two scales, indices relative to ``flat``, code bits):
        each segment selected and coded by its own rule, as :meth:`compress` on it alone."""
        idx, val = self.select_segments(flat, segments, state, False)
        state["last_nnz"] = int(idx.numel())
        starts = segments.int64("offsets", segments.offsets).to(idx.device)  # idx: segment after segment
        seg = torch.searchsorted(starts, idx, right=True) - 1
        counts = torch.bincount(seg, minlength=len(segments))
        bounds = [0, *counts.cumsum(0).tolist()]
        codes, scales = [], []
        for a, b in zip(bounds[:-1], bounds[1:]):
            negative, high, sc = two_bit_code(val[a:b])
            codes.append(torch.stack([negative, high], dim=1).reshape(-1))
            scales.append(sc)
        idt = index_dtype_for(flat.numel())
        return Payload((counts, torch.cat(scales), idx.to(idt, copy=True), pack_bits(torch.cat(codes))),
                       {"dtype": flat.dtype, "index_dtype": idt})

    @staticmethod
    def _entries(tensors) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, decoded values) of one rank's fused payload."""
        counts, scales, idx, bits = tensors
        k = idx.numel()
        code = unpack_bits(bits.reshape(-1), 2 * k).view(k, 2)
        per = scales.view(-1, 2).repeat_interleave(counts.long(), dim=0)  # each entry's segment's
        mag = torch.where(code[:, 1], per[:, 1], per[:, 0])
        return idx.long(), torch.where(code[:, 0], -mag, mag)

    def local_segments(self, payload: Payload, segments: Segments, state: dict) -> torch.Tensor:
        out = scratch_buffer(scratch_of(state), "local", segments.numel, payload.meta["dtype"],
                             payload.tensors[0].device)
        out.zero_()
        idx, val = self._entries(payload.tensors)
        _native.scatter_into(out, idx, val)
        return out

    def mean_segments(self, received, meta: dict, segments: Segments, out: torch.Tensor, world: int) -> None:
        """Every rank's decoded entries added in rank order into ``out`` (its segments
        zeroed first), divided by ``world`` at the touched entries."""
        for off, n in segments.runs():
            out[off : off + n].zero_()
        touched = []
        for tensors in received:
            idx, val = self._entries(tensors)
            idx = idx.to(out.device)
            _native.scatter_add_into(out, idx, val.to(out.device, out.dtype))
            touched.append(idx)
        divide_at(out, torch.cat(touched), world)
