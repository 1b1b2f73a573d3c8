"""Coarse-grained sparse communication (``compression=csc``).

Sun, Chen, Xu, Wu, Yang, Yuan, Wang, "Optimizing Network Performance for Distributed DNN
Training on GPU Clusters: ImageNet/AlexNet Training in 1.5 Minutes" (GradientFlow, 2019).

Rule, for a flat gradient g of n entries split into m = ceil(n / c) chunks of c entries
(``chunk_size``; the last chunk may be shorter):

1. importance of chunk j on rank i: s_ij = ||g_i[chunk j]||_1; one all-reduce sums them,
   S_j = sum_i s_ij, so every rank holds the same scores;
2. every rank selects the same k = ceil(``ratio`` * m) chunks, those of largest S_j (ties
   to the lower index, so the choice is identical everywhere);
3. the selected chunks travel **densely** in one all-reduce of k * c entries (no
   all-gather, no indices): mean = (1/p) sum_i g_i on the selected chunks, 0 elsewhere;
4. the entries of the chunks not sent stay in the residual (error feedback, on by
   default): r_i <- g_i + r_i - (the selected chunks of g_i + r_i).

Bytes per step and rank: m scores + k * c selected entries (both in the gradient's dtype).
Fused exchange (:mod:`easgd_lightning.hooks._fused`, the multi-round form): every tensor's
chunk scores in one all-reduce, then every tensor's chosen chunks in one; the chunks, k and
the choice stay each tensor's own (the paper chunks a layer's gradient), the numbers those of
the per-tensor exchange.
"""

from __future__ import annotations

import math

import torch

from easgd_lightning.hooks.compressors.base import (
    Collective,
    Compressor,
    Payload,
    check_int,
    check_ratio,
    run_rounds,
    scratch_buffer,
    scratch_of,
    start_collective,
    wants_local,
)
from easgd_lightning.hooks.compressors.segments import SEGMENT_STATES, Segments

__all__ = ["CSCCompressor", "chunk_scores", "select_chunks"]


def chunk_scores(flat: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """The L1 norm of each ``chunk_size`` chunk of ``flat`` (the last may be shorter)."""
    n = flat.numel()
    full = n // chunk_size
    scores = flat.new_empty(math.ceil(n / chunk_size))
    if full:
        torch.sum(flat[: full * chunk_size].view(full, chunk_size).abs(), dim=1, out=scores[:full])
    if full * chunk_size < n:
        scores[full] = flat[full * chunk_size :].abs().sum()
    return scores


def select_chunks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending) of the ``k`` largest ``scores``; ties go to the lower index."""
    order = torch.argsort(-scores, stable=True)
    return torch.sort(order[:k]).values


class CSCCompressor(Compressor):
    """GradientFlow's coarse-grained sparse communication: the top chunks by summed L1 norm,
    all-reduced densely; the rest kept as residual.

    Args:
        ratio: fraction of the chunks sent, in (0, 1] (k = ceil(ratio * chunks)).
        chunk_size: entries per chunk (>= 1; the paper: tens of thousands).
        min_numel, memory: attach-point policies (see :class:`Compressor`; memory on by default).
    """

    name = "csc"
    search_knob = "ratio"
    aggregation = "allreduce"
    exchange_rounds = 2  # the chunk scores, then the chosen chunks
    default_memory = True
    fused_segments = True  # in the multi-round form: rounds_segments
    segment_state = True  # each tensor's last selection (the fused exchange's segment_states)

    def __init__(self, ratio: float = 0.1, *, chunk_size: int = 32768,
                 min_numel: int | None = None, memory: bool | None = None) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.ratio = check_ratio("compression.ratio", ratio)
        self.chunk_size = check_int("compression.chunk_size", chunk_size, 1)

    # compress / decompress: one rank alone (its own top chunks); ``aggregate`` agrees the
    # selection across ranks first
    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        flat = tensor.reshape(-1)
        chosen = select_chunks(chunk_scores(flat, self.chunk_size), self._k(flat.numel()))
        return Payload((self._gather(flat, chosen, state),), {"chosen": chosen, "n": flat.numel()})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        (values,) = payload.tensors
        out = values.new_zeros(payload.meta["n"])
        self._scatter(values, payload.meta["chosen"], out)
        return out.view(shape)

    def aggregate(self, tensor: torch.Tensor, state: dict, collective: Collective
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores all-reduce, the same chunks chosen everywhere, one dense all-reduce of them;
        returns (mean over ranks, this rank's sent part)."""
        return run_rounds(self.aggregate_rounds(tensor, state, collective))

    def aggregate_rounds(self, tensor: torch.Tensor, state: dict, collective: Collective):
        """:meth:`aggregate` as a generator that yields after launching each of its two
        all-reduces (non-blocking where the collective can) and returns (mean, local):
        round 1 the chunk scores, round 2 the selected chunks. The exchange drives every
        tensor's round 1, then every tensor's round 2 (GradientFlow's lazy all-reduce: one
        fused buffer per round, not two messages per tensor); CaSync pipelines partitions.
        ``tensor`` must not change until the generator returns."""
        flat = tensor.reshape(-1)
        n, world = flat.numel(), collective.world_size
        pending = start_collective(collective, "all_reduce_sum", [chunk_scores(flat, self.chunk_size)])
        yield
        (scores,) = pending.wait()
        chosen = select_chunks(scores, self._k(n))
        values = self._gather(flat, chosen, state)
        local = self._dense(values, chosen, state, "local", n)
        pending = start_collective(collective, "all_reduce_sum", [values])
        yield
        (summed,) = pending.wait()
        mean = self._dense(summed / world, chosen, state, "mean", n)
        state["chosen"] = chosen  # the last agreed selection, for inspection
        state["last_payload_bytes"] = (scores.numel() + values.numel()) * values.element_size()
        return mean.view(tensor.shape), local.view(tensor.shape)

    def rounds_segments(self, flat: torch.Tensor, segments: Segments, state: dict, collective, out: torch.Tensor):
        """The fused exchange's rounds: every segment's chunk scores in ONE all-reduce, then
        every segment's chosen chunks in ONE; each segment's mean written into ``out``;
        returns this rank's transmitted buffer (None unless :func:`~.base.wants_local`)."""
        world = collective.world_size
        own = state.setdefault(SEGMENT_STATES, [{} for _ in range(len(segments))])
        segs = [flat[off : off + n] for off, n in segments]
        scores = [chunk_scores(seg, self.chunk_size) for seg in segs]
        pending = start_collective(collective, "all_reduce_sum", [torch.cat(scores)])
        yield
        (summed,) = pending.wait()
        chosen, values, pos = [], [], 0
        for seg, sc, st in zip(segs, scores, own):
            pick = select_chunks(summed[pos : pos + sc.numel()], self._k(seg.numel()))
            pos += sc.numel()
            chosen.append(pick)
            values.append(self._gather(seg, pick, st))
        pending = start_collective(collective, "all_reduce_sum", [torch.cat(values)])
        yield
        (summed,) = pending.wait()
        local = scratch_buffer(scratch_of(state), "local", flat.numel(), flat.dtype, flat.device).zero_() if (
            wants_local(state)) else None
        pos = 0
        for (off, n), pick, val, sc, st in zip(segments, chosen, values, scores, own):
            out[off : off + n].zero_()
            self._scatter(summed[pos : pos + val.numel()] / world, pick, out[off : off + n])
            pos += val.numel()
            if local is not None:
                self._scatter(val, pick, local[off : off + n])
            st["chosen"] = pick
            st["last_payload_bytes"] = (sc.numel() + val.numel()) * val.element_size()
        return local

    # ------------------------------------------------------------------ helpers
    def _k(self, n: int) -> int:
        return max(1, math.ceil(self.ratio * math.ceil(n / self.chunk_size)))

    def _rows(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``flat`` as (full chunks x chunk_size) rows plus the short last chunk (views)."""
        c = self.chunk_size
        full = flat.numel() // c
        return flat[: full * c].view(full, c), flat[full * c :]

    def _gather(self, flat: torch.Tensor, chosen: torch.Tensor, state: dict) -> torch.Tensor:
        """The chosen chunks of ``flat``, in order, in one buffer (one indexed copy)."""
        rows, tail = self._rows(flat)
        in_rows = chosen[chosen < rows.shape[0]]
        size = in_rows.numel() * self.chunk_size + (tail.numel() if in_rows.numel() < chosen.numel() else 0)
        out = scratch_buffer(scratch_of(state), "values", size, flat.dtype, flat.device)
        body = in_rows.numel() * self.chunk_size
        torch.index_select(rows, 0, in_rows, out=out[:body].view(-1, self.chunk_size))
        out[body:].copy_(tail[: size - body])
        return out

    def _scatter(self, values: torch.Tensor, chosen: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``values`` (the chosen chunks, in order) into their places in ``out``."""
        rows, tail = self._rows(out)
        in_rows = chosen[chosen < rows.shape[0]]
        body = in_rows.numel() * self.chunk_size
        rows.index_copy_(0, in_rows, values[:body].view(-1, self.chunk_size))
        tail[: values.numel() - body].copy_(values[body:])

    def _dense(self, values: torch.Tensor, chosen: torch.Tensor, state: dict, key: str, n: int
               ) -> torch.Tensor:
        out = scratch_buffer(scratch_of(state), key, n, values.dtype, values.device).zero_()
        self._scatter(values, chosen, out)
        return out
