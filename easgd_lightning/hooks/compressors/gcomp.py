"""``gcomp``: near-lossless float coding (GComp, SoCC 2024).

Rule, per tensor (float32; float16 / bfloat16 are coded through float32, exactly; float64
with its own 11-bit exponents and 52-bit mantissa):
  1. mantissa: keep the top ``b = mantissa_bits`` bits, rounded to nearest (ties to even,
     the carry may raise the exponent; a finite value never rounds up to infinity);
     ``b`` = the full width (23 for float32) changes nothing: the coding is lossless.
  2. symbols: the (rounded) biased exponent of each entry, or ZERO for +0.0 (zero pruning:
     a zero sends its symbol alone, no sign, no mantissa; -0.0 keeps its sign), or NAN for
     a NaN whose payload lies below the kept mantissa bits (its symbol alone: it decodes
     as the quiet NaN, where cutting its payload would have made it an infinity; a NaN
     with a kept payload bit travels as any value, so the full width stays lossless);
  3. a canonical Huffman code built from this tensor's symbol histogram (code lengths at
     most 16) codes the symbols; the code travels with the payload as (symbol, length)
     pairs, so every rank decodes every other rank's message without agreeing first;
  4. every non-zero entry adds its sign bit and its b mantissa bits, fixed width.
Message (one uint8 tensor, all-gathered): ``u16 count | count x u16 symbol | count x u8
length | u32 bytes of the symbol stream | ceil(n / B) x u32 block start | symbol stream |
sign-and-mantissa stream``; ``payload_bytes`` is its length, the real coded size. Streams
are little-endian bit strings: a field starts at its bit offset and its lowest bit comes
first. The symbols are cut into blocks of B = block_size(n) (sqrt n rounded up to a power
of two, in [64, 4096]) and the bit offset where each block starts is sent (32 bits per B
entries, <= 0.5 bit per entry, ~0.01 at 25M entries).
Decoding a prefix code is sequential within a block; all blocks are decoded at once, one
symbol per block per round (B rounds of a 2^16-entry table lookup over n / B positions),
so the work is O(n) tensor ops with B Python-level rounds; encoding is O(n) tensor ops.
Defaults: mantissa_bits 7 (bfloat16's precision), memory false, min_numel 16384.
Fused exchange (:mod:`easgd_lightning.hooks._fused`): one payload per exchange -- each
tensor's own message (its own histogram and code: the code is per tensor), laid end to end
after their lengths --, one message per rank, each rank's payload decoded and added in
one pass over the tensors; coding and decoding stay per tensor (a loop over the tensors).
"""

from __future__ import annotations

import heapq
import math

import torch

from easgd_lightning.hooks.compressors.base import (
    Compressor,
    Payload,
    check_int,
    scratch_buffer,
    scratch_of,
)
from easgd_lightning.hooks.compressors.segments import Segments

__all__ = [
    "GCompCompressor",
    "FLOAT_LAYOUT",
    "huffman_lengths",
    "canonical_codes",
    "pack_fields",
    "read_fields",
    "gcomp_encode",
    "gcomp_decode",
    "block_size",
]

#: dtype -> (integer view, exponent bits, mantissa bits)
FLOAT_LAYOUT = {torch.float32: (torch.int32, 8, 23), torch.float64: (torch.int64, 11, 52)}
MAX_CODE_LEN = 16


def huffman_lengths(counts: dict[int, int], limit: int = MAX_CODE_LEN) -> dict[int, int]:
    """Huffman code lengths of the symbols with count > 0, at most ``limit`` bits (counts
    are halved, rounding up, until the code fits; a lone symbol gets 1 bit)."""
    counts = {s: c for s, c in counts.items() if c > 0}
    if len(counts) == 1:
        return {next(iter(counts)): 1}
    while True:
        heap = [(c, i, (s,)) for i, (s, c) in enumerate(sorted(counts.items()))]
        heapq.heapify(heap)
        depth = dict.fromkeys(counts, 0)
        tie = len(heap)
        while len(heap) > 1:
            c1, _, s1 = heapq.heappop(heap)
            c2, _, s2 = heapq.heappop(heap)
            for s in s1 + s2:
                depth[s] += 1
            heapq.heappush(heap, (c1 + c2, tie, s1 + s2))
            tie += 1
        if max(depth.values()) <= limit:
            return depth
        counts = {s: (c + 1) // 2 for s, c in counts.items()}


def canonical_codes(lengths: dict[int, int]) -> dict[int, int]:
    """Canonical prefix codes (by length, then symbol), bit-reversed so that the code's
    first bit is its lowest (the streams are read from the lowest bit up)."""
    codes, code, prev = {}, 0, 0
    for sym, ln in sorted(lengths.items(), key=lambda kv: (kv[1], kv[0])):
        code <<= ln - prev
        prev = ln
        codes[sym] = int(f"{code:0{ln}b}"[::-1], 2)
        code += 1
    return codes


def pack_fields(values: torch.Tensor, widths: torch.Tensor, total_bits: int) -> torch.Tensor:
    """Little-endian bit string (uint8) of ``values`` (int64, each < 2^width, widths <= 32)
    written back to back from bit 0."""
    nwords = total_bits // 32 + 2
    offsets = torch.cumsum(widths, 0) - widths
    word, shift = offsets >> 5, offsets & 31
    lo = (values << shift) & 0xFFFFFFFF
    hi = torch.where(shift > 0, values >> (32 - shift).clamp(max=31), torch.zeros_like(values))
    hi = torch.where(shift + widths > 32, hi, torch.zeros_like(hi))
    words = torch.zeros(nwords, dtype=torch.int64)
    words.index_add_(0, word, lo)  # disjoint bits: adding is OR
    words.index_add_(0, word + 1, hi)
    out = words.to(torch.int32).view(torch.uint8)  # low 32 bits of each word, little-endian
    return out[: (total_bits + 7) // 8]


def _words_of(stream: torch.Tensor, bits: int) -> torch.Tensor:
    """The uint8 stream as non-negative int64 32-bit words (zero padded past ``bits``)."""
    nwords = bits // 32 + 2
    padded = torch.zeros(nwords * 4, dtype=torch.uint8)
    padded[: stream.numel()] = stream
    return padded.view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def read_fields(words: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:
    """The ``width``-bit (<= 32) fields starting at bit ``offsets`` of the 32-bit ``words``."""
    word, shift = offsets >> 5, offsets & 31
    pair = words[word] | ((words[word + 1] & 0x7FFFFFFF) << 32)
    return (pair >> shift) & ((1 << width) - 1)


def block_size(numel: int) -> int:
    """Symbols per independently decodable block: sqrt(n) rounded up to a power of two,
    clamped to [64, 4096] (fewer Python-level decode rounds, little offset overhead)."""
    root = max(1, math.isqrt(max(numel - 1, 0)) + 1)
    return min(4096, max(64, 1 << (root - 1).bit_length()))


def _round_mantissa(mag: torch.Tensor, drop: int, exp_bits: int, man_bits: int) -> torch.Tensor:
    """Round the magnitude bit patterns ``mag`` (int64) to ``drop`` fewer mantissa bits,
    to nearest, ties to even; finite values stay finite."""
    if drop == 0:
        return mag
    inf_bits = ((1 << exp_bits) - 1) << man_bits
    half = 1 << (drop - 1)
    r = ((mag + half - 1 + ((mag >> drop) & 1)) >> drop) << drop
    finite = mag < inf_bits
    largest = inf_bits - (1 << drop)
    return torch.where(finite, torch.clamp(r, max=largest), mag)


def gcomp_encode(x: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """The message of the module docstring for the 1-D float32/float64 ``x`` (CPU)."""
    int_dt, eb, mb = FLOAT_LAYOUT[x.dtype]
    b = min(mantissa_bits, mb)
    total = 1 + eb + mb
    if x.numel() == 0:
        return torch.zeros(6, dtype=torch.uint8)  # no symbols, empty streams
    raw = x.contiguous().view(int_dt).to(torch.int64)
    if total == 32:
        raw = raw & 0xFFFFFFFF
    sign = (raw >> (total - 1)) & 1
    mag = _round_mantissa(raw & ((1 << (total - 1)) - 1), mb - b, eb, mb)
    zero_sym, nan_sym = 1 << eb, (1 << eb) + 1
    is_zero = (mag == 0) & (sign == 0)
    # a NaN whose kept mantissa bits are all zero would decode as an infinity
    is_nan = (mag > (((1 << eb) - 1) << mb)) & (((mag & ((1 << mb) - 1)) >> (mb - b)) == 0)
    sym = torch.where(is_zero, zero_sym, torch.where(is_nan, nan_sym, mag >> mb))
    hist = torch.bincount(sym, minlength=nan_sym + 1)
    present = torch.nonzero(hist).squeeze(1)
    lengths = huffman_lengths(dict(zip(present.tolist(), hist[present].tolist())))
    codes = canonical_codes(lengths)
    code_tab = torch.zeros(nan_sym + 1, dtype=torch.int64)
    len_tab = torch.zeros(nan_sym + 1, dtype=torch.int64)
    syms = torch.tensor(sorted(lengths), dtype=torch.int64)
    code_tab[syms] = torch.tensor([codes[s] for s in syms.tolist()], dtype=torch.int64)
    len_tab[syms] = torch.tensor([lengths[s] for s in syms.tolist()], dtype=torch.int64)
    widths = len_tab[sym]
    a_bits = int(widths.sum())
    if a_bits >= 1 << 32:
        raise ValueError("compression=gcomp: a tensor's symbol stream must stay under 2^32 bits")
    stream_a = pack_fields(code_tab[sym], widths, a_bits)
    starts = (torch.cumsum(widths, 0) - widths)[:: block_size(x.numel())]
    nz = ~(is_zero | is_nan)
    # sign and b mantissa bits per non-zero entry, in chunks of at most 32 bits
    field = (sign[nz] << b) | ((mag[nz] & ((1 << mb) - 1)) >> (mb - b))
    width = 1 + b
    chunks = [(c, min(32, width - c)) for c in range(0, width, 32)]
    vals = torch.stack([(field >> c) & ((1 << w) - 1) for c, w in chunks], 1).reshape(-1)
    wids = torch.tensor([w for _, w in chunks], dtype=torch.int64).repeat(field.numel())
    stream_b = pack_fields(vals, wids, int(field.numel()) * width)
    header = [
        torch.tensor([syms.numel()], dtype=torch.int16).view(torch.uint8),
        syms.to(torch.int16).view(torch.uint8),
        torch.tensor([lengths[s] for s in syms.tolist()], dtype=torch.uint8),
        torch.tensor([stream_a.numel()], dtype=torch.int32).view(torch.uint8),
        # u32 words (bits < 2^32); a fresh tensor: a one-block slice keeps its stride B
        torch.empty(starts.numel(), dtype=torch.int32).copy_(starts).view(torch.uint8),
    ]
    return torch.cat([*header, stream_a, stream_b])


def _decode_table(syms: list[int], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbol, length) for every 16-bit window whose lowest bits are a code."""
    codes = canonical_codes(dict(zip(syms, lens)))
    lut_sym = torch.zeros(1 << MAX_CODE_LEN, dtype=torch.int64)
    lut_len = torch.ones(1 << MAX_CODE_LEN, dtype=torch.int64)
    for s, ln in zip(syms, lens):
        idx = codes[s] + (torch.arange(1 << (MAX_CODE_LEN - ln), dtype=torch.int64) << ln)
        lut_sym[idx] = s
        lut_len[idx] = ln
    return lut_sym, lut_len


def gcomp_decode(msg: torch.Tensor, numel: int, dtype: torch.dtype, mantissa_bits: int) -> torch.Tensor:
    """Inverse of :func:`gcomp_encode`: the 1-D tensor of ``numel`` entries."""
    int_dt, eb, mb = FLOAT_LAYOUT[dtype]
    b = min(mantissa_bits, mb)
    total = 1 + eb + mb
    msg = msg.cpu().contiguous()
    count = int(msg[:2].clone().view(torch.int16).item())
    pos = 2
    syms = msg[pos : pos + 2 * count].clone().view(torch.int16).to(torch.int64).tolist()
    pos += 2 * count
    lens = msg[pos : pos + count].to(torch.int64).tolist()
    pos += count
    a_bytes = int(msg[pos : pos + 4].clone().view(torch.int32).item())
    pos += 4
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    bsize = block_size(numel)
    nblocks = -(-numel // bsize)
    bit = msg[pos : pos + 4 * nblocks].clone().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    pos += 4 * nblocks
    stream_a, stream_b = msg[pos : pos + a_bytes], msg[pos + a_bytes :]
    lut_sym, lut_len = _decode_table(syms, lens)
    lut = (lut_sym << 5) | lut_len  # one lookup gives both (lengths <= 16 < 32)
    a_bits = 8 * a_bytes
    words = _words_of(stream_a, a_bits)
    pair = words[:-1] | (words[1:] << 32)  # word w and the next: any 16-bit window at w
    # every block at once, one symbol per round (positions past the end read zeros)
    sym = torch.empty(bsize, nblocks, dtype=torch.int64)
    for i in range(bsize):
        entry = lut[(pair[bit >> 5] >> (bit & 31)) & ((1 << MAX_CODE_LEN) - 1)]
        sym[i] = entry
        bit = torch.clamp_(bit + (entry & 31), max=a_bits)
    sym = sym.t().reshape(-1)[:numel] >> 5
    zero_sym, nan_sym = 1 << eb, (1 << eb) + 1
    nz = (sym != zero_sym) & (sym != nan_sym)
    m = int(nz.sum())
    width = 1 + b
    bwords = _words_of(stream_b, m * width)
    field = torch.zeros(m, dtype=torch.int64)
    base = torch.arange(m, dtype=torch.int64) * width
    for c in range(0, width, 32):
        field |= read_fields(bwords, base + c, min(32, width - c)) << c
    bits = torch.zeros(numel, dtype=torch.int64)
    mant = (field & ((1 << b) - 1)) << (mb - b)
    sign = field >> b
    bits[nz] = (sign << (total - 1)) | (sym[nz] << mb) | mant
    bits[sym == nan_sym] = ((1 << (eb + 1)) - 1) << (mb - 1)  # the canonical quiet NaN
    if total == 32:
        bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return bits.to(int_dt).view(dtype)


class GCompCompressor(Compressor):
    """GComp: Huffman-coded exponents, rounded mantissas, pruned zeros (all-gathered).

    Args:
        mantissa_bits: mantissa bits kept (0..23 for float32; 23, or more, is lossless;
            float64 keeps up to 52).
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "gcomp"
    aggregation = "allgather"
    default_memory = False
    fused_segments = True

    def __init__(self, mantissa_bits: int = 7, *, min_numel: int | None = None, memory: bool | None = None) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.mantissa_bits = check_int("compression.mantissa_bits", mantissa_bits, 0, 52)

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        flat = tensor.reshape(-1)
        coded_dt = flat.dtype if flat.dtype in FLOAT_LAYOUT else torch.float32
        msg = gcomp_encode(flat.detach().to("cpu", coded_dt), self.mantissa_bits)
        state["last_payload_bytes"] = int(msg.numel())
        return Payload(
            (msg.to(tensor.device),),
            {"numel": flat.numel(), "dtype": flat.dtype, "coded_dtype": coded_dt},
        )

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        meta = payload.meta
        (msg,) = payload.tensors
        flat = gcomp_decode(msg, meta["numel"], meta["coded_dtype"], self.mantissa_bits)
        out = flat.to(device=msg.device, dtype=meta["dtype"]).reshape(shape)
        dst = meta.get("out")
        if dst is not None and dst.numel() == out.numel() and dst.dtype == out.dtype:
            return dst.view(shape).copy_(out)
        return out

    def compress_segments(self, flat: torch.Tensor, segments: Segments, state: dict) -> Payload:
        """(each segment's message length, the messages end to end): every segment coded
        by its own rule, as :meth:`compress` on it alone."""
        coded_dt = flat.dtype if flat.dtype in FLOAT_LAYOUT else torch.float32
        work = flat.detach().to("cpu", coded_dt)
        msgs = [gcomp_encode(work[off : off + n], self.mantissa_bits) for off, n in segments]
        lengths = torch.tensor([m.numel() for m in msgs], dtype=torch.int32)  # bytes of each (< 2 GiB)
        state["last_payload_bytes"] = int(lengths.sum())
        return Payload((lengths.to(flat.device), torch.cat(msgs).to(flat.device)),
                       {"dtype": flat.dtype, "coded_dtype": coded_dt})

    def _add_segments(self, out: torch.Tensor, tensors, meta: dict, segments: Segments) -> None:
        """out += one rank's decoded payload on every segment."""
        lengths, msgs = tensors
        pos = 0
        for (off, n), size in zip(segments, lengths.tolist()):
            seg = gcomp_decode(msgs[pos : pos + size], n, meta["coded_dtype"], self.mantissa_bits)
            out[off : off + n] += seg.to(device=out.device, dtype=out.dtype)
            pos += size

    def local_segments(self, payload: Payload, segments: Segments, state: dict) -> torch.Tensor:
        out = scratch_buffer(scratch_of(state), "local", segments.numel, payload.meta["dtype"], payload.tensors[1].device)
        out.zero_()
        self._add_segments(out, payload.tensors, payload.meta, segments)
        return out

    def mean_segments(self, received, meta: dict, segments: Segments, out: torch.Tensor, world: int) -> None:
        """Every rank's decoded messages added in rank order into ``out``, then / world (the
        whole buffer: the attach point writes the dense runs afterwards)."""
        out.zero_()
        for tensors in received:
            self._add_segments(out, tensors, meta, segments)
        out.div_(world)

    @staticmethod
    def volume_reduction(dense_bytes: int, coded_bytes: int) -> float:
        """1 - coded / dense (the paper's "less volume")."""
        return 1.0 - coded_bytes / dense_bytes if dense_bytes else math.nan
