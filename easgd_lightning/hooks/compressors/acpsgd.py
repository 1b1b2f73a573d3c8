"""``acpsgd``: ACP-SGD, alternating compressed power SGD (Zhang et al., ICDCS 2023).

Rule, for a gradient viewed as M (n x m) with error feedback (``memory``: M <- M + E,
E <- M - local) and factors shared by every rank:
  odd steps (1, 3, ...):  Q <- orthonormalize(Q);  P_i = M_i Q;  P = mean_ranks P_i (one
                          all-reduce of n r values);  mean = P Q^T;  local = P_i Q^T
  even steps:             P <- orthonormalize(P);  Q_i = M_i^T P;  Q = mean_ranks Q_i (one
                          all-reduce of m r values);  mean = P Q^T;  local = P Q_i^T
The first Q is PowerSGD's seeded N(0, 1) draw, identical on every rank. Each step sends
one factor, so two steps cost what one PowerSGD step (P and Q) costs, and a step needs no
second round: its all-reduce is launched at once and waited for later (the DDP hook and
the exchange overlap it with the other tensors of the bucket, like any one-collective
compressor). 1-D tensors and matrices whose factors would not be smaller travel dense.
Defaults: rank 2, seed 0, matrix_view leading, memory true, min_numel 16384.
The matrix view, the seeded first factor, the dense rule and the orthonormalization are
PowerSGD's (:mod:`easgd_lightning.hooks.compressors.powersgd`).
Fused exchange (:mod:`easgd_lightning.hooks._fused`): every tensor of the exchange's flat
buffer computes its own factor with its own shared factor and step (state per tensor,
kept per segment: ``segment_states``), the factors (and the tensors that travel dense) are
laid end to end in one buffer and summed by ONE all-reduce per exchange (the per-tensor
path launches one per tensor); each tensor's product is a matmul of its own shape (a loop
over the tensors: the shapes differ), the numbers those of the per-tensor exchange.
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors.base import (
    Collective,
    Compressor,
    Payload,
    may_write_residual,
    residual_written,
    scratch_buffer,
    scratch_of,
    start_collective,
    wants_local,
    with_out,
)
from easgd_lightning.hooks.compressors.powersgd import (
    PowerSGDCompressor,
    as_matrix,
    low_rank_product,
    orthonormalize,
    subtract_low_rank,
    times_factor,
    transpose_times_factor,
)
from easgd_lightning.hooks.compressors.segments import SEGMENT_STATES, Segments

__all__ = ["ACPSGDCompressor", "acp_phase"]


def acp_phase(step: int) -> str:
    """``"p"`` on the odd steps (1-based: the 0-based even ones), ``"q"`` on the others."""
    return "p" if step % 2 == 0 else "q"


class ACPSGDCompressor(PowerSGDCompressor):
    """ACP-SGD: PowerSGD's two factors, all-reduced on alternate steps.

    Args:
        rank: r, the rank of the approximation (>= 1).
        seed: seed of the first Q, identical on every rank.
        matrix_view: ``leading`` or ``trailing`` (as :class:`PowerSGDCompressor`).
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "acpsgd"
    search_knob = "rank"
    aggregation = "allreduce"
    exchange_rounds = 1  # P or Q, alternating by step
    default_memory = True
    aggregate = Compressor.aggregate  # one collective per step: split by start_aggregate
    fused_segments = True
    segment_state = True  # each tensor's step and factors (the fused exchange's segment_states)

    def __init__(
        self,
        rank: int = 2,
        *,
        seed: int = 0,
        matrix_view: str = "leading",
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(rank, warm_start=True, seed=seed, matrix_view=matrix_view,
                         min_numel=min_numel, memory=memory)

    def _shared_factor(self, mat: torch.Tensor, state: dict, phase: str) -> torch.Tensor:
        """The orthonormalized factor every rank holds: Q on P steps, P on Q steps."""
        n, m = mat.shape
        r = min(self.rank, n, m)
        if phase == "p":
            return orthonormalize(self._initial_q(m, r, state, mat))
        p = state.get("p")
        if p is None or p.shape != (n, r):  # no P yet: start over from a P step's
            p = times_factor(mat, orthonormalize(self._initial_q(m, r, state, mat)))
        return orthonormalize(p.to(device=mat.device, dtype=mat.dtype))

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        """This rank's factor of the step (P_i = M Q or Q_i = M^T P); the shared one in meta."""
        if not self.compresses(tensor.shape):
            return Payload((tensor.reshape(-1),), {"dense": True})
        step = int(state.get("step", 0))
        phase = acp_phase(step)
        mat = as_matrix(tensor, self.matrix_view)
        shared = self._shared_factor(mat, state, phase)
        mine = times_factor(mat, shared) if phase == "p" else transpose_times_factor(mat, shared)
        state["step"] = step + 1
        return Payload((mine,), {"dense": False, "phase": phase, "shared": shared})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        meta = payload.meta
        if meta.get("dense"):
            return payload.tensors[0].reshape(shape)
        (mine,) = payload.tensors
        p, q = (mine, meta["shared"]) if meta["phase"] == "p" else (meta["shared"], mine)
        return low_rank_product(p, q, shape, out=meta.get("out"))

    def _launch(self, tensor: torch.Tensor, state: dict, collective: Collective):
        """Compress, launch the one all-reduce; ``finish`` keeps the mean factor for the
        next step (as P or Q) and returns the mean (in a scratch buffer of ``state``).

        The local part P_i Q^T (or P Q_i^T) is formed only when the caller reads it or the
        memory cannot take the residual in place (see :func:`wants_local`)."""
        world = collective.world_size
        n, dt, dev = tensor.numel(), tensor.dtype, tensor.device
        payload = self.compress(tensor, state)
        meta = payload.meta
        if meta.get("dense"):
            local = tensor.clone()
        elif may_write_residual(tensor) and not wants_local(state) and tensor.is_contiguous():
            (mine,) = payload.tensors
            p, q = (mine, meta["shared"]) if meta["phase"] == "p" else (meta["shared"], mine)
            subtract_low_rank(as_matrix(tensor, self.matrix_view), p, q)
            residual_written(tensor)
            local = None
        else:
            local = self.decompress(Payload(payload.tensors, with_out(meta, state, "local", n, dt, dev)), tensor.shape)
        pending = start_collective(collective, "all_reduce_sum", list(payload.tensors))

        def finish() -> torch.Tensor:
            (total,) = pending.wait()
            mean_factor = total / world
            if meta.get("dense"):
                return mean_factor.reshape(tensor.shape)
            state[meta["phase"]] = mean_factor
            state["last_payload_bytes"] = mean_factor.numel() * mean_factor.element_size()
            out_meta = with_out(meta, state, "total", n, dt, dev)
            return self.decompress(Payload((mean_factor,), out_meta), tensor.shape)

        return (None if local is None else local.to(tensor.dtype)), finish

    def compress_segments(self, flat: torch.Tensor, segments: Segments, state: dict) -> Payload:
        """Every segment's factor of its step (or the segment itself where it travels dense)
        in one buffer; the residual written in place where the per-tensor exchange would."""
        own = state.setdefault(SEGMENT_STATES, [{} for _ in range(len(segments))])
        hashes = segments.key_hashes or (0,) * len(segments)
        in_place = may_write_residual(flat) and not wants_local(state)
        parts, metas = [], []
        for j, ((off, n), shape) in enumerate(zip(segments, segments.shapes)):
            own[j]["key_hash"] = hashes[j]
            payload = self.compress(flat[off : off + n].view(shape), own[j])
            parts.append(payload.tensors[0].reshape(-1))
            metas.append(payload.meta)
        buf = torch.cat(parts)  # before the residual is written: a dense part is a view of flat
        if in_place:
            for (off, n), shape, mine, meta in zip(segments, segments.shapes, parts, metas):
                seg = flat[off : off + n]
                if meta["dense"]:
                    seg.sub_(seg)  # p - p: all of it was sent
                else:
                    subtract_low_rank(as_matrix(seg.view(shape), self.matrix_view),
                                      *self._pair(mine.view(self._factor_shape(shape, meta)), meta))
            residual_written(flat)
        sizes = [t.numel() for t in parts]
        return Payload((buf,), {"dtype": flat.dtype, "metas": metas, "sizes": sizes, "owners": own})

    def _factor_shape(self, shape, meta: dict) -> tuple[int, int]:
        """The shape of the factor a tensor of ``shape`` sends at ``meta``'s phase."""
        p_shape, q_shape = self.factor_shapes(shape)
        return p_shape if meta["phase"] == "p" else q_shape

    @staticmethod
    def _pair(mine: torch.Tensor, meta: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, Q) of a payload: this rank's factor and the shared one, by phase."""
        return (mine, meta["shared"]) if meta["phase"] == "p" else (meta["shared"], mine)

    def _rebuild(self, buf: torch.Tensor, meta: dict, segments: Segments, out: torch.Tensor, store: bool) -> None:
        """out's segments <- each one's P Q^T from its factor in ``buf`` (dense ones copied);
        ``store``: the factors are the mean ones, kept as the next step's P or Q."""
        pos = 0
        for (off, n), shape, size, m, own in zip(segments, segments.shapes, meta["sizes"], meta["metas"], meta["owners"]):
            part = buf[pos : pos + size]
            pos += size
            if m["dense"]:
                out[off : off + n] = part
                continue
            mine = part.view(self._factor_shape(shape, m))
            if store:
                mine = mine.clone()
                own[m["phase"]] = mine
                own["last_payload_bytes"] = mine.numel() * mine.element_size()
            low_rank_product(*self._pair(mine, m), (n,), out=out[off : off + n])

    def local_segments(self, payload: Payload, segments: Segments, state: dict) -> torch.Tensor:
        out = scratch_buffer(scratch_of(state), "local", segments.numel, payload.meta["dtype"], payload.tensors[0].device)
        out.zero_()
        self._rebuild(payload.tensors[0], payload.meta, segments, out, store=False)
        return out

    def mean_segments(self, received, meta: dict, segments: Segments, out: torch.Tensor, world: int) -> None:
        """The summed buffer / world: each segment's mean factor (kept for its next step)
        times its shared factor, or its dense mean."""
        (total,) = received
        self._rebuild(total / world, meta, segments, out, store=True)
