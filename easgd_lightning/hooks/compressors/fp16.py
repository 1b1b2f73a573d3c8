"""``fp16`` / ``bf16``: cast to a 16-bit float for the wire.

Rule: send half(g_i / p); all-reduce the halves; mean = float(sum_i half(g_i / p)).
Dividing before the cast keeps the sum in range (PyTorch's ``fp16_compress_hook``).
Bytes: 2 per element. Defaults: ``memory=false`` (the rounding error is tiny; turn it on
for error-compensated low precision).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from easgd_lightning.hooks.compressors.base import (
    Collective,
    Compressor,
    Payload,
    run_rounds,
    start_collective,
)

__all__ = ["FP16Compressor", "BF16Compressor"]


class FP16Compressor(Compressor):
    """IEEE half precision on the wire.

    Args:
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "fp16"
    aggregation = "allreduce"
    default_memory = False
    wire_dtype: ClassVar[torch.dtype] = torch.float16

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        return Payload((tensor.reshape(-1).to(self.wire_dtype),), {"dtype": tensor.dtype})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        dtype = payload.meta.get("dtype", torch.float32)
        return payload.tensors[0].to(dtype).reshape(shape)

    def aggregate(
        self, tensor: torch.Tensor, state: dict, collective: Collective
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Divide by p before the cast, all-reduce the 16-bit payload, cast back."""
        return run_rounds(self.aggregate_rounds(tensor, state, collective))

    def aggregate_rounds(self, tensor: torch.Tensor, state: dict, collective: Collective):
        """:meth:`aggregate` as a generator that yields once its all-reduce is launched
        (non-blocking where the collective can): partitions pipeline (HiPress CaSync)."""
        world = collective.world_size
        local = self.decompress(self.compress(tensor, state), tensor.shape)
        payload = self.compress(tensor / world, state)
        pending = start_collective(collective, "all_reduce_sum", list(payload.tensors))
        yield
        (summed,) = pending.wait()
        mean = self.decompress(Payload((summed,), payload.meta), tensor.shape)
        return mean.to(tensor.dtype), local.to(tensor.dtype)


class BF16Compressor(FP16Compressor):
    """bfloat16 on the wire (fp32's range, 8 mantissa bits)."""

    name = "bf16"
    wire_dtype = torch.bfloat16
