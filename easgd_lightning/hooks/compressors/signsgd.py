"""``signsgd``: EF-signSGD, scaled sign with error feedback (Karimireddy et al., ICML 2019).

Rule: p = g + e;  delta = (||p||_1 / n) sign(p);  e <- p - delta  (e lives in
:mod:`easgd_lightning.hooks.memory`). Wire: the signs packed 8 per byte (ceil(n/8) bytes,
bit = 1 for p_i >= 0) plus one scale in the value dtype; per-rank scales make it
non-linear, so payloads are all-gathered. Defaults: memory = true (the EF in EF-signSGD).
Cost: one pass packs the signs and sums |p| (native kernel; the sum accumulates in
double); with memory a second writes the residual p - delta into the compensated buffer;
decoding is one pass into the output.
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

__all__ = ["SignSGDCompressor"]


class SignSGDCompressor(Compressor):
    """Scaled sign compression, 1 bit per entry plus a scale.

    Args:
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "signsgd"
    aggregation = "allgather"
    default_memory = True

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
