"""``fp16`` / ``bf16``: cast to a 16-bit float for the wire.

Rule: send half(g_i / p); all-reduce the halves; mean = float(sum_i half(g_i / p)).
Dividing before the cast keeps the sum in range (PyTorch's ``fp16_compress_hook``).
Bytes: 2 per element. Defaults: ``memory=false`` (the rounding error is tiny; turn it on
for error-compensated low precision).
Fused exchange (:mod:`easgd_lightning.hooks._fused`): the rule is element-wise, so the
compressed tensors of a buffer are gathered into one message, cast and all-reduced once.
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
    fused_segments = True
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


    def compress_segments(self, flat: torch.Tensor, segments, state: dict) -> Payload:
        """The segments' entries / world in the wire dtype (one message); ``meta["sent"]``
        keeps them undivided for :meth:`local_segments`."""
        sent = flat.index_select(0, segments.index(flat.device))
        wire = (sent / int(state.get("world_size", 1))).to(self.wire_dtype)
        return Payload((wire,), {"dtype": flat.dtype, "sent": sent})

    def local_segments(self, payload: Payload, segments, state: dict) -> torch.Tensor:
        sent, dt = payload.meta["sent"], payload.meta["dtype"]
        out = torch.zeros(segments.numel, dtype=dt, device=sent.device)
        return out.index_copy_(0, segments.index(sent.device), sent.to(self.wire_dtype).to(dt))

    def mean_segments(self, received, meta: dict, segments, out: torch.Tensor, world: int) -> None:
        """The summed 16-bit values cast back (each rank divided before the cast)."""
        out.index_copy_(0, segments.index(out.device), received[0].to(meta["dtype"]).to(out.dtype))


class BF16Compressor(FP16Compressor):
    """bfloat16 on the wire (fp32's range, 8 mantissa bits)."""

    name = "bf16"
    wire_dtype = torch.bfloat16
