"""``lgc``: learned gradient compression (Abrahamyan et al., LGC, TNNLS 2021).

Rule, per tensor and step t, p workers, k = ceil(ratio n), code size c = ceil(code_ratio k):
  mask:   the leader (rank t mod p) sends the indices of its k largest |g| (error-compensated),
          ordered by decreasing magnitude; every worker takes x_i = g_i[mask] (length k), so
          the workers' vectors line up entry by entry;
  phase 1 (the first ``warmup_steps`` steps, and whenever the code is not good enough):
          top-k with the shared mask; the x_i are all-gathered (every rank sees every
          worker's vector) and kept as training data;
  fit:    at the end of phase 1, the linear autoencoder with code size c that minimizes
          ||X - X E D||^2 over the collected vectors: E = V_c, D = V_c^T (the top-c right
          singular vectors of X; the same data on every rank gives the same weights);
          its relative reconstruction error ||X - X E D|| / ||X|| must be <= ``max_error``,
          else phase 1 goes on (the reason is logged) and the fit is retried
          ``warmup_steps`` later;
  phase 2: worker i sends the code z_i = x_i E (c values). ``style: ring``: the codes are
          all-reduced and the shared decoder rebuilds the sum, (sum_i z_i) D = sum_i x_i E D
          (the decoder is linear, so the sum of codes decodes to the sum of the inputs'
          reconstructions); ``style: ps``: the codes are all-gathered and every rank plays
          the server, decoding the summed codes once. Error feedback: e_i <- g_i - x_i E D
          scattered at the mask (``memory``).
Defaults: ratio 0.01, code_ratio 0.25, warmup_steps 50, max_error 0.3, style ring, memory
true, min_numel 16384. The paper's encoder and decoder are small convolutional networks
trained by SGD; here the autoencoder is linear and fitted in closed form.
"""

from __future__ import annotations

import logging
import math

import torch

from easgd_lightning.hooks.compressors.base import (
    Collective,
    Compressor,
    Payload,
    check_choice,
    check_int,
    check_positive,
    check_ratio,
    num_selected,
)

__all__ = ["LGCCompressor", "fit_linear_autoencoder", "reconstruction_error"]

log = logging.getLogger(__name__)
STYLES = ("ring", "ps")
MAX_SAMPLES = 256  # training vectors kept per tensor (the most recent)


def fit_linear_autoencoder(x: torch.Tensor, code: int) -> torch.Tensor:
    """E (k x c): the top-``code`` right singular vectors of the rows of ``x``; D = E^T."""
    _, _, vh = torch.linalg.svd(x.double(), full_matrices=False)
    e = vh[:code].t()
    if e.shape[1] < code:  # fewer samples than the code size: pad with zeros
        e = torch.cat([e, e.new_zeros(e.shape[0], code - e.shape[1])], 1)
    return e.to(x.dtype)


def reconstruction_error(x: torch.Tensor, e: torch.Tensor) -> float:
    """||X - X E E^T|| / ||X|| (0 for an all-zero X)."""
    xd, ed = x.double(), e.double()
    norm = float(torch.linalg.norm(xd))
    return float(torch.linalg.norm(xd - xd @ ed @ ed.t())) / norm if norm > 0 else 0.0


class LGCCompressor(Compressor):
    """LGC: shared top-k mask, a linear autoencoder learned in phase 1, codes in phase 2.

    Args:
        ratio: density k / n of the shared mask, in (0, 1].
        code_ratio: code size c / k, in (0, 1].
        warmup_steps: phase-1 steps before the first fit (>= 1).
        max_error: relative reconstruction error above which the code is not used (> 0).
        style: ``ring`` (codes all-reduced) or ``ps`` (codes all-gathered, summed, decoded).
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "lgc"
    aggregation = "allreduce"
    default_memory = True

    def __init__(
        self,
        ratio: float = 0.01,
        *,
        code_ratio: float = 0.25,
        warmup_steps: int = 50,
        max_error: float = 0.3,
        style: str = "ring",
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.ratio = check_ratio("ratio", ratio)
        self.code_ratio = check_ratio("code_ratio", code_ratio)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 1)
        self.max_error = check_positive("max_error", max_error)
        self.style = check_choice("style", style, STYLES)

    def code_size(self, k: int) -> int:
        return max(1, math.ceil(self.code_ratio * k - 1e-9))

    # single-rank codec: the masked values of this rank, coded when the code is trained
    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        flat = tensor.reshape(-1)
        k = num_selected(flat.numel(), self.ratio)
        idx = torch.topk(flat.abs(), k, sorted=True).indices
        x = flat[idx]
        e = state.get("encoder")
        if e is None:
            return Payload((x,), {"idx": idx, "numel": flat.numel()})
        return Payload((x @ e,), {"idx": idx, "numel": flat.numel(), "decoder": e.t()})

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        meta = payload.meta
        (vals,) = payload.tensors
        if "decoder" in meta:
            vals = vals @ meta["decoder"]
        out = torch.zeros(meta["numel"], dtype=vals.dtype, device=vals.device)
        out[meta["idx"]] = vals
        return out.reshape(shape)

    def _shared_mask(self, flat: torch.Tensor, step: int, k: int, collective: Collective) -> torch.Tensor:
        leader = step % collective.world_size
        rank = getattr(collective, "rank", 0)
        mine = torch.topk(flat.abs(), k, sorted=True).indices.to(torch.int32)
        send = mine if rank == leader else mine[:0]
        gathered = collective.all_gather([send])
        return gathered[leader][0].to(device=flat.device, dtype=torch.int64)

    def _refit(self, state: dict, k: int) -> None:
        data = state.get("samples")
        if data is None or data.shape[0] == 0:
            return
        e = fit_linear_autoencoder(data, self.code_size(k))
        err = reconstruction_error(data, e)
        state["last_fit_error"] = err
        if err <= self.max_error:
            state["encoder"] = e
            state.pop("samples", None)
        else:
            state.pop("encoder", None)
            log.warning(
                "compression=lgc: reconstruction error %.3f > compression.max_error %.3f "
                "on %d vectors; top-k with the shared mask for %d more steps",
                err, self.max_error, data.shape[0], self.warmup_steps,
            )

    def aggregate(self, tensor: torch.Tensor, state: dict, collective: Collective):
        """Shared mask, then phase 1 (values all-gathered) or phase 2 (codes)."""
        world = collective.world_size
        flat = tensor.reshape(-1)
        n = flat.numel()
        k = num_selected(n, self.ratio)
        step = int(state.get("step", 0))
        state["step"] = step + 1
        if step > 0 and step % self.warmup_steps == 0 and "encoder" not in state:
            self._refit(state, k)
        idx = self._shared_mask(flat, step, k, collective)
        x = flat[idx]
        e = state.get("encoder")
        local = torch.zeros_like(flat)
        mean = torch.zeros_like(flat)
        if e is None:  # phase 1: top-k with the shared mask; every worker's x kept
            parts = collective.all_gather([x])
            xs = torch.stack([p[0].to(flat.device, flat.dtype) for p in parts])
            old = state.get("samples")
            state["samples"] = xs if old is None or old.shape[1] != k else torch.cat([old, xs])[-MAX_SAMPLES:]
            local[idx] = x
            mean[idx] = xs.sum(0) / world
            state["last_phase"] = 1
        else:
            z = x @ e
            if self.style == "ring":
                (z_sum,) = collective.all_reduce_sum([z])
            else:
                z_sum = torch.stack([p[0].to(flat.device, flat.dtype) for p in collective.all_gather([z])]).sum(0)
            local[idx] = z @ e.t()
            mean[idx] = (z_sum @ e.t()) / world
            state["last_phase"] = 2
        return mean.view(tensor.shape), local.view(tensor.shape)
