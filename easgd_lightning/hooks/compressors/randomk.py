"""``randomk``: k coordinates drawn with a seed shared by all ranks.

Rule: at step t every rank draws the same index set I_t (|I_t| = k = ceil(ratio * n))
from seed (seed, t, tensor); payload = g[I_t] (indices are not sent: every rank knows
them), summed with one all-reduce; decoded as scale * sum_i g_i[I_t] at I_t with
scale = 1 / P(i in I_t) when ``unbiased`` (E[decoded] = g; Stich et al. 2018, "Sparsified
SGD with memory") and 1 otherwise (then use residuals). Defaults: ratio = 0.01,
unbiased = false, memory = true, seed = 0.

The draw is stratified: [0, n) is cut into k consecutive strata of floor(n/k) or
ceil(n/k) entries (boundaries j n // k) and one index is drawn uniformly in each, so
P(i in I_t) = 1 / (size of i's stratum) (= k / n when k divides n) and I_t comes out
sorted: k uniform draws from the shared generator, no permutation of the whole tensor,
and the gather reads the tensor front to back. With memory the sent entries are zeroed
in the compensated buffer (the residual) in the same call.
Fused exchange (:mod:`easgd_lightning.hooks._fused`): one native call
draws every tensor's own set (its seeds from its key, the exchange's step and its size,
derived in the kernel) and gathers the values into one all-reduced message.
"""

from __future__ import annotations

import zlib

import torch

from easgd_lightning.hooks.compressors import _native
from easgd_lightning.hooks.compressors.base import (
    Compressor,
    Payload,
    check_bool,
    check_int,
    check_ratio,
    may_write_residual,
    num_selected,
    record_sparse,
    residual_written,
    scratch_buffer,
    scratch_of,
    sparse_out,
)
from easgd_lightning.hooks.compressors.segments import Segments
from easgd_lightning.hooks.compressors.sparse import divide_at

__all__ = ["RandomKCompressor", "shared_random_indices", "random_gather", "strata", "draw_seeds"]


def strata(numel: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, sizes) of the k strata of [0, numel): starts j * numel // k (int64)."""
    bounds = torch.arange(k + 1, dtype=torch.int64) * numel // k
    return bounds[:-1], bounds[1:] - bounds[:-1]


def draw_seeds(seed: int, step: int, key_hash: int, numel: int) -> tuple[int, int]:
    """The two 32-bit words every rank derives from (seed, step, tensor, numel)."""
    text = f"{seed}:{step}:{key_hash}:{numel}"
    return zlib.crc32(text.encode()), zlib.crc32(f"{text}:randomk".encode())


def shared_random_indices(
    numel: int, k: int, seed: int, step: int, key_hash: int = 0, device=None
) -> torch.Tensor:
    """k distinct sorted indices of [0, numel), one uniform in each stratum; identical on
    every rank for equal arguments (a counter-based hash of the shared seed: the same
    numbers as the native gather)."""
    s0, s1 = draw_seeds(seed, step, key_hash, numel)
    j = torch.arange(k, dtype=torch.int64)
    starts = j * numel // k
    sizes = (j + 1) * numel // k - starts
    u = _native.hash_uniform24(j, s0, s1)
    idx = starts + (u * sizes.to(torch.float64)).long()  # u < 1: idx < start + size
    return idx.to(device) if device is not None else idx


def random_gather(
    flat: torch.Tensor, k: int, seeds: tuple[int, int], *, zero: bool, scratch: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, values) of the shared stratified draw; zeroes the drawn entries if ``zero``."""
    n = flat.numel()
    lib = _native.use(flat)
    if lib is not None and k < 2**32:
        idx = torch.empty(k, dtype=torch.int64)
        val = torch.empty(k, dtype=flat.dtype)
        _native.fn(lib, "randomk_gather", flat.dtype)(
            flat.data_ptr(), n, k, seeds[0], seeds[1], int(zero), idx.data_ptr(), val.data_ptr()
        )
        return idx, val
    s0, s1 = seeds
    j = torch.arange(k, dtype=torch.int64)
    starts = j * n // k
    sizes = (j + 1) * n // k - starts
    idx = (starts + (_native.hash_uniform24(j, s0, s1) * sizes.to(torch.float64)).long()).to(
        flat.device
    )
    val = flat.index_select(0, idx)
    if zero:
        flat.index_fill_(0, idx, 0)
    return idx, val


class RandomKCompressor(Compressor):
    """Random-k sparsification with a rank-shared seed (linear: all-reduce).

    Args:
        ratio: fraction of entries sent, in (0, 1].
        unbiased: scale the kept entries by n / k (unbiased estimate; use without memory).
        seed: base seed shared by all ranks.
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "randomk"
    search_knob = "ratio"
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
        self.ratio = check_ratio("compression.ratio", ratio)
        self.unbiased = check_bool("compression.unbiased", unbiased)
        self.seed = check_int("compression.seed", seed, 0)

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = num_selected(n, self.ratio)
        step = int(state.get("step", 0))
        state["step"] = step + 1
        seeds = draw_seeds(self.seed, step, int(state.get("key_hash", 0)), n)
        scale: float | torch.Tensor = 1.0
        if self.unbiased and n % k:
            scale = strata(n, k)[1].to(device=flat.device, dtype=flat.dtype)
        elif self.unbiased:
            scale = n / k
        in_place = may_write_residual(tensor) and flat.data_ptr() == tensor.data_ptr()
        unit = isinstance(scale, float) and scale == 1.0
        idx, vals = random_gather(flat, k, seeds, zero=in_place and unit)
        if in_place:
            if not unit:
                flat.index_put_((idx,), vals - vals * scale)  # p - C(p) at the sent entries
            residual_written(tensor)
        return Payload((vals,), {"indices": idx, "numel": n, "scale": scale, "dtype": flat.dtype})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        meta = payload.meta
        (vals,) = payload.tensors
        out = sparse_out(meta, meta["numel"], vals.dtype, vals.device)
        scale = meta["scale"]
        if not (isinstance(scale, float) and scale == 1.0):
            vals = vals * scale
        _native.scatter_into(out, meta["indices"], vals)
        record_sparse(meta, out, meta["indices"])
        return out.reshape(shape)

    fused_segments = True

    def _segment_scales(self, segments: Segments, ks, dtype, device) -> torch.Tensor | None:
        """``unbiased``: the scale of every drawn entry, segments in order (n / k where k
        divides n, else the size of its stratum), as :meth:`compress` applies it; None
        otherwise."""
        if not self.unbiased:
            return None

        def make():
            parts = [strata(n, k)[1].to(dtype) if n % k else torch.full((k,), n / k, dtype=dtype)
                     for n, k in zip(segments.lengths, ks)]
            return torch.cat(parts)

        return segments.cached(("randomk_scale", self.ratio, dtype), make).to(device)

    def compress_segments(self, flat: torch.Tensor, segments: Segments, state: dict) -> Payload:
        """Every segment's own draw, one step counter for the exchange; the drawn entries
        zeroed in place when ``flat`` was offered (the residual)."""
        step = int(state.get("step", 0))
        state["step"] = step + 1
        hashes = segments.key_hashes or (0,) * len(segments)
        ks = segments.cached(("randomk_k", self.ratio), lambda: [num_selected(n, self.ratio) for n in segments.lengths])
        total = sum(ks)
        scale = self._segment_scales(segments, ks, flat.dtype, flat.device)
        in_place = may_write_residual(flat)
        zero = in_place and scale is None
        lib = _native.use(flat)
        if lib is None or max(ks) >= 2**32:
            idx, val = [], []
            for (off, n), k, h in zip(segments, ks, hashes):
                i, v = random_gather(flat[off : off + n], k, draw_seeds(self.seed, step, h, n), zero=zero)
                idx.append(i + off)
                val.append(v)
            idx_all, val_all = torch.cat(idx), torch.cat(val)
        else:
            off, lens = segments.arrays()
            scratch = scratch_of(state)
            idx_all = scratch_buffer(scratch, "randomk_idx", total, torch.int64, flat.device)
            val_all = scratch_buffer(scratch, "randomk_val", total, flat.dtype, flat.device)
            _native.fn(lib, "randomk_segments", flat.dtype)(
                flat.data_ptr(), len(segments), off.data_ptr(), lens.data_ptr(),
                segments.int64(("randomk_k", self.ratio), ks).data_ptr(),
                segments.int64("key_hash", hashes).data_ptr(), self.seed, step, int(zero),
                idx_all.data_ptr(), val_all.data_ptr())
        if in_place:
            if scale is not None:
                flat.index_put_((idx_all,), val_all - val_all * scale)  # p - C(p) at the draws
            residual_written(flat)
        return Payload((val_all,), {"indices": idx_all, "dtype": flat.dtype, "scale": scale})

    def local_segments(self, payload: Payload, segments: Segments, state: dict) -> torch.Tensor:
        (vals,) = payload.tensors
        out = scratch_buffer(scratch_of(state), "local", segments.numel, vals.dtype, vals.device)
        out.zero_()
        if payload.meta.get("scale") is not None:
            vals = vals * payload.meta["scale"]
        return _native.scatter_into(out, payload.meta["indices"], vals)

    def mean_segments(self, received, meta: dict, segments: Segments, out: torch.Tensor, world: int) -> None:
        """The summed values at every segment's draw, / world (zeros elsewhere)."""
        for off, n in segments.runs():
            out[off : off + n].zero_()
        summed = received[0].to(out.dtype)
        if meta.get("scale") is not None:
            summed = summed * meta["scale"]
        _native.scatter_into(out, meta["indices"], summed)
        divide_at(out, meta["indices"], world)
