"""``sgc``: similarity-guided communication (SGC, IWQoS 2024).

Rule, per tensor and step, p workers:
  summary: x_i = a strided sample of ``sample_size`` entries of worker i's tensor (the
           offset turns with the step, so the sample covers the tensor over time); one
           small all-reduce of (sum_i x_i, sum_i ||x_i||^2);
  similarity S = ||sum_i x_i||^2 / (p sum_i ||x_i||^2), in [0, 1]: 1 when every worker has
           the same tensor, 1/p when they are orthogonal (the squared norm of the mean
           over the mean squared norm); every rank computes the same S;
  decision: aggregate (dense all-reduce, the mean) when S < ``threshold`` or the tensor
           has been skipped ``allowed`` times in a row; otherwise skip: each worker keeps
           its local value and nothing else travels;
  adaptive frequency: after an aggregation, ``allowed`` doubles (at most ``max_skip``)
           when S >= threshold and falls back to 1 when S < threshold; so agreeing tensors
           are aggregated ever more rarely and never left unaggregated more than
           ``max_skip`` steps in a row.
Bytes per step: (sample_size + 1) values, plus the dense tensor when aggregated.
Defaults: threshold 0.95, max_skip 4, sample_size 256, memory false (a skipped tensor loses
nothing locally: the worker uses its own value), min_numel 16384.
Gradients only (``strategy=ddp``): the paper's rule relies on each worker's local gradient
being a good stand-in for the mean. Under ``sync_easgd`` / ``local_sgd`` the exchanged
elastic or parameter differences update a center every rank must hold alike, and a skip
would add each rank's own difference to its copy, so those strategies refuse ``sgc`` when
they are constructed (before any process starts, for ``easgd-train``).
Fused exchange (:mod:`easgd_lightning.hooks._fused`, ``rounds_segments``): the summaries of
every compressed tensor of the exchange's buffer (each its own sample and sum of squares,
as above) travel in one all-reduce; each tensor then decides with its own state (step,
skipped, allowed: the group's ``segment_states``), and the tensors that aggregate travel in
one more all-reduce of their concatenation (none when all skip); a skipped tensor's mean is
its local value. The numbers are each tensor's own: the per-tensor path's, bitwise on two
CPU ranks (the samples' sums of squares are summed as the rows of one matrix, which the CPU
sums as it sums each sample alone; a GPU may order those sums otherwise: S within rounding).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from easgd_lightning.hooks.compressors.base import (
    Collective,
    Compressor,
    Payload,
    check_int,
    check_ratio,
    scratch_buffer,
    scratch_of,
    start_collective,
    wants_local,
)
from easgd_lightning.hooks.compressors.segments import SEGMENT_STATES, Segments

__all__ = ["SGCCompressor", "similarity", "sgc_decision"]


def similarity(sum_of_samples: torch.Tensor, sum_of_squares: float, world: int) -> float:
    """S = ||sum_i x_i||^2 / (p sum_i ||x_i||^2) (1.0 for an all-zero sample)."""
    if sum_of_squares <= 0.0:
        return 1.0
    return similarity_of(float(sum_of_samples.double().square().sum()), sum_of_squares, world)


def similarity_of(norm_of_sum: float, sum_of_squares: float, world: int) -> float:
    """:func:`similarity` from ||sum_i x_i||^2 already summed (1.0 for an all-zero sample)."""
    return norm_of_sum / (world * sum_of_squares) if sum_of_squares > 0.0 else 1.0


def sgc_decision(sim: float, skipped: int, allowed: int, threshold: float, max_skip: int) -> tuple[bool, int, int]:
    """(aggregate?, skipped, allowed) after this step, from the rule of the module docstring."""
    if sim >= threshold and skipped < min(allowed, max_skip):
        return False, skipped + 1, allowed
    allowed = min(2 * allowed, max_skip) if sim >= threshold else 1
    return True, 0, allowed


class SGCCompressor(Compressor):
    """Similarity-guided aggregation skipping.

    Args:
        threshold: similarity S at or above which a tensor may skip aggregation, in (0, 1].
        max_skip: the most consecutive steps a tensor goes unaggregated (>= 0; 0: never).
        sample_size: entries of the strided sample the similarity is estimated on.
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "sgc"
    aggregation = "allreduce"
    default_memory = False
    #: a skipped tensor keeps each rank's own value: right for a gradient (SGC's rule), not
    #: for the elastic strategies' differences, where every rank's center would diverge
    gradients_only = True
    #: the fused exchange's multi-round form (``rounds_segments``), each tensor with its own
    #: decision state (the group's ``segment_states``)
    fused_segments = True
    segment_state: ClassVar[bool] = True

    def __init__(
        self,
        threshold: float = 0.95,
        *,
        max_skip: int = 4,
        sample_size: int = 256,
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.threshold = check_ratio("compression.threshold", threshold)
        self.max_skip = check_int("compression.max_skip", max_skip, 0)
        self.sample_size = check_int("compression.sample_size", sample_size, 1)

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        """The dense tensor (what an aggregation sends)."""
        return Payload((tensor.reshape(-1),), {})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        return payload.tensors[0].reshape(shape)

    def sample(self, flat: torch.Tensor, step: int) -> torch.Tensor:
        """Every stride-th entry from offset step mod stride (a view), stride = n // size."""
        stride = max(1, flat.numel() // self.sample_size)
        return flat[step % stride :: stride][: self.sample_size]

    def aggregate(self, tensor: torch.Tensor, state: dict, collective: Collective):
        """One small all-reduce for S, then the dense all-reduce unless the tensor skips."""
        world = collective.world_size
        flat = tensor.reshape(-1)
        step = int(state.get("step", 0))
        state["step"] = step + 1
        x = self.sample(flat, step).to(torch.float64)
        summary = torch.cat([x, x.square().sum().reshape(1)])
        (summed,) = collective.all_reduce_sum([summary.to(flat.dtype)])
        sim = similarity(summed[:-1], float(summed[-1]), world)
        go, skipped, allowed = sgc_decision(
            sim, int(state.get("skipped", 0)), int(state.get("allowed", 1)), self.threshold, self.max_skip
        )
        state.update(skipped=skipped, allowed=allowed, last_similarity=sim, last_aggregated=go)
        state["aggregations"] = int(state.get("aggregations", 0)) + int(go)
        if not go:
            local = tensor.clone()
            return local, local
        (total,) = collective.all_reduce_sum([flat])
        return (total / world).view(tensor.shape), tensor.clone()

    def _sample_plan(self, segments: Segments, device):
        """Cached per segment layout of the fused summaries: (strides, sample entries m_j,
        the sample positions at offset 0, [(m, segments with m entries, their positions in
        the samples or None for all)])."""
        def plan():
            strides = [max(1, n // self.sample_size) for n in segments.lengths]
            ms = [min(n, self.sample_size) for n in segments.lengths]  # flat[s::stride][:size]
            base = torch.cat([off + st * torch.arange(m) for off, st, m in zip(segments.offsets, strides, ms)])
            starts = [sum(ms[:j]) for j in range(len(ms))]
            rows = []
            for m in sorted(set(ms)):
                js = [j for j, mj in enumerate(ms) if mj == m]
                sel = None if len(js) == len(ms) else torch.cat([starts[j] + torch.arange(m) for j in js])
                rows.append((m, torch.tensor(js), sel))
            return torch.tensor(strides), torch.tensor(ms), base, rows

        strides, ms, base, rows = segments.cached(("sgc", self.sample_size), plan)
        if torch.device(device).type == "cpu":
            return strides, ms, base, rows
        return segments.cached(("sgc", self.sample_size, str(device)), lambda: (
            strides, ms, base.to(device),
            [(m, js.to(device), None if sel is None else sel.to(device)) for m, js, sel in rows]))

    @staticmethod
    def _row_sums(v: torch.Tensor, rows, count: int) -> torch.Tensor:
        """Per segment, the sum of its entries of ``v`` (its sample's), each segment's as one
        row of a matrix of the segments with as many entries."""
        out = v.new_empty(count)
        for m, js, sel in rows:
            part = v if sel is None else v.index_select(0, sel)
            out.index_copy_(0, js, part.view(-1, m).sum(dim=1))
        return out

    def rounds_segments(self, flat: torch.Tensor, segments: Segments, state: dict, collective, out: torch.Tensor):
        """The fused exchange as rounds (module docstring): yields after the summaries'
        all-reduce and after the aggregated segments' one; writes every segment's mean into
        ``out`` and returns this rank's transmitted buffer (``flat`` copied; None unless
        :func:`~.base.wants_local`)."""
        world, count = collective.world_size, len(segments)
        own = state.setdefault(SEGMENT_STATES, [{} for _ in range(count)])
        steps = [int(st.get("step", 0)) for st in own]
        strides, ms, base, rows = self._sample_plan(segments, flat.device)
        shift = torch.repeat_interleave(torch.tensor(steps) % strides, ms).to(flat.device)
        x = flat.index_select(0, base + shift).to(torch.float64)
        summary = torch.cat([x, self._row_sums(x.square(), rows, count)]).to(flat.dtype)
        handle = start_collective(collective, "all_reduce_sum", [summary])
        yield
        (summed,) = handle.wait()
        norms = self._row_sums(summed[: x.numel()].double().square(), rows, count).tolist()
        sums = summed[x.numel() :].tolist()
        go = []
        for j, st in enumerate(own):
            sim = similarity_of(norms[j], sums[j], world)
            agg, skipped, allowed = sgc_decision(
                sim, int(st.get("skipped", 0)), int(st.get("allowed", 1)), self.threshold, self.max_skip
            )
            st.update(step=steps[j] + 1, skipped=skipped, allowed=allowed, last_similarity=sim, last_aggregated=agg)
            st["aggregations"] = int(st.get("aggregations", 0)) + int(agg)
            go.append(agg)
        index = segments.index(flat.device)
        if all(go):
            sel, kept = index, None
        else:
            mask = torch.repeat_interleave(torch.tensor(go), segments.arrays()[1]).to(flat.device)
            sel, kept = index[mask], index[~mask]
        if kept is not None and out.data_ptr() != flat.data_ptr():  # a skip: the local value
            out.index_copy_(0, kept, flat.index_select(0, kept))
        if sel.numel():
            handle = start_collective(collective, "all_reduce_sum", [flat.index_select(0, sel)])
            yield
            (total,) = handle.wait()
            out.index_copy_(0, sel, total / world)
        if not wants_local(state):
            return None
        return scratch_buffer(scratch_of(state), "local", flat.numel(), flat.dtype, flat.device).copy_(flat)
