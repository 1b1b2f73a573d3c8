"""``powersgd``: rank-r power iteration with warm start (Vogels, Karimireddy, Jaggi, NeurIPS 2019).

Rule, for a gradient reshaped to M (n x m) with error feedback M <- M + e and the
previous step's Q (m x r; first step: N(0, 1) drawn from one seed on every rank):
  P = M Q;  P <- allreduce_mean(P);  P <- orthonormalize(P)
  Q = M^T P;  Q_bar = allreduce_mean(Q);  mean = P Q_bar^T;  e <- M - P Q^T (local Q)
Bytes (n + m) r per element size instead of n m. 1-D tensors, and matrices for which
(n + m) r >= n m, travel dense (one all-reduce). Defaults: rank = 2, warm_start = true,
seed = 0, memory = true, matrix_view = leading.

The matrix view: ``leading`` keeps the first dimension, M = (shape[0], rest) (a weight:
output units by inputs); ``trailing`` keeps the last, M = (rest, shape[-1]) (an
activation or its gradient: tokens by hidden units, as Optimus-CC factors them). This one
codec serves every attach point: the DDP hook and the elastic exchange (per tensor,
:meth:`PowerSGDCompressor.aggregate`), Optimus-CC's selective stage compression (all of a
stage's matrices in two flat all-reduces, :meth:`PowerSGDCompressor.aggregate_many`) and
its compressed backpropagation (the single-rank encoding, :meth:`PowerSGDCompressor.compress`,
sent point-to-point).
Fused exchange (:mod:`easgd_lightning.hooks._fused`, the multi-round form):
:meth:`PowerSGDCompressor.rounds_segments` sends every matrix's P of the exchange's flat
buffer in one all-reduce (the tensors that travel dense in it too), then every Q in one;
each matrix keeps its own warm-started Q and step (``segment_states``); the matmuls are a
loop over the matrices (their shapes differ).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence

import torch

from easgd_lightning.hooks.compressors.base import (
    Collective,
    Compressor,
    Payload,
    check_bool,
    check_choice,
    check_int,
    may_write_residual,
    residual_written,
    run_rounds,
    scratch_buffer,
    scratch_of,
    start_collective,
    wants_local,
)
from easgd_lightning.hooks.compressors.segments import SEGMENT_STATES, Segments

__all__ = [
    "PowerSGDCompressor",
    "MATRIX_VIEWS",
    "orthonormalize",
    "as_matrix",
    "matrix_shape",
    "power_iteration",
    "low_rank_product",
    "times_factor",
    "transpose_times_factor",
]

MATRIX_VIEWS = ("leading", "trailing")


def matrix_shape(shape: Sequence[int], view: str = "leading") -> tuple[int, int]:
    """(n, m) of the matrix a tensor of ``shape`` is viewed as (see the module docstring)."""
    if len(shape) < 2:
        numel = math.prod(shape)
        return (numel, 1) if view == "leading" else (1, numel)
    if view == "leading":
        return int(shape[0]), int(math.prod(shape[1:]))
    return int(math.prod(shape[:-1])), int(shape[-1])


def as_matrix(tensor: torch.Tensor, view: str = "leading") -> torch.Tensor:
    """View a tensor as the matrix PowerSGD factorizes: (shape[0], rest) or (rest, shape[-1])."""
    return tensor.reshape(matrix_shape(tensor.shape, view))


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning p's columns (reduced QR; float32/64)."""
    work = p if p.dtype in (torch.float32, torch.float64) else p.float()
    q, _ = torch.linalg.qr(work, mode="reduced")
    return q.to(p.dtype)


def times_factor(mat: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """M Q (n x r, contiguous) for a factor Q of r << m columns, formed as (Q^T M^T)^T: the
    product then reads M once in its own row-major order. (``mat @ q`` with a few columns
    was 3.5x slower on one CPU thread at 4096 x 9216, r = 2.)"""
    return torch.mm(q.t().contiguous(), mat.t()).t().contiguous()


def transpose_times_factor(mat: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """M^T P (m x r, contiguous), formed as (P^T M)^T: one pass over M in row-major order (``mat.t() @
    p`` walks M by columns: 27x slower on one CPU thread at 4096 x 9216, r = 2)."""
    return torch.mm(p.t().contiguous(), mat).t().contiguous()


def power_iteration(mat: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One single-rank PowerSGD step: P = orth(M Q), Q' = M^T P; M_hat = P Q'^T.

    With r >= rank(M) and a generic Q, P spans M's column space, so M_hat = P P^T M = M.
    """
    p = orthonormalize(times_factor(mat, q))
    return p, transpose_times_factor(mat, p)


def low_rank_product(
    p: torch.Tensor, q: torch.Tensor, shape: Sequence[int], out: torch.Tensor | None = None
) -> torch.Tensor:
    """The rebuilt tensor P Q^T in ``shape``; written into ``out`` (a contiguous buffer of
    as many elements) when given, so a step allocates no full-size tensor."""
    if out is None:
        return (p @ q.t()).reshape(tuple(shape))
    return torch.mm(p, q.t(), out=out.view(p.shape[0], q.shape[0])).view(tuple(shape))


def subtract_low_rank(mat: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> None:
    """M <- M - P Q^T in place (one pass): the error-feedback residual of a rank-r send."""
    mat.addmm_(p, q.t(), alpha=-1)


def _all_reduce_flat(collective: Collective, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum each tensor over ranks with one flat all-reduce; the sums in the same shapes."""
    (flat,) = collective.all_reduce_sum([torch.cat([t.reshape(-1) for t in tensors])])
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset : offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


class PowerSGDCompressor(Compressor):
    """Low-rank compression by one step of subspace iteration, warm-started.

    Args:
        rank: r, the rank of the approximation (>= 1).
        warm_start: reuse the previous Q (otherwise a fresh seeded Q each step).
        seed: seed of the initial Q, identical on every rank.
        matrix_view: ``leading`` or ``trailing`` (see the module docstring).
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "powersgd"
    search_knob = "rank"
    aggregation = "allreduce"
    exchange_rounds = 2  # P, then Q
    fused_segments = True  # in the multi-round form: rounds_segments
    segment_state = True  # each tensor's warm start and step (the fused exchange's segment_states)
    default_memory = True

    def __init__(
        self,
        rank: int = 2,
        *,
        warm_start: bool = True,
        seed: int = 0,
        matrix_view: str = "leading",
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.rank = check_int("compression.rank", rank, 1)
        self.warm_start = check_bool("compression.warm_start", warm_start)
        self.seed = check_int("compression.seed", seed, 0)
        self.matrix_view = check_choice("compression.matrix_view", matrix_view, MATRIX_VIEWS)

    # ------------------------------------------------------------------ helpers
    def factor_shapes(self, shape: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """Shapes of (P, Q) for a tensor of ``shape``, or None when it travels dense
        (1-D, or the factors (n + m) r would not be smaller than n m)."""
        if len(shape) < 2:
            return None
        n, m = matrix_shape(shape, self.matrix_view)
        r = min(self.rank, n, m)
        if (n + m) * r >= n * m:
            return None
        return (n, r), (m, r)

    def compresses(self, shape: Sequence[int]) -> bool:
        """Whether a tensor of ``shape`` is factorized (else it travels dense)."""
        return self.factor_shapes(shape) is not None

    def _initial_q(self, m: int, r: int, state: dict, like: torch.Tensor) -> torch.Tensor:
        q = state.get("q")
        if self.warm_start and q is not None and q.shape == (m, r):
            return q.to(device=like.device, dtype=like.dtype)
        step = int(state.get("step", 0)) if not self.warm_start else 0
        mixed = zlib.crc32(f"{self.seed}:{state.get('key_hash', 0)}:{m}:{r}:{step}".encode())
        gen = torch.Generator(device="cpu").manual_seed(mixed & 0x7FFFFFFF)
        return torch.randn(m, r, generator=gen, dtype=torch.float64).to(like.device, like.dtype)

    # ------------------------------------------------------------------ codec
    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        """Single-rank encoding: (P, Q) with P orthonormal and M_hat = P Q^T."""
        if not self.compresses(tensor.shape):
            return Payload((tensor.reshape(-1),), {"dense": True})
        mat = as_matrix(tensor, self.matrix_view)
        n, m = mat.shape
        r = min(self.rank, n, m)
        p, q = power_iteration(mat, self._initial_q(m, r, state, mat))
        state["q"] = q
        state["step"] = int(state.get("step", 0)) + 1
        return Payload((p, q), {"dense": False})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        if payload.meta.get("dense"):
            return payload.tensors[0].reshape(shape)
        p, q = payload.tensors
        out = payload.meta.get("out")  # a reused buffer of the caller's (with_out), if any
        usable = out is not None and out.numel() == math.prod(shape) and out.dtype == p.dtype
        return low_rank_product(p, q, shape, out=out if usable else None)

    def aggregate(
        self, tensor: torch.Tensor, state: dict, collective: Collective
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two all-reduce rounds (P, then Q); returns (P Q_bar^T, P Q_local^T)."""
        return run_rounds(self.aggregate_rounds(tensor, state, collective))

    def aggregate_rounds(self, tensor: torch.Tensor, state: dict, collective: Collective):
        """:meth:`aggregate` as a generator that yields after launching each all-reduce
        (non-blocking where the collective can) and returns (mean, local): the attach
        points pipeline the partitions of a tensor with it (HiPress CaSync)."""
        if not self.compresses(tensor.shape):
            pending = start_collective(collective, "all_reduce_sum", [tensor.reshape(-1)])
            yield
            (summed,) = pending.wait()
            return summed.reshape(tensor.shape) / collective.world_size, tensor.clone()
        world = collective.world_size
        mat = as_matrix(tensor, self.matrix_view)
        n, m = mat.shape
        q0 = self._initial_q(m, min(self.rank, n, m), state, mat)
        pending = start_collective(collective, "all_reduce_sum", [times_factor(mat, q0).reshape(-1)])
        yield
        (p_sum,) = pending.wait()
        p = orthonormalize(p_sum.view(n, -1) / world)
        q_local = transpose_times_factor(mat, p)
        pending = start_collective(collective, "all_reduce_sum", [q_local.reshape(-1)])
        yield
        (q_sum,) = pending.wait()
        return self._finish_one(tensor, state, p, q_local, q_sum.view(q_local.shape), world)

    def _finish_one(self, tensor, state: dict, p, q_local, q_sum, world: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mean, local) of one tensor from its P and its local and summed Q; the state's
        warm start, step and payload bytes.

        The mean is written into a scratch buffer of ``state`` (valid until the tensor's
        next exchange). When ``tensor`` is a compensated buffer offered by the residual
        memory and nobody asked for this rank's part, the residual M - P Q_local^T is
        written into it in place and ``local`` is None (no full-size product is formed)."""
        q_mean = q_sum / world
        state["q"] = q_mean
        state["step"] = int(state.get("step", 0)) + 1
        state["last_payload_bytes"] = (p.numel() + q_local.numel()) * p.element_size()
        scratch = scratch_of(state)
        n = tensor.numel()
        mean = low_rank_product(
            p, q_mean, tensor.shape, out=scratch_buffer(scratch, "mean", n, tensor.dtype, tensor.device)
        )
        if may_write_residual(tensor) and not wants_local(state) and tensor.is_contiguous():
            subtract_low_rank(as_matrix(tensor, self.matrix_view), p, q_local)
            residual_written(tensor)
            return mean, None
        local = low_rank_product(
            p, q_local, tensor.shape, out=scratch_buffer(scratch, "local", n, tensor.dtype, tensor.device)
        )
        return mean, local

    def rounds_segments(self, flat: torch.Tensor, segments: Segments, state: dict, collective, out: torch.Tensor):
        """The fused exchange's rounds: every segment's P = M Q in ONE all-reduce (the
        segments that travel dense in it too), then every Q_i = M^T P in ONE; each segment's
        mean P Q^T written into ``out`` with its own warm start and step (``segment_states``);
        returns this rank's transmitted buffer (None unless :func:`~.base.wants_local`)."""
        world = collective.world_size
        own = state.setdefault(SEGMENT_STATES, [{} for _ in range(len(segments))])
        hashes = segments.key_hashes or (0,) * len(segments)
        mats, parts = [], []
        for j, ((off, n), shape) in enumerate(zip(segments, segments.shapes)):
            own[j]["key_hash"] = hashes[j]
            if not self.compresses(shape):
                mats.append(None)
                parts.append(flat[off : off + n])
                continue
            mat = as_matrix(flat[off : off + n].view(shape), self.matrix_view)
            rows, cols = mat.shape
            mats.append(mat)
            parts.append(times_factor(mat, self._initial_q(cols, min(self.rank, rows, cols), own[j], mat)).reshape(-1))
        handle = start_collective(collective, "all_reduce_sum", [torch.cat(parts)])
        yield
        (p_sum,) = handle.wait()
        ps, q_locals, pos = [], [], 0
        for (off, n), mat, part in zip(segments, mats, parts):
            got, pos = p_sum[pos : pos + part.numel()], pos + part.numel()
            if mat is None:
                out[off : off + n] = got / world
                continue
            ps.append(orthonormalize(got.view(mat.shape[0], -1) / world))
            q_locals.append(transpose_times_factor(mat, ps[-1]))
        if q_locals:
            handle = start_collective(collective, "all_reduce_sum", [torch.cat([q.reshape(-1) for q in q_locals])])
            yield
            (q_sum,) = handle.wait()
        local = scratch_buffer(scratch_of(state), "local", flat.numel(), flat.dtype, flat.device) if wants_local(
            state) else None
        pos, k = 0, 0
        for (off, n), mat, st in zip(segments, mats, own):
            if mat is None:
                if local is not None:
                    local[off : off + n] = flat[off : off + n]
                continue
            p, q_local = ps[k], q_locals[k]
            q_mean, pos, k = q_sum[pos : pos + q_local.numel()].view(q_local.shape) / world, pos + q_local.numel(), k + 1
            st["q"], st["step"] = q_mean, int(st.get("step", 0)) + 1
            st["last_payload_bytes"] = (p.numel() + q_local.numel()) * p.element_size()
            low_rank_product(p, q_mean, (n,), out=out[off : off + n])
            if local is not None:
                low_rank_product(p, q_local, (n,), out=local[off : off + n])
        return local

    def aggregate_many(
        self, tensors: Sequence[torch.Tensor], states: Sequence[dict], collective: Collective
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`aggregate` for several tensors at once, all of which :meth:`compresses`:
        every P travels in one flat all-reduce, then every Q in another.

        Returns one (mean, local) pair per tensor, in order.
        """
        world = collective.world_size
        mats, ps = [], []
        for tensor, state in zip(tensors, states, strict=True):
            if not self.compresses(tensor.shape):
                raise ValueError(f"powersgd: a {tuple(tensor.shape)} tensor travels dense")
            mat = as_matrix(tensor, self.matrix_view)
            n, m = mat.shape
            mats.append(mat)
            ps.append(times_factor(mat, self._initial_q(m, min(self.rank, n, m), state, mat)))
        ps = [orthonormalize(p / world) for p in _all_reduce_flat(collective, ps)]
        q_locals = [transpose_times_factor(mat, p) for mat, p in zip(mats, ps)]
        q_sums = _all_reduce_flat(collective, q_locals)
        return [
            self._finish_one(tensor, state, p, q_local, q_sum, world)
            for tensor, state, p, q_local, q_sum in zip(tensors, states, ps, q_locals, q_sums)
        ]
