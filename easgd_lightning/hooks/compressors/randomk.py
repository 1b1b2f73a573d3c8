"""``randomk``: k coordinates drawn with a seed shared by all ranks.

Rule: at step t every rank draws the same index set I_t (|I_t| = k = ceil(ratio * n))
from seed (seed, t, tensor); payload = g[I_t] (indices are not sent: every rank knows
them), summed with one all-reduce; decoded as scale * sum_i g_i[I_t] at I_t with
scale = n / k when ``unbiased`` (E[decoded] = g; Stich et al. 2018, "Sparsified SGD with
memory") and 1 otherwise (then use residuals). Defaults: ratio = 0.01, unbiased = false,
memory = true, seed = 0.
"""

from __future__ import annotations

import zlib

import torch

from easgd_lightning.hooks.compressors.base import (
    Compressor,
    Payload,
    check_int,
    check_ratio,
    num_selected,
)

__all__ = ["RandomKCompressor", "shared_random_indices"]


def shared_random_indices(
    numel: int, k: int, seed: int, step: int, key_hash: int = 0, device=None
) -> torch.Tensor:
    """k distinct indices of [0, numel), identical on every rank for equal arguments."""
    mixed = zlib.crc32(f"{seed}:{step}:{key_hash}:{numel}".encode()) & 0x7FFFFFFF
    gen = torch.Generator(device="cpu").manual_seed(mixed)
    idx = torch.randperm(numel, generator=gen)[:k]
    return idx.sort().values.to(device) if device is not None else idx.sort().values


class RandomKCompressor(Compressor):
    """Random-k sparsification with a rank-shared seed (linear: all-reduce).

    Args:
        ratio: fraction of entries sent, in (0, 1].
        unbiased: scale the kept entries by n / k (unbiased estimate; use without memory).
        seed: base seed shared by all ranks.
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "randomk"
    aggregation = "allreduce"
    default_memory = True

    def __init__(
        self,
        ratio: float = 0.01,
        *,
        unbiased: bool = False,
        seed: int = 0,
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.ratio = check_ratio("ratio", ratio)
        if not isinstance(unbiased, bool):
            raise ValueError(f"compression.unbiased must be true or false, got {unbiased!r}")
        self.unbiased = unbiased
        self.seed = check_int("seed", seed, 0)

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = num_selected(n, self.ratio)
        step = int(state.get("step", 0))
        state["step"] = step + 1
        idx = shared_random_indices(n, k, self.seed, step, int(state.get("key_hash", 0)), flat.device)
        scale = n / k if self.unbiased else 1.0
        return Payload((flat[idx],), {"indices": idx, "numel": n, "scale": scale, "dtype": flat.dtype})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        meta = payload.meta
        (vals,) = payload.tensors
        out = torch.zeros(meta["numel"], dtype=vals.dtype, device=vals.device)
        out[meta["indices"]] = vals * meta["scale"] if meta["scale"] != 1.0 else vals
        return out.reshape(shape)
