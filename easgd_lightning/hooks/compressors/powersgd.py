"""``powersgd``: rank-r power iteration with warm start (Vogels, Karimireddy, Jaggi, NeurIPS 2019).

Rule, for a gradient reshaped to M (n x m) with error feedback M <- M + e and the
previous step's Q (m x r; first step: N(0, 1) drawn from one seed on every rank):
  P = M Q;  P <- allreduce_mean(P);  P <- orthonormalize(P)
  Q = M^T P;  Q_bar = allreduce_mean(Q);  mean = P Q_bar^T;  e <- M - P Q^T (local Q)
Bytes (n + m) r per element size instead of n m. 1-D tensors, and matrices for which
(n + m) r >= n m, travel dense (one all-reduce). Defaults: rank = 2, warm_start = true,
seed = 0, memory = true.
"""

from __future__ import annotations

import zlib

import torch

from easgd_lightning.hooks.compressors.base import (
    Collective,
    Compressor,
    Payload,
    check_int,
)

__all__ = ["PowerSGDCompressor", "orthonormalize", "as_matrix", "power_iteration"]


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """View a tensor as (shape[0], rest): the matrix PowerSGD factorizes."""
    return tensor.reshape(tensor.shape[0], -1) if tensor.dim() > 1 else tensor.reshape(-1, 1)


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning p's columns (reduced QR; float32/64)."""
    work = p if p.dtype in (torch.float32, torch.float64) else p.float()
    q, _ = torch.linalg.qr(work, mode="reduced")
    return q.to(p.dtype)


def power_iteration(mat: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One single-rank PowerSGD step: P = orth(M Q), Q' = M^T P; M_hat = P Q'^T.

    With r >= rank(M) and a generic Q, P spans M's column space, so M_hat = P P^T M = M.
    """
    p = orthonormalize(mat @ q)
    return p, mat.t() @ p


class PowerSGDCompressor(Compressor):
    """Low-rank compression by one step of subspace iteration, warm-started.

    Args:
        rank: r, the rank of the approximation (>= 1).
        warm_start: reuse the previous Q (otherwise a fresh seeded Q each step).
        seed: seed of the initial Q, identical on every rank.
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "powersgd"
    aggregation = "allreduce"
    default_memory = True

    def __init__(
        self,
        rank: int = 2,
        *,
        warm_start: bool = True,
        seed: int = 0,
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.rank = check_int("rank", rank, 1)
        if not isinstance(warm_start, bool):
            raise ValueError(f"compression.warm_start must be true or false, got {warm_start!r}")
        self.warm_start = warm_start
        self.seed = check_int("seed", seed, 0)

    # ------------------------------------------------------------------ helpers
    def compresses(self, shape: torch.Size) -> bool:
        """Whether a tensor of ``shape`` is factorized (else it travels dense)."""
        if len(shape) < 2:
            return False
        n = shape[0]
        m = 1
        for d in shape[1:]:
            m *= d
        r = min(self.rank, n, m)
        return (n + m) * r < n * m

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
        mat = as_matrix(tensor)
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
        return (p @ q.t()).reshape(shape)

    def aggregate(
        self, tensor: torch.Tensor, state: dict, collective: Collective
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two all-reduce rounds (P, then Q); returns (P Q_bar^T, P Q_local^T)."""
        world = collective.world_size
        if not self.compresses(tensor.shape):
            (summed,) = collective.all_reduce_sum([tensor.reshape(-1)])
            return summed.reshape(tensor.shape) / world, tensor.clone()
        mat = as_matrix(tensor)
        n, m = mat.shape
        r = min(self.rank, n, m)
        q = self._initial_q(m, r, state, mat)
        (p,) = collective.all_reduce_sum([mat @ q])
        p = orthonormalize(p / world)
        q_local = mat.t() @ p
        (q_sum,) = collective.all_reduce_sum([q_local])
        q_mean = q_sum / world
        state["q"] = q_mean
        state["step"] = int(state.get("step", 0)) + 1
        state["last_payload_bytes"] = (p.numel() + q_local.numel()) * p.element_size()
        mean = (p @ q_mean.t()).reshape(tensor.shape)
        local = (p @ q_local.t()).reshape(tensor.shape)
        return mean, local
