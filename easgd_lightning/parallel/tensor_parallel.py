"""Megatron-style tensor parallelism: column/row-parallel linear and vocab-parallel embedding.

Rule (Shoeybi et al., "Megatron-LM", 2019, section 3): a transformer MLP ``Y = GeLU(X A) B``
splits ``A`` by columns and ``B`` by rows over ``t`` ranks, so each rank computes
``Y_i = GeLU(X A_i) B_i`` and one all-reduce gives ``Y = sum_i Y_i``. Attention splits the
same way by heads (QKV column-parallel, output projection row-parallel). Two conjugate
autograd functions carry the communication:

* ``f`` = :func:`copy_to_tensor_parallel`: identity forward, all-reduce backward (the
  input of a column-parallel layer is replicated, its gradient is the sum of the
  shards' contributions);
* ``g`` = :func:`reduce_from_tensor_parallel`: all-reduce forward, identity backward (the
  output of a row-parallel layer is the sum of the shards' partial products).

A vocab-parallel embedding splits the vocabulary rows: each rank looks up the tokens in
its range, zeros the others, and ``g`` sums the partial lookups. Its transposed use as the
tied output projection computes the local vocabulary slice of the logits and gathers the
slices along the last dimension (backward: keep this rank's slice).

Every weight is initialised as the *full* (unsplit) matrix from the current random state
and then sliced, so a split model equals the unsplit model built from the same seed. All
communication goes through :mod:`easgd_lightning.comm.ops` with ``kind="tensor_parallel"``.
With ``size == 1`` the layers are plain layers and communicate nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from easgd_lightning.comm import ops
from easgd_lightning.utils.checks import check_int

__all__ = [
    "TensorParallelContext",
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "gather_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "shard_range",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
]

KIND = "tensor_parallel"


@dataclass
class TensorParallelContext:
    """Where a rank sits in its tensor-parallel (model-parallel) group.

    ``size`` and ``rank`` are known from the topology before any process group exists, so
    layers can be sharded at construction; ``group`` may be filled in later (the pipeline
    module creates the groups while it builds its layers) and is read at call time.

    Attributes:
        size: Number of ranks a layer is split over.
        rank: This rank's index in the group, ``0 <= rank < size``.
        group: The ``torch.distributed`` group of the ``size`` ranks, or ``None`` when
            ``size == 1``.
    """

    size: int = 1
    rank: int = 0
    group: Any = None

    def __post_init__(self) -> None:
        check_int("strategy.tp", self.size)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside [0, {self.size})")

    @property
    def enabled(self) -> bool:
        """True when layers are actually split (``size > 1``)."""
        return self.size > 1

    def require_group(self) -> Any:
        """The process group; raises if a split layer runs before the group exists."""
        if self.group is None:
            raise RuntimeError(
                "TensorParallelContext.group is not set: create the model-parallel process "
                "group (e.g. the pipeline grid's slice group) before running split layers"
            )
        return self.group


def shard_range(total: int, size: int, rank: int, what: str = "dimension") -> tuple[int, int]:
    """Start and stop of ``rank``'s contiguous shard of ``total`` items split over ``size``.

    Raises:
        ValueError: if ``size`` does not divide ``total``.
    """
    if total % size != 0:
        raise ValueError(f"{what} ({total}) must be divisible by strategy.tp ({size})")
    per = total // size
    return rank * per, (rank + 1) * per


# --------------------------------------------------------------------------- autograd


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce (sum) backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallelContext) -> torch.Tensor:
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        ops.all_reduce(grad, kind=KIND, group=ctx.tp.require_group())
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallelContext) -> torch.Tensor:
        out = x.contiguous().clone()
        ops.all_reduce(out, kind=KIND, group=tp.require_group())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dimension forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallelContext) -> torch.Tensor:
        ctx.tp = tp
        parts = ops.all_gather(x.contiguous(), kind=KIND, group=tp.require_group())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        tp = ctx.tp
        per = grad.shape[-1] // tp.size
        return grad[..., tp.rank * per : (tp.rank + 1) * per].contiguous(), None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TensorParallelContext) -> torch.Tensor:
        ctx.tp = tp
        per = x.shape[-1] // tp.size
        return x[..., tp.rank * per : (tp.rank + 1) * per].contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = ops.all_gather(grad.contiguous(), kind=KIND, group=ctx.tp.require_group())
        return torch.cat(parts, dim=-1), None


def copy_to_tensor_parallel(x: torch.Tensor, tp: TensorParallelContext) -> torch.Tensor:
    """Megatron's ``f``: identity forward, sum of gradients over the group backward."""
    return _CopyToTP.apply(x, tp) if tp.enabled else x


def reduce_from_tensor_parallel(x: torch.Tensor, tp: TensorParallelContext) -> torch.Tensor:
    """Megatron's ``g``: sum over the group forward, identity backward."""
    return _ReduceFromTP.apply(x, tp) if tp.enabled else x


def gather_from_tensor_parallel(x: torch.Tensor, tp: TensorParallelContext) -> torch.Tensor:
    """Concatenate every rank's last-dimension slice (backward: this rank's slice)."""
    return _GatherFromTP.apply(x, tp) if tp.enabled else x


def scatter_to_tensor_parallel(x: torch.Tensor, tp: TensorParallelContext) -> torch.Tensor:
    """This rank's slice of the last dimension (backward: all-gather)."""
    return _ScatterToTP.apply(x, tp) if tp.enabled else x


# --------------------------------------------------------------------------- layers


def _init_full(shape: tuple[int, ...], std: float) -> torch.Tensor:
    """The unsplit weight from the current RNG state (same on every tensor-parallel rank)."""
    weight = torch.empty(shape)
    nn.init.normal_(weight, mean=0.0, std=std)
    return weight


class _SplitLinear(nn.Module):
    """What the two split linears share: the widths, the context, this rank's slice of the
    full ``(out_features, in_features)`` weight along ``split_dim`` (0: output features, 1:
    input features), initialised whole and identically on every rank, and a bias as wide as
    the slice's output (zeros)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallelContext,
        *,
        bias: bool,
        init_std: float,
        split_dim: int,
    ) -> None:
        super().__init__()
        shape = (out_features, in_features)
        what = "output features" if split_dim == 0 else "input features"
        start, stop = shard_range(shape[split_dim], tp.size, tp.rank, what)
        self.in_features = in_features
        self.out_features = out_features
        self.tp = tp
        full = _init_full(shape, init_std)
        self.weight = nn.Parameter(full.narrow(split_dim, start, stop - start).clone())
        self.bias = nn.Parameter(torch.zeros(self.weight.shape[0])) if bias else None


class ColumnParallelLinear(_SplitLinear):
    """``Y = X A + b`` with ``A`` split by output columns over the tensor-parallel group.

    Args:
        in_features: Input width (replicated on every rank).
        out_features: Full output width; must be divisible by ``tp.size``.
        tp: The tensor-parallel context.
        bias: Whether to add a (split) bias.
        gather_output: Concatenate the output slices (otherwise each rank keeps its slice,
            the input of a following :class:`RowParallelLinear`).
        init_std: Standard deviation of the normal initialisation of the full weight.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallelContext,
        *,
        bias: bool = True,
        gather_output: bool = False,
        init_std: float = 0.02,
    ) -> None:
        super().__init__(in_features, out_features, tp, bias=bias, init_std=init_std, split_dim=0)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tensor_parallel(x, self.tp), self.weight, self.bias)
        return gather_from_tensor_parallel(y, self.tp) if self.gather_output else y


class RowParallelLinear(_SplitLinear):
    """``Y = X A + b`` with ``A`` split by input rows; partial products summed over the group.

    Args:
        in_features: Full input width; must be divisible by ``tp.size``.
        out_features: Output width (replicated).
        tp: The tensor-parallel context.
        bias: Whether to add a (replicated) bias after the reduction.
        input_is_parallel: The input already holds this rank's slice (output of a
            :class:`ColumnParallelLinear` with ``gather_output=False``); otherwise it is
            sliced here.
        init_std: Standard deviation of the normal initialisation of the full weight.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TensorParallelContext,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        init_std: float = 0.02,
    ) -> None:
        super().__init__(in_features, out_features, tp, bias=bias, init_std=init_std, split_dim=1)
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel(x, self.tp)
        y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary rows split over the tensor-parallel group.

    ``forward(tokens)`` looks up the tokens this rank owns, zeros the rest and sums over
    the group. :meth:`logits` is the tied output projection ``h E^T``: this rank's
    vocabulary slice of the logits, gathered along the last dimension.

    Args:
        num_embeddings: Full vocabulary size; must be divisible by ``tp.size``.
        embedding_dim: Hidden width.
        tp: The tensor-parallel context.
        init_std: Standard deviation of the normal initialisation of the full table.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp: TensorParallelContext,
        *,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        start, stop = shard_range(num_embeddings, tp.size, tp.rank, "vocabulary size")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp = tp
        self.vocab_start, self.vocab_stop = start, stop
        full = _init_full((num_embeddings, embedding_dim), init_std)
        self.weight = nn.Parameter(full[start:stop].clone())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_stop)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        emb = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel(emb, self.tp)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``hidden @ E^T`` (tied output projection)."""
        local = F.linear(copy_to_tensor_parallel(hidden, self.tp), self.weight)
        return gather_from_tensor_parallel(local, self.tp)
