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
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors.base import (
    Collective,
    Compressor,
    Payload,
    check_int,
    check_ratio,
)

__all__ = ["SGCCompressor", "similarity", "sgc_decision"]


def similarity(sum_of_samples: torch.Tensor, sum_of_squares: float, world: int) -> float:
    """S = ||sum_i x_i||^2 / (p sum_i ||x_i||^2) (1.0 for an all-zero sample)."""
    if sum_of_squares <= 0.0:
        return 1.0
    return float(sum_of_samples.double().square().sum()) / (world * sum_of_squares)


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
