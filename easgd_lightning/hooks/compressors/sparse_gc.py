"""``sparse_gc``: Sparse Gradient Compression (Sun, Shao, Jiang, Cui, Lei, Xu, Wang, DASFAA 2019).

Rule, per worker and tensor at step t (p workers, global momentum m, density d):
  v <- v + g                       momentum approximation: one accumulator, no per-worker
                                   momentum buffer (DGC keeps two, u and v)
  send {(i, v_i)}: the ~d n largest |v_i| (DGC's sampled threshold); v_i <- 0 there
  s = (1/p) sum_ranks sent         (identical on every rank)
  M <- m M + s                     long-term gradient compensation: a global momentum of
                                   the sparse updates, the same on every rank
  G = M + (g - sent)               local update: the gradient handed to the optimizer
With plain SGD (learning rate lr, no optimizer momentum) the shared model moves by
-lr M and each worker's copy stays at w - lr v: it already holds its own delayed
(accumulated, not yet sent) gradients, the paper's remedy for staleness.
Defaults: ratio 1e-4 (99.99% dropped, the paper's setting), momentum 0.9, local_update
true, min_numel 16384, memory false (v is the residual).

Where the rule applies: M and the local update act on gradients, so they are switched on
by :meth:`SparseGCCompressor.bind_training`, which the ``ddp`` strategy calls (it also sets
the optimizer's momentum to 0, with a warning, since M replaces it). Under ``sync_easgd``
and ``local_sgd`` (:meth:`SparseGCCompressor.bind_exchange`, and the default when nothing
binds it) the exchanged quantity is an elastic or parameter difference, every rank must get
the same mean, so the compressor is the accumulate-and-sparsify part alone (s is the
mean). Tensors under ``min_numel`` travel dense with a momentum whose rank mean is M
(u <- m u + g, u sent; DGC's dense rule).
Cost: one pass accumulates, the sampled threshold's count-and-gather is one pass, the
sent entries are zeroed sparsely; in gradient mode one pass forms g - sent and one M.
Fused exchange (:mod:`easgd_lightning.hooks._fused`): DGC's segmented kernel without
momentum runs the accumulate-and-sparsify rule on every tensor of the buffer at once; in
gradient mode g - sent is formed over the buffer at the launch and M and the local update
over its compressed runs after the mean (:meth:`SparseGCCompressor.finish_segments`):
element-wise rules, so the same numbers as tensor by tensor.
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors import _native
from easgd_lightning.hooks.compressors.base import (
    Collective,
    check_bool,
    check_momentum,
    check_ratio,
    num_selected,
    scratch_buffer,
    scratch_of,
)
from easgd_lightning.hooks.compressors.dgc import (
    SelectRule,
    dgc_segments,
    dgc_select_values,
    momentum_dense,
    release_optimizer_momentum,
)
from easgd_lightning.hooks.compressors.segments import Segments
from easgd_lightning.hooks.compressors.sparse import SparseCompressor, sparse_payload

__all__ = ["SparseGCCompressor", "global_momentum_update"]


def global_momentum_update(M: torch.Tensor, mean_sent: torch.Tensor, momentum: float) -> torch.Tensor:
    """In place: M <- m M + s (long-term gradient compensation); returns M."""
    return M.mul_(momentum).add_(mean_sent)


class SparseGCCompressor(SparseCompressor):
    """Sparse Gradient Compression: accumulate, sparsify, global momentum, local update.

    Args:
        ratio: density (fraction of entries sent), in (0, 1]; 1e-4 = 99.99% dropped.
        momentum: m of the global momentum M (0: none), in [0, 1).
        local_update: hand the optimizer M + (g - sent) instead of M (gradient mode).
        sample_ratio: share of entries in the threshold sample (DGC's 1%).
        min_numel, memory: attach-point policies; ``memory`` must be false.
    """

    name = "sparse_gc"
    search_knob = "ratio"
    default_memory = False
    allows_memory = False  # v, the accumulated delayed gradient, is the residual
    worker_state = ("u", "v")  # (M, the global momentum, is the same on every rank)

    def __init__(
        self,
        ratio: float = 1e-4,
        *,
        momentum: float = 0.9,
        local_update: bool = True,
        sample_ratio: float = 0.01,
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.ratio = check_ratio("compression.ratio", ratio)
        self.momentum = check_momentum("compression.momentum", momentum)
        self.local_update = check_bool("compression.local_update", local_update)
        self.sample_ratio = check_ratio("compression.sample_ratio", sample_ratio)
        self._rule = SelectRule(self.sample_ratio)
        self.gradient_mode = False

    # ------------------------------------------------------------------ training binding
    def bind_training(self, optimizers, steps_per_epoch: int | None) -> list[str]:
        """The ``ddp`` strategy's call: the exchanged tensors are gradients, so the global
        momentum and the local update apply; the optimizer's momentum is set to 0."""
        self.gradient_mode = True
        if self.momentum > 0 and release_optimizer_momentum(optimizers):
            return [
                f"compression=sparse_gc applies a global momentum (compression.momentum="
                f"{self.momentum}); the optimizer's momentum was set to 0 so it is not applied twice"
            ]
        return []

    def bind_exchange(self, steps_per_epoch: int | None, step_of=None) -> list[str]:
        """The elastic strategies' call (``sync_easgd``, ``local_sgd``): the exchanged
        tensors are differences, so the compressor is accumulate-and-sparsify alone."""
        self.gradient_mode = False
        return []

    def state_dict(self) -> dict:
        return {"gradient_mode": self.gradient_mode}

    def load_state_dict(self, state: dict) -> None:
        self.gradient_mode = bool(state.get("gradient_mode", self.gradient_mode))

    def dense_part(self, tensor: torch.Tensor, state: dict, world_size: int) -> torch.Tensor:
        """A tensor under ``min_numel``: in gradient mode u <- m u + g is sent (the rank
        mean of u is the global momentum); otherwise the tensor itself."""
        if not self.gradient_mode or self.momentum == 0:
            return tensor
        flat = tensor.reshape(-1)
        u = state.get("u")
        if u is None or u.shape != flat.shape or u.dtype != flat.dtype or u.device != flat.device:
            u = state["u"] = torch.zeros_like(flat)
        return momentum_dense(flat, u, self.momentum, False).view_as(tensor)

    # ------------------------------------------------------------------ codec
    def select(self, flat: torch.Tensor, state: dict) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError("sparse_gc selects inside compress (it sparsifies v, not g)")

    def compress(self, tensor: torch.Tensor, state: dict):
        """v <- v + g; send the ~ratio n largest |v|; zero them in v."""
        flat = tensor.reshape(-1)
        v = state.get("v")
        if v is None or v.shape != flat.shape or v.dtype != flat.dtype or v.device != flat.device:
            v = state["v"] = torch.zeros_like(flat)
        v.add_(flat)
        k = num_selected(flat.numel(), self.ratio)
        idx, val, _ = dgc_select_values(v, k, self._rule, scratch_of(state))
        payload = sparse_payload(v, idx, val)  # packs a copy of the values
        _native.zero_at(v, idx)
        state["last_nnz"] = int(idx.numel())
        state["last_density"] = self.ratio
        return payload

    fused_segments = True

    def compress_segments(self, flat: torch.Tensor, segments: Segments, state: dict):
        """:meth:`compress` on every segment at once: v (one flat buffer in ``state``) <-
        v + g, each segment's own sampled threshold and k (DGC's kernel without momentum);
        in gradient mode with ``local_update`` g - sent is kept for :meth:`finish_segments`
        (g with the sent values subtracted at their entries: what ``g - local`` gives)."""
        v = state.get("v")
        if v is None or v.shape != flat.shape or v.dtype != flat.dtype or v.device != flat.device:
            v = state["v"] = torch.zeros_like(flat)
        scratch = scratch_of(state)
        unused = scratch_buffer(scratch, "u_unused", flat.numel(), flat.dtype, flat.device)  # no momentum
        idx, val, _ = dgc_segments(flat, unused, v, segments, self.ratio, 0.0, False, self._rule, scratch)
        if self.gradient_mode and self.local_update:
            delayed = scratch_buffer(scratch, "delayed", flat.numel(), flat.dtype, flat.device)
            delayed.copy_(flat)  # read now: the input (DDP's bucket) takes the mean later
            _native.scatter_add_into(delayed, idx, torch.neg(val))
        state["last_nnz"] = int(idx.numel())
        state["last_density"] = self.ratio
        return sparse_payload(v, idx, val)

    def finish_segments(self, out: torch.Tensor, segments: Segments, state: dict) -> None:
        """Gradient mode, on the mean s of the compressed runs: M <- m M + s, then ``out``
        <- (g - sent) + M (``local_update``) or M."""
        if not self.gradient_mode:
            return
        M = state.get("M")
        if M is None or M.shape != out.shape or M.dtype != out.dtype or M.device != out.device:
            M = state["M"] = torch.zeros_like(out)
        delayed = scratch_of(state).get("delayed") if self.local_update else None
        for off, n in segments.runs():
            m = global_momentum_update(M[off : off + n], out[off : off + n], self.momentum)
            if delayed is None:
                out[off : off + n].copy_(m)
            else:
                torch.add(delayed[off : off + n], m, out=out[off : off + n])

    def _launch(self, tensor: torch.Tensor, state: dict, collective: Collective):
        """The sparse exchange; in gradient mode ``finish`` returns M + (g - sent)."""
        if not self.gradient_mode:
            return super()._launch(tensor, state, collective)
        g = tensor.reshape(-1)
        local, finish_sparse = super()._launch(tensor, state, collective)
        # g - sent: this rank's delayed part, read now (the input may change before finish)
        delayed = torch.sub(g, local.reshape(-1)) if self.local_update else None

        def finish() -> torch.Tensor:
            mean_sent = finish_sparse().reshape(-1)
            M = state.get("M")
            if M is None or M.shape != g.shape or M.dtype != g.dtype or M.device != g.device:
                M = state["M"] = torch.zeros_like(g)
            global_momentum_update(M, mean_sent, self.momentum)
            if delayed is None:
                return M.clone().view(tensor.shape)
            return delayed.add_(M).view(tensor.shape)

        return local, finish
