"""``qsgd``: stochastic quantization to s levels (Alistarh et al., NeurIPS 2017).

Rule, per bucket v of ``bucket_size`` entries: q_i = ||v||_2 sign(v_i) xi_i / s with
xi_i = floor(s |v_i| / ||v||_2 + U[0, 1)), i.e. s|v_i|/||v|| rounded up with probability
equal to its fractional part, so E[q] = v (unbiased) and Var <= min(d/s^2, sqrt(d)/s) ||v||^2.
Wire: one norm per bucket (value dtype) + each signed level packed in
w = ceil(log2(s + 1)) + 1 bits (the level's bits and a sign bit, as a w-bit two's
complement field, little-endian bit stream: :func:`pack_levels`), so s = 1 costs 2 bits
per entry, s = 7 four, s = 127 eight; per-rank norms make it non-linear, so payloads are
all-gathered. ``coding: elias`` sends the paper's Elias coding instead (section 3:
Elias omega codes of the gap to each nonzero level, its sign bit and its value, after the
count of nonzeros; variable length). Defaults: levels s = 127 (8 bits), bucket_size = 512
(the paper's bucketing), coding = fixed, memory = false (unbiased), seed = null (drawn from
the global RNG).

Noise: U_i comes from a counter-based hash of (i, two 32-bit words), 24-bit uniform
in [0, 1): the norm, rounding and cast are one pass per bucket in the native kernel
(float32 / float64 CPU tensors), and the eager path computes the same numbers. Widths 8
and 16 are the int8 / int16 levels themselves; other widths take one more pass over the
levels to pack them (and the decode reads the packed stream directly). The two
words of a call are :func:`noise_words` of (the stream seed -- ``seed``, or one draw from
torch's global RNG at the first call when it is null --, the tensor's ``key_hash``, the
tensor's call count ``state["noise_calls"]``): a function of the tensor and its step, not
of the order in which tensors are compressed. The stream seed is the compressor's
:meth:`~QSGDCompressor.state_dict` and the count is per-tensor state, so a resumed run
draws the noise of one that never stopped.

Fused exchange (:mod:`easgd_lightning.hooks._fused`, s <= 32767): one native call
quantizes every tensor of the exchange's buffer with its own buckets and noise words (the
same levels and norms as each tensor alone); the levels of all of them are packed in one
stream (fixed: up to a byte less per tensor than one stream each; Elias: one count and one
run of gaps across the tensors), and each rank's payload is decoded and added in one call.
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors import _native
from easgd_lightning.hooks.compressors.base import (
    Compressor,
    Payload,
    check_choice,
    check_int,
    dense_out,
    pack_bits,
    scratch_buffer,
    scratch_of,
    unpack_bits,
)
from easgd_lightning.hooks.compressors.segments import Segments

__all__ = [
    "QSGDCompressor",
    "level_dtype",
    "level_width",
    "pack_levels",
    "unpack_levels",
    "elias_encode",
    "elias_decode",
    "noise_seeds",
    "noise_words",
    "qsgd_quantize",
    "qsgd_dequantize",
]


def level_dtype(levels: int) -> torch.dtype:
    """Smallest signed integer dtype holding [-levels, levels]."""
    if levels <= 127:
        return torch.int8
    if levels <= 32767:
        return torch.int16
    return torch.int32


#: wire codings of the levels
CODINGS = ("fixed", "elias")


def level_width(levels: int) -> int:
    """Bits per entry on the wire: ceil(log2(s + 1)) for the level, one for the sign."""
    return int(levels).bit_length() + 1


def _packed_bytes(numel: int, width: int) -> int:
    return (numel * width + 7) // 8


def pack_levels(q: torch.Tensor, width: int, scratch: dict | None = None) -> torch.Tensor:
    """The signed levels ``q`` as ``width``-bit two's-complement fields in a little-endian
    bit stream (entry i in stream bits [i w, (i + 1) w); uint8, ceil(n w / 8) bytes).
    Widths 8 and 16 are the int8 / int16 levels' own bytes (no copy)."""
    q = q.reshape(-1)
    if width == 8 * q.element_size():
        return q.view(torch.uint8)
    n = q.numel()
    lib = _native.lib() if q.dtype in (torch.int8, torch.int16) and q.device.type == "cpu" else None
    if lib is not None and q.is_contiguous() and width <= 17:
        out = scratch_buffer(scratch, "qsgd_packed", _packed_bytes(n, width), torch.uint8, q.device)
        getattr(lib, f"qsgd_pack_{'i8' if q.dtype == torch.int8 else 'i16'}")(
            q.data_ptr(), n, width, out.data_ptr()
        )
        return out
    codes = q.to(torch.int64) & ((1 << width) - 1)
    shifts = torch.arange(width, device=q.device)
    return pack_bits(((codes.unsqueeze(1) >> shifts) & 1).bool().view(-1))


def unpack_levels(packed: torch.Tensor, numel: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_levels`: the ``numel`` signed levels (int64; eager)."""
    bits = unpack_bits(packed.reshape(-1), numel * width).view(numel, width).to(torch.int64)
    codes = (bits << torch.arange(width, device=packed.device)).sum(dim=1)
    return codes - ((codes >> (width - 1)) & 1) * (1 << width)  # sign-extend


def _bit_length(v: torch.Tensor) -> torch.Tensor:
    """Bits of each positive int64 (exact: compares against the powers of two)."""
    powers = 2 ** torch.arange(63, dtype=torch.int64, device=v.device)
    return (v.unsqueeze(-1) >= powers).sum(-1)


def _omega_segments(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Elias omega codes of the positive int64 ``v`` as (values, lengths) of shape (len(v), 7):
    the binary groups in writing order, then the closing 0; unused slots have length 0."""
    groups, lens = [], []
    cur = v.clone()
    for _ in range(6):  # 6 groups cover every int64 (63 -> 5 -> 2 -> 1)
        nb = _bit_length(cur)
        active = cur > 1
        groups.append(torch.where(active, cur, 0))
        lens.append(torch.where(active, nb, 0))
        cur = torch.where(active, nb - 1, cur)
    vals = torch.stack(groups[::-1] + [torch.zeros_like(v)], dim=1)
    return vals, torch.stack(lens[::-1] + [torch.ones_like(v)], dim=1)


def elias_encode(q: torch.Tensor) -> torch.Tensor:
    """QSGD's Elias coding of the signed levels ``q`` (uint8 stream; see _kernels.c):
    omega(nnz + 1), then per nonzero in index order omega(gap to the previous one, the first
    counted from -1), a sign bit (1: negative), omega(|level|). Eager form of the kernel."""
    q = q.reshape(-1).to(torch.int64)
    idx = torch.nonzero(q).squeeze(1)
    gaps = torch.diff(idx, prepend=idx.new_tensor([-1]))
    head_v, head_l = _omega_segments(idx.new_tensor([idx.numel() + 1]))
    gv, gl = _omega_segments(gaps)
    lv, ll = _omega_segments(q[idx].abs())
    sign = (q[idx] < 0).to(torch.int64).unsqueeze(1)
    vals = torch.cat([head_v.reshape(-1), torch.cat([gv, sign, lv], dim=1).reshape(-1)])
    lens = torch.cat([head_l.reshape(-1), torch.cat([gl, torch.ones_like(sign), ll], dim=1).reshape(-1)])
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=q.device), lens)
    starts = torch.cumsum(lens, 0) - lens
    j = torch.arange(seg.numel(), device=q.device) - starts[seg]  # bit j of its segment
    bits = (vals[seg] >> (lens[seg] - 1 - j)) & 1  # most significant first
    return pack_bits(bits.bool())


def elias_decode(stream: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of :func:`elias_encode`: the ``numel`` signed levels (int64; a plain loop over
    the stream's bits -- the kernel is the fast path)."""
    bits = unpack_bits(stream.reshape(-1).cpu(), stream.numel() * 8).tolist()
    pos = 0

    def bit() -> int:
        nonlocal pos
        pos += 1
        return int(bits[pos - 1]) if pos <= len(bits) else 0

    def omega() -> int:
        v = 1
        while bit():
            if v > 62:
                raise ValueError("qsgd: malformed Elias stream")
            w = 1
            for _ in range(v):
                w = (w << 1) | bit()
            v = w
        return v

    q = [0] * numel
    prev = -1
    for _ in range(omega() - 1):
        prev += omega()
        neg = bit()
        level = omega()
        if prev >= numel:
            raise ValueError("qsgd: malformed Elias stream (index past the tensor)")
        q[prev] = -level if neg else level
    return torch.tensor(q, dtype=torch.int64, device=stream.device)


def _elias_stream(q: torch.Tensor, scratch: dict | None) -> torch.Tensor:
    """:func:`elias_encode` with the kernel when it applies (the same bytes)."""
    lib = _native.lib() if q.dtype in (torch.int8, torch.int16) and q.device.type == "cpu" else None
    if lib is None or not q.is_contiguous():
        return elias_encode(q)
    encode = getattr(lib, f"qsgd_elias_encode_{'i8' if q.dtype == torch.int8 else 'i16'}")
    cap = max(16, scratch["qsgd_elias"].numel() if scratch and "qsgd_elias" in scratch else q.numel() // 4)
    while True:
        out = scratch_buffer(scratch, "qsgd_elias", cap, torch.uint8, q.device)
        bits = int(encode(q.data_ptr(), q.numel(), out.data_ptr(), cap))
        if bits <= 8 * cap:
            return out[: (bits + 7) // 8]
        cap = (bits + 7) // 8


def noise_seeds(generator: torch.Generator | None = None) -> tuple[int, int]:
    """Two 32-bit words for the rounding noise, drawn from ``generator`` (None: global RNG)."""
    w = torch.randint(0, 2**32, (2,), dtype=torch.int64, generator=generator)
    return int(w[0]), int(w[1])


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """A 64-bit finalizer (SplitMix64's): equal inputs give equal outputs, near ones far apart."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_words(stream_seed: int, key: int, call: int) -> tuple[int, int]:
    """The two 32-bit noise words of call number ``call`` on tensor ``key`` of a stream."""
    h = _mix64(_mix64(_mix64(stream_seed & _MASK64) ^ (key & _MASK64)) ^ (call & _MASK64))
    return h & 0xFFFFFFFF, h >> 32


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


def _aligned(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` contiguous and 2-byte aligned (a received buffer may be neither)."""
    packed = packed.contiguous()
    return packed.clone() if packed.storage_offset() % 2 else packed


class QSGDCompressor(Compressor):
    """QSGD with bucketed norms and levels packed in ceil(log2(s + 1)) + 1 bits each.

    Args:
        levels: s, the number of positive quantization levels (>= 1).
        bucket_size: entries per norm (0: one norm for the whole tensor).
        seed: seed of the rounding noise's stream (null: one draw from the global torch
            RNG at the first call).
        coding: ``fixed`` (w bits per entry, :func:`pack_levels`) or ``elias`` (the paper's
            Elias coding of the gaps between nonzero levels, their signs and values:
            :func:`elias_encode`; fewer bits when most levels are 0, i.e. small s).
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "qsgd"
    search_knob = "levels"
    aggregation = "allgather"
    default_memory = False

    def __init__(
        self,
        levels: int = 127,
        *,
        bucket_size: int = 512,
        seed: int | None = None,
        coding: str = "fixed",
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.levels = check_int("compression.levels", levels, 1)
        self.bucket_size = check_int("compression.bucket_size", bucket_size, 0)
        self.coding = check_choice("compression.coding", coding, CODINGS)
        self.width = level_width(self.levels)
        self._decode_scratch: dict = {}  # the unpacked int8 levels of the decode being run
        self.seed = None if seed is None else check_int("compression.seed", seed, 0)
        self._stream_seed: int | None = self.seed

    def _noise_words(self, state: dict) -> tuple[int, int]:
        """This call's noise words for the tensor of ``state`` (advances its call count)."""
        if self._stream_seed is None:
            self._stream_seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64))
        call = int(state.get("noise_calls", 0))
        state["noise_calls"] = call + 1
        return noise_words(self._stream_seed, int(state.get("key_hash", 0)), call)

    def state_dict(self) -> dict:
        """The noise stream's seed (None before the first call of an unseeded compressor)."""
        return {"stream_seed": self._stream_seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("stream_seed") is not None:
            self._stream_seed = int(state["stream_seed"])

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        flat = tensor.reshape(-1)
        scratch = scratch_of(state)
        norms, q = qsgd_quantize(
            flat, self.levels, self.bucket_size, seeds=self._noise_words(state), scratch=scratch
        )
        if self.coding == "elias":
            packed = _elias_stream(q, scratch)
        else:
            packed = pack_levels(q, self.width, scratch)
        return Payload((norms, packed), {"numel": flat.numel(), "dtype": flat.dtype})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        norms, packed = payload.tensors
        meta = payload.meta
        numel, dtype, out = meta["numel"], meta["dtype"], meta.get("out")
        w = self.width
        bucket = self.bucket_size or max(1, numel)
        if self.coding == "elias":
            lib = _native.use(norms)
            if lib is not None and norms.dtype == dtype and packed.device.type == "cpu":
                res = dense_out({"out": out}, numel, dtype, norms.device, zero=False)
                stream = packed.contiguous()
                bad = _native.fn(lib, "qsgd_elias_decode", dtype)(
                    stream.data_ptr(), stream.numel(), numel, bucket, norms.data_ptr(),
                    float(self.levels), res.data_ptr(),
                )
                if bad:
                    raise ValueError("qsgd: malformed Elias stream")
                return res.reshape(shape)
            q = elias_decode(packed, numel)
        elif w in (8, 16):  # the levels' own bytes
            q = _aligned(packed).view(torch.int8 if w == 8 else torch.int16)
        elif w < 8 and _native.use(norms) is not None and packed.device.type == "cpu":
            # int8 levels times 2^(8 - w), then the int8 decode with s 2^(8 - w): the same
            # products bit for bit (a power of two scales no mantissa)
            q8 = scratch_buffer(self._decode_scratch, "levels", numel, torch.int8, packed.device)
            _native.lib().qsgd_unpack_i8(packed.contiguous().data_ptr(), numel, w, q8.data_ptr())
            res = qsgd_dequantize(norms, q8, self.levels * 2 ** (8 - w), self.bucket_size, numel, dtype, out)
            return res.reshape(shape)
        else:
            lib = _native.use(norms)
            if lib is not None and norms.dtype == dtype and packed.device.type == "cpu" and w <= 17:
                res = dense_out({"out": out}, numel, dtype, norms.device, zero=False)
                _native.fn(lib, "qsgd_dequantize_packed", dtype)(
                    packed.contiguous().data_ptr(), numel, bucket,
                    norms.data_ptr(), float(self.levels), w, res.data_ptr(),
                )
                return res.reshape(shape)
            q = unpack_levels(packed, numel, w)
        res = qsgd_dequantize(norms, q, self.levels, self.bucket_size, numel, dtype, out)
        return res.reshape(shape)

    @property
    def fused_segments(self) -> bool:  # type: ignore[override]
        """One call per exchange for int8 / int16 levels (s <= 32767), either coding."""
        return self.levels <= 32767

    def _kernel(self, lib, name: str, dtype: torch.dtype):
        """The segmented kernel ``name`` for ``dtype`` values and this codec's level type."""
        wide = "_i16" if level_dtype(self.levels) == torch.int16 else ""
        return getattr(lib, f"{name}_{_native.SUFFIX[dtype]}{wide}")

    def compress_segments(self, flat: torch.Tensor, segments: Segments, state: dict) -> Payload:
        """(norms of every segment's buckets, one packed stream of all their levels)."""
        if self._stream_seed is None:
            self._stream_seed = int(torch.randint(0, 2**62, (1,), dtype=torch.int64))
        call = int(state.get("noise_calls", 0))
        state["noise_calls"] = call + 1
        keys = segments.key_hashes or (0,) * len(segments)
        nb = segments.cached(("qsgd_buckets", self.bucket_size), lambda: sum(
            -(-n // (self.bucket_size or n)) for n in segments.lengths))
        scratch = scratch_of(state)
        lib = _native.use(flat)
        if lib is not None and segments.total < 2**32:
            norms = scratch_buffer(scratch, "qsgd_norms", nb, flat.dtype, flat.device)
            q = scratch_buffer(scratch, "qsgd_levels", segments.total, level_dtype(self.levels), flat.device)
            off, lens = segments.arrays()
            self._kernel(lib, "qsgd_segments", flat.dtype)(
                flat.data_ptr(), len(segments), off.data_ptr(), lens.data_ptr(),
                segments.int64("key_hash", keys).data_ptr(), self.bucket_size, float(self.levels),
                self._stream_seed & _MASK64, call, norms.data_ptr(), q.data_ptr())
        else:  # eager: each segment as qsgd_quantize computes it alone
            parts = [qsgd_quantize(flat[o : o + n], self.levels, self.bucket_size,
                                   seeds=noise_words(self._stream_seed, k, call))
                     for (o, n), k in zip(segments, keys)]
            norms, q = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        packed = _elias_stream(q, scratch) if self.coding == "elias" else pack_levels(q, self.width, scratch)
        return Payload((norms, packed), {"dtype": flat.dtype})

    def _native_levels(self, packed: torch.Tensor, n: int) -> tuple[torch.Tensor, float]:
        """(the ``n`` levels as int8 / int16, the s they are scaled by) of one payload's
        level stream, for the segmented native decode."""
        levels, qtype = float(self.levels), level_dtype(self.levels)
        bits, w, tag = 8 * qtype.itemsize, self.width, "i8" if qtype == torch.int8 else "i16"
        if self.coding == "fixed" and w == bits:
            return _aligned(packed).view(qtype), levels
        q = scratch_buffer(self._decode_scratch, "levels", n, qtype, packed.device)
        stream = packed.contiguous()
        if self.coding == "elias":
            bad = getattr(_native.lib(), f"qsgd_elias_levels_{tag}")(
                stream.data_ptr(), stream.numel(), n, self.levels, q.data_ptr())
            if bad:
                raise ValueError("qsgd: malformed Elias stream")
            return q, levels
        # levels times 2^(bits - w) with s 2^(bits - w): the same products
        getattr(_native.lib(), f"qsgd_unpack_{tag}")(stream.data_ptr(), n, w, q.data_ptr())
        return q, levels * 2 ** (bits - w)

    def _add_segments(self, out: torch.Tensor, norms: torch.Tensor, packed: torch.Tensor, segments: Segments) -> None:
        """out += one rank's decoded payload on every segment."""
        w, n = self.width, segments.total
        lib = _native.use(out)
        if lib is not None and packed.device.type == "cpu" and norms.dtype == out.dtype:
            q, levels = self._native_levels(packed, n)
            off, lens = segments.arrays()
            norms = norms.contiguous()
            self._kernel(lib, "qsgd_dequantize_add_segments", out.dtype)(
                q.data_ptr(), len(segments), off.data_ptr(), lens.data_ptr(), self.bucket_size,
                norms.data_ptr(), levels, out.data_ptr())
            return
        q = elias_decode(packed, n) if self.coding == "elias" else unpack_levels(packed, n, w)
        pos, nb = 0, 0
        for off, k in segments:
            b = self.bucket_size or k
            m = -(-k // b)
            out[off : off + k] += qsgd_dequantize(norms[nb : nb + m], q[pos : pos + k], self.levels,
                                                  self.bucket_size, k, out.dtype)
            pos, nb = pos + k, nb + m

    def local_segments(self, payload: Payload, segments: Segments, state: dict) -> torch.Tensor:
        norms, packed = payload.tensors
        out = scratch_buffer(scratch_of(state), "local", segments.numel, payload.meta["dtype"], norms.device)
        out.zero_()
        self._add_segments(out, norms, packed, segments)
        return out

    def mean_segments(self, received, meta: dict, segments: Segments, out: torch.Tensor, world: int) -> None:
        """Every rank's decoded levels added in rank order, then / world (the whole buffer:
        the attach point writes the dense runs afterwards)."""
        out.zero_()
        for norms, packed in received:
            self._add_segments(out, norms, packed, segments)
        out.div_(world)
