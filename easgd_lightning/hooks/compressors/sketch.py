"""``sketch``: S2 Reducer-style sparse communication (Ge et al., 2021).

Rule: each rank sparsifies g (top ``ratio`` of |g| with residuals) and sends, in two
fixed-size mergeable messages instead of an all-gather:
  1. a bitmap of its non-zero positions, OR-reduced (bit-packed with a bitwise-OR
     all-reduce when the collective offers one, else a byte-per-entry max all-reduce);
  2. a count sketch S[j, h_j(i)] += s_j(i) g_i (``rows`` hash rows, width =
     ceil(overhead |U| / rows) for the union U of positions), summed by all-reduce.
Decoding at U: peel cells holding a single position (exact). Peeling can stop with a
remainder (a 2-core: every cell left holds two or more undecoded positions; at the
defaults, unions of a few entries in a few percent of draws); the decoder knows that
remainder, and every rank finds the same one in the summed sketch, so its entries travel
exactly in a third, small all-reduce (their values, in the remainder's order): nothing is
lost and no residual misses what the decode got wrong. A single rank's payload
(``compress``) carries its own remainder's values the same way. Hashes h_j(i) =
((a_j i + b_j) mod P) mod width, P = 2^31 - 1, drawn from a seed shared by all ranks and
the step counter. Defaults: ratio = 0.01, rows = 3, overhead = 1.5, seed = 0, memory = true.
"""

from __future__ import annotations

import math
import zlib

import torch

from easgd_lightning.hooks.compressors.base import (
    Collective,
    Compressor,
    Payload,
    check_int,
    check_ratio,
    pack_bits,
    run_rounds,
    scratch_buffer,
    scratch_of,
    start_collective,
    unpack_bits,
    wants_local,
)
from easgd_lightning.hooks.compressors.segments import SEGMENT_STATES, Segments
from easgd_lightning.hooks.compressors.topk import topk_indices
from easgd_lightning.utils.checks import check_float

__all__ = [
    "SketchCompressor",
    "sketch_hashes",
    "build_sketch",
    "peel_decode",
    "or_reduce_bits",
    "start_or_reduce_bits",
]

_PRIME = 2**31 - 1


def sketch_hashes(
    positions: torch.Tensor, rows: int, width: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucket (rows x len) and sign (+-1) of every position, identical on every rank."""
    gen = torch.Generator(device="cpu").manual_seed(seed & 0x7FFFFFFF)
    coef = torch.randint(1, _PRIME, (4, rows, 1), generator=gen, dtype=torch.int64)
    coef = coef.to(positions.device)
    pos = positions.to(torch.int64).view(1, -1)
    cols = ((coef[0] * pos + coef[1]) % _PRIME) % width
    signs = (((coef[2] * pos + coef[3]) % _PRIME) & 1) * 2 - 1
    return cols, signs


def build_sketch(
    values: torch.Tensor, cols: torch.Tensor, signs: torch.Tensor, width: int
) -> torch.Tensor:
    """Count sketch (rows x width) of ``values`` at the hashed buckets."""
    rows = cols.shape[0]
    offsets = (torch.arange(rows, device=cols.device) * width).view(-1, 1)
    out = torch.zeros(rows * width, dtype=values.dtype, device=values.device)
    out.index_add_(0, (cols + offsets).reshape(-1), (signs.to(values.dtype) * values).reshape(-1))
    return out.view(rows, width)


def peel_decode(
    sketch: torch.Tensor, cols: torch.Tensor, signs: torch.Tensor, max_core: int = 2048,
    *, return_core: bool = False,
):
    """Values of the len(cols[0]) positions summed into ``sketch``.

    Repeatedly reads cells that hold exactly one undecoded position (exact) and subtracts
    the decoded positions from all their cells; what remains (a 2-core) is estimated by
    least squares when it has at most ``max_core`` positions, else by the median of the
    rows. ``return_core``: also return the indices (into the positions) that peeling left
    undecoded, whose values are only estimates.
    """
    rows, width = sketch.shape
    u = cols.shape[1]
    work_dtype = torch.float64
    s = sketch.reshape(-1).to(work_dtype).clone()
    offsets = (torch.arange(rows, device=cols.device) * width).view(-1, 1)
    cells = cols + offsets
    sg = signs.to(work_dtype)
    values = torch.zeros(u, dtype=work_dtype, device=sketch.device)
    remaining = torch.ones(u, dtype=torch.bool, device=sketch.device)
    counts = torch.bincount(cells.reshape(-1), minlength=rows * width)
    col_ar = torch.arange(u, device=cols.device)
    while True:
        rem = torch.nonzero(remaining).squeeze(1)
        if rem.numel() == 0:
            break
        c = cells[:, rem]
        pure = counts[c] == 1
        any_pure = pure.any(dim=0)
        if not bool(any_pure.any()):
            break
        items = rem[any_pure]
        first_row = pure[:, any_pure].to(torch.int8).argmax(dim=0)
        val = s[cells[first_row, items]] * sg[first_row, items]
        values[items] = val
        s.index_add_(0, cells[:, items].reshape(-1), -(sg[:, items] * val).reshape(-1))
        counts -= torch.bincount(cells[:, items].reshape(-1), minlength=rows * width)
        remaining[items] = False
    core = torch.nonzero(remaining).squeeze(1)
    if core.numel():
        cc = cells[:, core]
        if core.numel() <= max_core:
            touched, inv = torch.unique(cc.reshape(-1), return_inverse=True)
            a = torch.zeros(touched.numel(), core.numel(), dtype=work_dtype, device=s.device)
            colidx = col_ar[: core.numel()].repeat(rows)
            a.index_put_((inv, colidx), sg[:, core].reshape(-1), accumulate=True)
            sol = torch.linalg.lstsq(a.cpu(), s[touched].cpu().unsqueeze(1)).solution
            values[core] = sol.squeeze(1).to(values.device)
        else:
            values[core] = (s[cc] * sg[:, core]).median(dim=0).values
    return (values.to(sketch.dtype), core) if return_core else values.to(sketch.dtype)


def or_reduce_bits(collective: Collective, bits: torch.Tensor) -> torch.Tensor:
    """Bitwise OR over ranks of a bool vector (bit-packed when the collective can OR)."""
    return start_or_reduce_bits(collective, bits)()


def start_or_reduce_bits(collective: Collective, bits: torch.Tensor):
    """:func:`or_reduce_bits` launched (non-blocking where the collective has
    ``all_reduce_bor_async``); returns ``finish``, which waits and gives the OR."""
    n = bits.numel()
    if callable(getattr(collective, "all_reduce_bor", None)):
        pending = start_collective(collective, "all_reduce_bor", [pack_bits(bits)])
        return lambda: unpack_bits(pending.wait()[0], n)
    (out,) = collective.all_reduce_max([bits.to(torch.uint8)])  # blocking: done already
    return lambda: out.bool()


class SketchCompressor(Compressor):
    """Bitmap + count sketch: fixed-size, mergeable, one all-reduce per message.

    Args:
        ratio: fraction of entries each rank keeps before sketching, in (0, 1].
        rows: hash rows of the count sketch (>= 1; 3 peels well).
        overhead: sketch cells per union position (>= 1.0; more cells leave a peeling
            remainder, which travels exactly, less often).
        seed: hash seed shared by all ranks.
        max_core: accepted for older configs; the remainder now travels exactly.
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "sketch"
    search_knob = "ratio"
    aggregation = "allreduce"
    exchange_rounds = 2  # the bitmap OR, then the sketch sum
    default_memory = True
    fused_segments = True  # in the multi-round form: rounds_segments
    segment_state = True  # each tensor's step (its hash seed) and counts (segment_states)

    def __init__(
        self,
        ratio: float = 0.01,
        *,
        rows: int = 3,
        overhead: float = 1.5,
        seed: int = 0,
        max_core: int = 2048,
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.ratio = check_ratio("compression.ratio", ratio)
        self.rows = check_int("compression.rows", rows, 1)
        self.overhead = check_float("compression.overhead", overhead, 1.0)
        self.seed = check_int("compression.seed", seed, 0)
        self.max_core = check_int("compression.max_core", max_core, 0)

    def _width(self, union: int) -> int:
        return max(1, math.ceil(self.overhead * union / self.rows))

    def _seed(self, state: dict) -> int:
        key = f"{self.seed}:{state.get('key_hash', 0)}:{state.get('step', 0)}"
        return zlib.crc32(key.encode())

    def _sparsify(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = topk_indices(flat, self.ratio)
        bits = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
        bits[idx] = True
        return idx, bits

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        """Single-rank encoding: packed bitmap and the sketch of this rank's entries."""
        flat = tensor.reshape(-1)
        idx, bits = self._sparsify(flat)
        positions = torch.nonzero(bits).squeeze(1)
        width = self._width(positions.numel())
        seed = self._seed(state)
        state["step"] = int(state.get("step", 0)) + 1
        cols, signs = sketch_hashes(positions, self.rows, width, seed)
        sk = build_sketch(flat[positions], cols, signs, width)
        _, core = peel_decode(sk, cols, signs, 0, return_core=True)
        meta = {"numel": flat.numel(), "width": width, "seed": seed, "dtype": flat.dtype}
        return Payload((pack_bits(bits), sk, flat[positions[core]].clone()), meta)

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        packed, sk, exact = payload.tensors
        meta = payload.meta
        positions = torch.nonzero(unpack_bits(packed, meta["numel"])).squeeze(1)
        out = torch.zeros(meta["numel"], dtype=sk.dtype, device=sk.device)
        if positions.numel():
            cols, signs = sketch_hashes(positions, self.rows, sk.shape[1], meta["seed"])
            values, core = peel_decode(sk, cols, signs, 0, return_core=True)
            values[core] = exact  # the remainder peeling left, sent exactly
            out[positions] = values
        return out.reshape(shape)

    def aggregate(
        self, tensor: torch.Tensor, state: dict, collective: Collective
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """OR the bitmaps, then sum the sketches of the union; decode at the union."""
        return run_rounds(self.aggregate_rounds(tensor, state, collective))

    def aggregate_rounds(self, tensor: torch.Tensor, state: dict, collective: Collective):
        """:meth:`aggregate` as a generator that yields after launching each round
        (non-blocking where the collective can) and returns (mean, local): round 1 the
        bitmap OR, round 2 (when the union is not empty, on every rank alike) the sketch
        sum. The exchange drives every tensor's round 1, then every tensor's round 2: with
        lazy all-reduce one OR buffer and one sum buffer per exchange, not two messages per
        tensor. ``tensor`` must not change until the generator returns."""
        flat = tensor.reshape(-1)
        world = collective.world_size
        idx, bits = self._sparsify(flat)
        local = torch.zeros_like(flat)
        local[idx] = flat[idx]
        finish_or = start_or_reduce_bits(collective, bits)
        yield
        positions = torch.nonzero(finish_or()).squeeze(1)
        seed = self._seed(state)
        state["step"] = int(state.get("step", 0)) + 1
        state["last_nnz"] = int(idx.numel())
        state["last_union"] = int(positions.numel())
        mean = torch.zeros_like(flat)
        if positions.numel():
            width = self._width(positions.numel())
            cols, signs = sketch_hashes(positions, self.rows, width, seed)
            sk = build_sketch(local[positions], cols, signs, width)
            pending = start_collective(collective, "all_reduce_sum", [sk])
            yield
            (summed,) = pending.wait()
            values, core = peel_decode(summed, cols, signs, 0, return_core=True)
            state["last_core"] = int(core.numel())
            if core.numel():  # the same remainder on every rank: its entries travel exactly
                pending = start_collective(collective, "all_reduce_sum", [local[positions[core]]])
                yield
                (values[core],) = pending.wait()
            mean[positions] = values / world
        return mean.reshape(tensor.shape), local.reshape(tensor.shape)

    def rounds_segments(self, flat: torch.Tensor, segments: Segments, state: dict, collective, out: torch.Tensor):
        """The fused exchange's rounds: every segment's bitmap in ONE OR, every segment's
        sketch of the union in ONE sum, the peeling remainders (when any) in ONE more; each
        segment with its own top-k, hash seed and width; each segment's mean written into
        ``out``; returns this rank's transmitted buffer (None unless :func:`~.base.wants_local`)."""
        world = collective.world_size
        own = state.setdefault(SEGMENT_STATES, [{} for _ in range(len(segments))])
        hashes = segments.key_hashes or (0,) * len(segments)
        local = scratch_buffer(scratch_of(state), "local", flat.numel(), flat.dtype, flat.device).zero_()
        bits = torch.zeros(segments.total, dtype=torch.bool, device=flat.device)
        pos = 0
        for j, (off, n) in enumerate(segments):
            own[j]["key_hash"] = hashes[j]
            idx = topk_indices(flat[off : off + n], self.ratio)
            local[off + idx] = flat[off + idx]
            bits[pos + idx] = True
            own[j]["last_nnz"] = int(idx.numel())
            pos += n
        finish_or = start_or_reduce_bits(collective, bits)
        yield
        union, pos, plans, sketches = finish_or(), 0, [], []
        for (off, n), st in zip(segments, own):
            positions = torch.nonzero(union[pos : pos + n]).squeeze(1)
            pos += n
            seed = self._seed(st)
            st["step"] = int(st.get("step", 0)) + 1
            st["last_union"] = int(positions.numel())
            out[off : off + n].zero_()
            if not positions.numel():
                plans.append(None)
                continue
            width = self._width(positions.numel())
            cols, signs = sketch_hashes(positions, self.rows, width, seed)
            sketches.append(build_sketch(local[off + positions], cols, signs, width))
            plans.append((positions, cols, signs, sketches[-1].shape))
        decoded = []
        if sketches:
            pending = start_collective(collective, "all_reduce_sum", [torch.cat([s.reshape(-1) for s in sketches])])
            yield
            (summed,) = pending.wait()
            pos = 0
            for plan, st in zip(plans, own):
                if plan is None:
                    continue
                positions, cols, signs, shape = plan
                values, core = peel_decode(summed[pos : pos + shape.numel()].view(shape), cols, signs, 0, return_core=True)
                pos += shape.numel()
                st["last_core"] = int(core.numel())
                decoded.append((positions, values, core))
        live = [(off, plan) for (off, _), plan in zip(segments, plans) if plan is not None]
        exact = [local[off + positions[core]] for (off, _), (positions, _, core) in zip(live, decoded)]
        if any(e.numel() for e in exact):  # the same remainders on every rank: they travel exactly
            pending = start_collective(collective, "all_reduce_sum", [torch.cat(exact)])
            yield
            (summed,) = pending.wait()
            pos = 0
            for (_, values, core), e in zip(decoded, exact):
                values[core] = summed[pos : pos + e.numel()]
                pos += e.numel()
        for (off, _), (positions, values, _) in zip(live, decoded):
            out[off + positions] = values / world
        return local if wants_local(state) else None
