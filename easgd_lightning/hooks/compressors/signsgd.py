"""``signsgd``: EF-signSGD, scaled sign with error feedback (Karimireddy et al., ICML 2019).

Rule: p = g + e;  delta = (||p||_1 / n) sign(p);  e <- p - delta  (e lives in
:mod:`easgd_lightning.hooks.memory`). Wire: the signs packed 8 per byte (ceil(n/8) bytes,
bit = 1 for p_i >= 0) plus one scale in the value dtype; per-rank scales make it
non-linear, so payloads are all-gathered. Defaults: memory = true (the EF in EF-signSGD).
Cost: one pass packs the signs and sums |p| (native kernel; the sum accumulates in
double); with memory a second writes the residual p - delta into the compensated buffer;
decoding is one pass into the output.
Fused exchange (:mod:`easgd_lightning.hooks._fused`): one call packs every tensor of the
exchange's buffer, each with its own scale ||p_t||_1 / n_t (the rule is per tensor), each
tensor's signs starting on a byte (the per-tensor path's bytes); each rank's payload is
decoded and added into the mean in one call per rank.
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors import _native
from easgd_lightning.hooks.compressors.base import (
    Compressor,
    Payload,
    dense_out,
    may_write_residual,
    pack_bits,
    residual_written,
    scratch_buffer,
    scratch_of,
    unpack_bits,
)
from easgd_lightning.hooks.compressors.segments import Segments

__all__ = ["SignSGDCompressor"]


class SignSGDCompressor(Compressor):
    """Scaled sign compression, 1 bit per entry plus a scale.

    Args:
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "signsgd"
    aggregation = "allgather"
    default_memory = True
    fused_segments = True

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        flat = tensor.reshape(-1)
        n = flat.numel()
        lib = _native.use(flat)
        if lib is None:
            scale = (flat.abs().sum(dtype=torch.float64) / max(1, n)).reshape(1).to(flat.dtype)
            packed = pack_bits(flat >= 0)
        else:
            packed = scratch_buffer(scratch_of(state), "signs", (n + 7) // 8, torch.uint8, flat.device)
            total = _native.fn(lib, "sign_pack", flat.dtype)(flat.data_ptr(), n, packed.data_ptr())
            scale = torch.tensor([total / max(1, n)], dtype=flat.dtype)
        if may_write_residual(tensor) and flat.data_ptr() == tensor.data_ptr() and lib is not None:
            _native.fn(lib, "sign_residual", flat.dtype)(flat.data_ptr(), n, float(scale[0]))
            residual_written(tensor)  # p - delta, as the memory would compute it
        return Payload((scale, packed), {"numel": n, "dtype": flat.dtype})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        scale, packed = payload.tensors
        n = payload.meta["numel"]
        lib = _native.use(scale)
        if lib is not None and packed.is_contiguous() and packed.device.type == "cpu":
            out = dense_out(payload.meta, n, scale.dtype, scale.device, zero=False)
            _native.fn(lib, "sign_unpack", scale.dtype)(packed.data_ptr(), n, float(scale[0]), out.data_ptr())
            return out.reshape(shape)
        bits = unpack_bits(packed, n)
        signs = bits.to(scale.dtype) * 2 - 1
        return (signs * scale).reshape(shape)

    def compress_segments(self, flat: torch.Tensor, segments: Segments, state: dict) -> Payload:
        """Payload (scales, one per segment; signs, each segment from its byte
        :func:`byte_positions`); the residual written in place when ``flat`` was offered."""
        lib = _native.use(flat)
        if lib is None:  # eager: each segment as the per-tensor eager path computes it
            scales, packs = [], []
            for off, n in segments:
                seg = flat[off : off + n]
                scales.append((seg.abs().sum(dtype=torch.float64) / n).reshape(1).to(flat.dtype))
                packs.append(pack_bits(seg >= 0))
            return Payload((torch.cat(scales), torch.cat(packs)), {"dtype": flat.dtype})
        off, lens = segments.arrays()
        pos, nbytes = byte_positions(segments)
        scratch = scratch_of(state)
        packed = scratch_buffer(scratch, "signs", nbytes, torch.uint8, flat.device)
        sums = scratch_buffer(scratch, "sign_sums", len(segments), torch.float64, "cpu")
        _native.fn(lib, "sign_pack_segments", flat.dtype)(
            flat.data_ptr(), len(segments), off.data_ptr(), lens.data_ptr(), pos.data_ptr(),
            packed.data_ptr(), sums.data_ptr())
        scales = (sums / segments.cached("lengths_f64", lambda: lens.double())).to(flat.dtype)
        if may_write_residual(flat):
            _native.fn(lib, "sign_residual_segments", flat.dtype)(
                flat.data_ptr(), len(segments), off.data_ptr(), lens.data_ptr(), scales.data_ptr())
            residual_written(flat)  # p - delta on every segment
        return Payload((scales, packed), {"dtype": flat.dtype})

    def local_segments(self, payload: Payload, segments: Segments, state: dict) -> torch.Tensor:
        dt = payload.meta["dtype"]
        out = scratch_buffer(scratch_of(state), "local", segments.numel, dt, payload.tensors[0].device)
        out.zero_()
        add_signs(out, *payload.tensors, segments)
        return out

    def mean_segments(self, received, meta: dict, segments: Segments, out: torch.Tensor, world: int) -> None:
        """Every rank's decoded signs added into ``out`` in rank order, then / world (the
        whole buffer: the attach point writes the dense runs afterwards)."""
        out.zero_()
        for scales, packed in received:
            add_signs(out, scales.to(out.dtype), packed, segments)
        out.div_(world)


def byte_positions(segments: Segments) -> tuple[torch.Tensor, int]:
    """(first byte of each segment's signs, total bytes): each segment takes ceil(n / 8)."""

    def make():
        nbytes = [(n + 7) // 8 for n in segments.lengths]
        return torch.tensor([sum(nbytes[:j]) for j in range(len(nbytes))], dtype=torch.int64), sum(nbytes)

    return segments.cached("sign_bytes", make)


def add_signs(out: torch.Tensor, scales: torch.Tensor, packed: torch.Tensor, segments: Segments) -> None:
    """out += scale_s * (+1 if bit else -1) on every segment s (one rank's payload)."""
    lib = _native.use(out)
    pos, _ = byte_positions(segments)
    if lib is not None and packed.device.type == "cpu":
        scales, packed = scales.contiguous(), packed.contiguous()
        off, lens = segments.arrays()
        _native.fn(lib, "sign_unpack_add_segments", out.dtype)(
            packed.data_ptr(), len(segments), off.data_ptr(), lens.data_ptr(), pos.data_ptr(),
            scales.data_ptr(), out.data_ptr())
        return
    for j, (off, n) in enumerate(segments):
        p = int(pos[j])
        signs = unpack_bits(packed[p : p + (n + 7) // 8], n).to(out.dtype) * 2 - 1
        out[off : off + n] += signs * scales[j]
