"""``none``: the identity codec (dense, uncompressed).

Rule: payload = g; aggregate = (1/p) sum_i g_i (one all-reduce). The attach points treat
it as the plain metered dense path. Defaults: ``memory=false`` (nothing is dropped).
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors.base import Compressor, Payload

__all__ = ["NoneCompressor"]


class NoneCompressor(Compressor):
    """Sends the tensor as it is.

    Args:
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "none"
    aggregation = "allreduce"
    default_memory = False

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        return Payload((tensor.reshape(-1),), {"dtype": tensor.dtype})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        return payload.tensors[0].reshape(shape)
