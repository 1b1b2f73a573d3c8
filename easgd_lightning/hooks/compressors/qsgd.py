"""``qsgd``: stochastic quantization to s levels (Alistarh et al., NeurIPS 2017).

Rule, per bucket v of ``bucket_size`` entries: q_i = ||v||_2 sign(v_i) xi_i / s with
xi_i = floor(s |v_i| / ||v||_2 + U[0, 1)), i.e. s|v_i|/||v|| rounded up with probability
equal to its fractional part, so E[q] = v (unbiased) and Var <= min(d/s^2, sqrt(d)/s) ||v||^2.
Wire: one norm per bucket (value dtype) + one signed level per entry in the smallest
integer type holding [-s, s] (int8 for s <= 127); per-rank norms make it non-linear, so
payloads are all-gathered. Defaults: levels s = 127 (8 bits), bucket_size = 512 (the
paper's bucketing), memory = false (unbiased), seed = null (the global torch RNG).

Noise: U_i comes from a counter-based hash of (i, two 32-bit words drawn per call from
the generator -- the private one with ``seed``, else torch's global one), 24-bit uniform
in [0, 1): the norm, rounding and cast are one pass per bucket in the native kernel
(float32 / float64 CPU tensors), and the eager path computes the same numbers.
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors import _native
from easgd_lightning.hooks.compressors.base import (
    Compressor,
    Payload,
    check_int,
    dense_out,
    scratch_buffer,
    scratch_of,
)

__all__ = ["QSGDCompressor", "level_dtype", "noise_seeds", "qsgd_quantize", "qsgd_dequantize"]


def level_dtype(levels: int) -> torch.dtype:
    """Smallest signed integer dtype holding [-levels, levels]."""
    if levels <= 127:
        return torch.int8
    if levels <= 32767:
        return torch.int16
    return torch.int32


def noise_seeds(generator: torch.Generator | None = None) -> tuple[int, int]:
    """Two 32-bit words for the rounding noise, drawn from ``generator`` (None: global RNG)."""
    w = torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=generator)
    return int(w[0]), int(w[1])


def qsgd_quantize(
    flat: torch.Tensor,
    levels: int,
    bucket_size: int,
    generator: torch.Generator | None = None,
    *,
    seeds: tuple[int, int] | None = None,
    scratch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (norms per bucket, signed integer levels) of the 1-D ``flat``."""
    n = flat.numel()
    b = bucket_size if bucket_size > 0 else max(1, n)
    s0, s1 = seeds if seeds is not None else noise_seeds(generator)
    qdt = level_dtype(levels)
    lib = _native.use(flat) if qdt in (torch.int8, torch.int16) and n < 2**32 else None
    if lib is not None:
        nb = (n + b - 1) // b
        norms = scratch_buffer(scratch, "qsgd_norms", nb, flat.dtype, flat.device)
        q = scratch_buffer(scratch, "qsgd_levels", n, qdt, flat.device)
        tag = f"{_native.SUFFIX[flat.dtype]}_{'i8' if qdt == torch.int8 else 'i16'}"
        getattr(lib, f"qsgd_quantize_{tag}")(
            flat.data_ptr(), n, b, float(levels), s0, s1, norms.data_ptr(), q.data_ptr()
        )
        return norms, q
    pad = (-n) % b
    work = flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat
    if pad:
        work = torch.cat([work, work.new_zeros(pad)])
    mat = work.view(-1, b)
    norms = torch.linalg.vector_norm(mat, dim=1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    scaled = mat.abs() * (levels / safe).unsqueeze(1)
    counter = torch.arange(mat.numel(), dtype=torch.int64, device=mat.device)
    noise = _native.hash_uniform24(counter, s0, s1).to(scaled.dtype).view_as(scaled)
    xi = torch.floor(scaled + noise).clamp_(max=levels)
    q = (xi * torch.sign(mat)).to(qdt).view(-1)[:n]
    return norms.to(flat.dtype), q


def qsgd_dequantize(
    norms: torch.Tensor,
    q: torch.Tensor,
    levels: int,
    bucket_size: int,
    numel: int,
    dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Inverse map: norm_bucket * level / s (into ``out`` when given)."""
    b = bucket_size if bucket_size > 0 else max(1, numel)
    lib = _native.use(norms) if q.dtype in (torch.int8, torch.int16) and q.is_contiguous() else None
    if lib is not None and norms.dtype == dtype and q.device.type == "cpu":
        res = dense_out({"out": out}, numel, dtype, norms.device, zero=False)
        tag = f"{_native.SUFFIX[dtype]}_{'i8' if q.dtype == torch.int8 else 'i16'}"
        getattr(lib, f"qsgd_dequantize_{tag}")(
            q.data_ptr(), numel, b, norms.data_ptr(), float(levels), res.data_ptr()
        )
        return res
    pad = (-numel) % b
    qf = q.to(dtype if dtype not in (torch.float16, torch.bfloat16) else torch.float32)
    if pad:
        qf = torch.cat([qf, qf.new_zeros(pad)])
    res = qf.view(-1, b) * (norms.to(qf.dtype) / levels).unsqueeze(1)
    res = res.view(-1)[:numel].to(dtype)
    if out is not None and out.numel() == numel and out.dtype == dtype:
        return out.reshape(-1).copy_(res)
    return res


class QSGDCompressor(Compressor):
    """QSGD with bucketed norms and int8/int16 levels.

    Args:
        levels: s, the number of positive quantization levels (>= 1).
        bucket_size: entries per norm (0: one norm for the whole tensor).
        seed: seed of a private generator for the rounding noise (null: global RNG).
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "qsgd"
    aggregation = "allgather"
    default_memory = False

    def __init__(
        self,
        levels: int = 127,
        *,
        bucket_size: int = 512,
        seed: int | None = None,
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.levels = check_int("levels", levels, 1)
        self.bucket_size = check_int("bucket_size", bucket_size, 0)
        self.seed = None if seed is None else check_int("seed", seed, 0)
        self._generator: torch.Generator | None = None
        if self.seed is not None:
            self._generator = torch.Generator(device="cpu").manual_seed(self.seed)

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        flat = tensor.reshape(-1)
        norms, q = qsgd_quantize(
            flat, self.levels, self.bucket_size, self._generator, scratch=scratch_of(state)
        )
        return Payload((norms, q), {"numel": flat.numel(), "dtype": flat.dtype})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        norms, q = payload.tensors
        meta = payload.meta
        out = qsgd_dequantize(
            norms, q, self.levels, self.bucket_size, meta["numel"], meta["dtype"], meta.get("out")
        )
        return out.reshape(shape)
