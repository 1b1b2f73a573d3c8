"""``signsgd``: EF-signSGD, scaled sign with error feedback (Karimireddy et al., ICML 2019).

Rule: p = g + e;  delta = (||p||_1 / n) sign(p);  e <- p - delta  (e lives in
:mod:`easgd_lightning.hooks.memory`). Wire: the signs packed 8 per byte (ceil(n/8) bytes,
bit = 1 for p_i >= 0) plus one scale in the value dtype; per-rank scales make it
non-linear, so payloads are all-gathered. Defaults: memory = true (the EF in EF-signSGD).
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors.base import Compressor, Payload, pack_bits, unpack_bits

__all__ = ["SignSGDCompressor"]


class SignSGDCompressor(Compressor):
    """Scaled sign compression, 1 bit per entry plus a scale.

    Args:
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "signsgd"
    aggregation = "allgather"
    default_memory = True

    def __init__(self, *, min_numel: int | None = None, memory: bool | None = None) -> None:
        super().__init__(min_numel=min_numel, memory=memory)

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        flat = tensor.reshape(-1)
        n = flat.numel()
        scale = (flat.abs().sum() / max(1, n)).reshape(1).to(flat.dtype)
        return Payload((scale, pack_bits(flat >= 0)), {"numel": n, "dtype": flat.dtype})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        scale, packed = payload.tensors
        bits = unpack_bits(packed, payload.meta["numel"])
        signs = bits.to(scale.dtype) * 2 - 1
        return (signs * scale).reshape(shape)
