"""Optimus-CC: pipeline-aware compression for 3D-parallel training (``optimus_cc``).

Song et al., "Optimus-CC: Efficient Large NLP Model Training with 3D Parallelism Aware
Communication Compression", ASPLOS 2023. Five techniques, each switchable here:

1. **Compressed backpropagation (CB).** The activation gradient a stage sends to the
   previous stage, ``M`` of shape ``(micro_batch * seq) x hidden``, travels as a rank-``r``
   factorisation ``M ~ P Q^T`` computed by one power iteration with a warm-started ``Q``
   (PowerSGD, Vogels et al., NeurIPS 2019): ``P = M Q; P = orth(P); Q = M^T P``. ``P`` and
   ``Q`` go point-to-point; the receiver rebuilds ``P Q^T``. Forward activations stay exact.
2. **Lazy error propagation (LEP).** The sender keeps the residual ``e = M' - P Q^T`` of
   its message ``M' = M + e_prev`` and adds it to its *next* backward message instead of
   correcting immediately.
3. **Epilogue-only compression.** Only the backward sends of the 1F1B cool-down (after
   the sending stage's last forward pass of the batch) are compressed; those are on the
   critical path. Stage ``s`` of ``S`` sends micro-batch ``m`` of ``M`` in the cool-down
   iff ``m >= M - (S - s)`` (:func:`is_epilogue_send`): every backward send after the
   sender's last forward pass, when the receiving stage has no forward work left and
   waits. (The authors' Megatron code flags only the ``S - s - 1`` backward passes that
   have no paired forward, which leaves the last stage's final send dense and compresses
   nothing at ``pp = 2``.)
4. **Fused embedding synchronisation (FE).** The tied embedding gradient is summed over
   the first and last stages of *all* data-parallel replicas in one all-reduce (divided by
   ``dp``), instead of a data-parallel all-reduce followed by a first/last-stage
   all-reduce. Result: ``mean_dp(g_first + g_last)`` either way.
5. **Selective stage compression (SC).** Data-parallel PowerSGD (rank ``dp_rank``, error
   feedback ``e <- M - P Q^T``) only on chosen stages. ``"auto"`` picks the first
   ``ceil(S / 2)`` stages: in 1F1B stage ``s`` finishes its backward ``s`` micro-batch
   backward times before stage 0, so the first stages have the least slack to hide their
   all-reduce behind (:func:`auto_selective_stages`).

Defaults: ``rank=16`` (paper: 12-16), ``dp_rank=128`` (paper), scaled down automatically
when a matrix is too small for the low-rank form to save bytes (then it goes dense).
Tensor-parallel traffic stays exact.

One codec and one residual memory serve here as everywhere: CB and SC are
:class:`~easgd_lightning.hooks.compressors.powersgd.PowerSGDCompressor` (``trailing``
matrix view) with :class:`~easgd_lightning.hooks.memory.ResidualMemory` for LEP and SC's
error feedback (``e <- M - P Q^T``, this rank's Q, as at every other attach point). The
pure functions here have no process-group calls; :class:`DataParallelPowerSGD`
communicates only through :mod:`easgd_lightning.comm` (a
:class:`~easgd_lightning.hooks.collective.ProcessGroupCollective` and
:func:`dense_all_reduce_mean_`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from easgd_lightning.comm import ops
from easgd_lightning.hooks.collective import ProcessGroupCollective
from easgd_lightning.hooks.compressors.base import Compressor, Payload
from easgd_lightning.hooks.compressors.powersgd import PowerSGDCompressor, low_rank_product
from easgd_lightning.hooks.memory import NoMemory, ResidualMemory
from easgd_lightning.utils.checks import check_bool, check_int

__all__ = [
    "OptimusCCConfig",
    "is_epilogue_send",
    "auto_selective_stages",
    "resolve_selective_stages",
    "ActivationGradCompressor",
    "DataParallelPowerSGD",
    "dense_all_reduce_mean_",
    "OptimusCCCompressor",
]

_TECHNIQUES = (
    "compressed_backprop",
    "lazy_error_propagation",
    "epilogue_only",
    "fused_embedding",
)


@dataclass
class OptimusCCConfig:
    """Which Optimus-CC techniques are on, and their ranks.

    Attributes:
        compressed_backprop: CB: low-rank inter-stage activation gradients.
        lazy_error_propagation: LEP: carry CB's residual into the next backward message.
        epilogue_only: Compress only the cool-down (epilogue) backward sends.
        fused_embedding: FE: one all-reduce for the tied embedding over first+last stages
            of all data-parallel replicas.
        selective_stages: Stages whose data-parallel gradients use PowerSGD: a list of
            stage ids, ``"auto"``, ``"all"`` or ``"none"`` (or an empty list).
        rank: CB rank ``r``.
        dp_rank: Data-parallel PowerSGD rank.
        seed: Seed of the warm-start ``Q`` matrices.
    """

    compressed_backprop: bool = True
    lazy_error_propagation: bool = True
    epilogue_only: bool = False
    fused_embedding: bool = True
    selective_stages: Any = "auto"
    rank: int = 16
    dp_rank: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        for key in _TECHNIQUES:
            check_bool(f"compression.{key}", getattr(self, key))
        for key in ("rank", "dp_rank"):
            check_int(f"compression.{key}", getattr(self, key))
        sel = self.selective_stages
        if isinstance(sel, str):
            if sel not in ("auto", "all", "none"):
                raise ValueError(
                    "compression.selective_stages must be a list of stage ids or one of "
                    f"'auto', 'all', 'none'; got {sel!r}"
                )
        elif sel is None:
            self.selective_stages = "none"
        else:
            try:
                stages = [int(s) for s in sel]
            except (TypeError, ValueError):
                raise ValueError(
                    "compression.selective_stages must be a list of stage ids or one of "
                    f"'auto', 'all', 'none'; got {sel!r}"
                ) from None
            if any(s < 0 for s in stages):
                raise ValueError(f"compression.selective_stages has a negative stage: {stages}")
            self.selective_stages = stages

    @classmethod
    def from_mapping(cls, params: dict | None) -> OptimusCCConfig:
        """Build from a config mapping; unknown keys are an error naming the valid ones."""
        params = dict(params or {})
        params.pop("name", None)
        params.pop("_target_", None)
        valid = set(cls.__dataclass_fields__)
        unknown = sorted(set(params) - valid)
        if unknown:
            raise ValueError(
                f"unknown compression key(s) {unknown} for optimus_cc; valid: {sorted(valid)}"
            )
        if "selective_stages" in params and not isinstance(params["selective_stages"], str):
            sel = params["selective_stages"]
            params["selective_stages"] = None if sel is None else list(sel)
        return cls(**params)


# --------------------------------------------------------------------------- pure rules


def is_epilogue_send(micro_batch: int, micro_batches: int, stages: int, sender_stage: int) -> bool:
    """Whether the backward send of ``micro_batch`` by ``sender_stage`` is in the cool-down.

    In the synchronous 1F1B schedule (DeepSpeed's ``TrainSchedule``) stage ``s`` runs its
    last forward pass before the backward passes of the last ``S - s`` micro-batches; those
    backward sends happen while the pipeline drains (the epilogue), on the critical path.

    Args:
        micro_batch: Index of the micro-batch in the batch, ``0 <= m < M``.
        micro_batches: ``M``.
        stages: ``S``.
        sender_stage: ``s >= 1`` (stage 0 sends no gradients).
    """
    return micro_batch >= micro_batches - (stages - sender_stage)


def auto_selective_stages(stages: int) -> list[int]:
    """Stages whose data-parallel all-reduce is on the critical path: the first ``ceil(S/2)``.

    In 1F1B stage ``s`` finishes its last backward pass about ``s`` micro-batch backward
    times before stage 0 does, time in which its gradient all-reduce can hide; stage 0
    has no slack, the last stages the most.
    """
    return list(range(max(1, math.ceil(stages / 2))))


def resolve_selective_stages(selective: Any, stages: int) -> list[int]:
    """Turn ``compression.selective_stages`` into a sorted list of valid stage ids.

    Raises:
        ValueError: if a listed stage does not exist.
    """
    if selective == "auto":
        return auto_selective_stages(stages)
    if selective == "all":
        return list(range(stages))
    if selective in ("none", None):
        return []
    chosen = sorted({int(s) for s in selective})
    bad = [s for s in chosen if not 0 <= s < stages]
    if bad:
        raise ValueError(
            f"compression.selective_stages lists stage(s) {bad} but the pipeline has stages "
            f"0..{stages - 1} (strategy.pp={stages})"
        )
    return chosen


# --------------------------------------------------------------------------- CB + LEP

_MESSAGE = "activation_grad"  # the residual memory's key for the stage's backward message


class ActivationGradCompressor:
    """Compressed backpropagation on the sending stage (CB, optionally with LEP).

    One instance per sending stage. The codec is PowerSGD's single-rank encoding of the
    message viewed as ``(prod(shape[:-1]), shape[-1])``; LEP is the residual memory
    (``e <- M' - P Q^T``, added to the next message). A dense message carries the
    residual in full, so nothing is owed after it.

    Args:
        rank: Rank ``r`` of the factorisation.
        lazy_error_propagation: Keep the residual and add it to the next message.
        seed: Seed of the initial ``Q``.
    """

    def __init__(self, rank: int = 16, lazy_error_propagation: bool = True, seed: int = 0) -> None:
        self.rank = rank
        self.lazy_error_propagation = lazy_error_propagation
        self.seed = seed
        self.codec = PowerSGDCompressor(rank, seed=seed, matrix_view="trailing")
        self.memory = ResidualMemory() if lazy_error_propagation else NoMemory()
        self._state: dict = {}
        self.stats = {"compressed": 0, "dense": 0}

    def factor_shapes(self, shape: Sequence[int]) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """Shapes of ``(P, Q)`` for a gradient of ``shape``, or ``None`` if it goes dense."""
        return self.codec.factor_shapes(shape)

    @property
    def residual(self) -> torch.Tensor | None:
        """What LEP carries into the next message (None: nothing)."""
        return self.memory.residual(_MESSAGE)

    def compress(self, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Factor the message ``grad + residual`` into ``(P, Q)`` and update the residual.

        The caller must have checked :meth:`factor_shapes` is not ``None``.
        """
        message = self.memory.compensate(_MESSAGE, grad)
        payload = self.codec.compress(message, self._state)
        if payload.meta["dense"]:
            raise ValueError(f"optimus_cc: a {tuple(grad.shape)} gradient travels dense")
        if self.lazy_error_propagation:
            self.memory.update(_MESSAGE, message, self.codec.decompress(payload, message.shape))
        self.stats["compressed"] += 1
        p, q = payload.tensors
        return p.contiguous(), q.contiguous()

    def dense(self, grad: torch.Tensor) -> torch.Tensor:
        """A dense message: the gradient plus any carried residual, which is then spent."""
        message = self.memory.compensate(_MESSAGE, grad)
        self.memory.reset()
        self.stats["dense"] += 1
        return message

    @staticmethod
    def decompress(p: torch.Tensor, q: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """The receiver's rebuild ``P Q^T`` in the gradient's shape."""
        return low_rank_product(p, q, shape)

    def state_dict(self) -> dict:
        codec = {k: v for k, v in self._state.items() if k != "_scratch"}
        return {"codec": codec, "memory": self.memory.state_dict(), "stats": dict(self.stats)}

    def load_state_dict(self, state: dict) -> None:
        self._state = dict(state.get("codec", {}))
        self.memory.load_state_dict(state.get("memory", {}))
        self.stats.update(state.get("stats", {}))


# --------------------------------------------------------------------------- DP PowerSGD


class DataParallelPowerSGD:
    """Data-parallel PowerSGD with error feedback for one stage's gradients (SC).

    Each gradient ``G`` is compensated by the residual memory (``M = G + E``) and reduced
    by :meth:`PowerSGDCompressor.aggregate_many` (``trailing`` view): all ``P`` of a step
    in one flat all-reduce, then all ``Q``; the gradient becomes the mean ``P Q_bar^T``
    and ``E <- M - P Q^T`` with this rank's ``Q``. Tensors that are 1-D or too small to
    save bytes are averaged densely (one flat all-reduce).

    Args:
        rank: The PowerSGD rank.
        group: The data-parallel process group.
        world_size: Its size.
        seed: Seed of the initial ``Q`` (identical on every replica).
        kind: Meter kind of the traffic.
    """

    def __init__(
        self, rank: int, group: Any, world_size: int, seed: int = 0, kind: str = "data_parallel"
    ) -> None:
        self.rank = rank
        self.group = group
        self.world_size = world_size
        self.kind = kind
        self.codec = PowerSGDCompressor(rank, seed=seed, matrix_view="trailing")
        self.memory = ResidualMemory()
        self._collective: ProcessGroupCollective | None = None
        self._states: dict[int, dict] = {}

    def reduce_(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Replace each ``p.grad`` by its (approximate) mean over the data-parallel group."""
        grads = [p.grad for p in params if p.grad is not None]
        low = [i for i, g in enumerate(grads) if self.codec.compresses(g.shape)]
        dense_all_reduce_mean_(
            [g for g in grads if not self.codec.compresses(g.shape)], group=self.group,
            world_size=self.world_size, kind=self.kind,
        )
        if not low:
            return
        if self._collective is None:
            self._collective = ProcessGroupCollective(self.group, kind=self.kind)
        messages = [self.memory.compensate(i, grads[i]) for i in low]
        states = [self._states.setdefault(i, {"key_hash": i}) for i in low]
        self._collective.charge_dense(ops.nbytes(*messages))
        results = self.codec.aggregate_many(messages, states, self._collective)
        for i, message, (mean, local) in zip(low, messages, results):
            self.memory.update(i, message, local)
            grads[i].copy_(mean)

    def state_dict(self) -> dict:
        codec = {i: {k: v for k, v in s.items() if k != "_scratch"} for i, s in self._states.items()}
        return {"codec": codec, "memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self._states = {i: dict(s) for i, s in state.get("codec", {}).items()}
        self.memory.load_state_dict(state.get("memory", {}))


def _unflatten(flat: torch.Tensor, shapes: Iterable[torch.Size]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = int(math.prod(shape))
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def dense_all_reduce_mean_(
    grads: Sequence[torch.Tensor], *, group: Any, world_size: int, kind: str, divide: int | None = None
) -> None:
    """Average ``grads`` in place over ``group`` with one flat all-reduce.

    Args:
        grads: Tensors to reduce (left untouched when empty).
        group: Process group.
        world_size: Size of ``group``.
        kind: Meter kind.
        divide: Divisor after the sum (default ``world_size``).
    """
    grads = [g for g in grads if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    ops.all_reduce(flat, kind=kind, group=group)
    flat.div_(world_size if divide is None else divide)
    for g, part in zip(grads, _unflatten(flat, [g.shape for g in grads])):
        g.copy_(part)


# --------------------------------------------------------------------------- registry entry


class OptimusCCCompressor(Compressor):
    """``compression=optimus_cc``: the CB codec, carrying the Optimus-CC settings.

    ``strategy=pipeline_3d`` reads :attr:`optimus_config` and applies all five techniques.
    As a plain compressor (the shared interface, DESIGN.md 4.3) it is the CB codec,
    PowerSGD's single-rank encoding with the ``trailing`` view (warm start kept in
    ``state``); tensors where the factors would not be smaller travel dense. Factors of
    different ranks do not add up, so the aggregation is ``allgather``.

    Args: the fields of :class:`OptimusCCConfig`, plus the shared ``min_numel`` and ``memory``.
    """

    name = "optimus_cc"
    aggregation = "allgather"
    pipeline_only = True

    def __init__(
        self,
        compressed_backprop: bool = True,
        lazy_error_propagation: bool = True,
        epilogue_only: bool = False,
        fused_embedding: bool = True,
        selective_stages: Any = "auto",
        rank: int = 16,
        dp_rank: int = 128,
        seed: int = 0,
        *,
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.optimus_config = OptimusCCConfig(
            compressed_backprop=compressed_backprop,
            lazy_error_propagation=lazy_error_propagation,
            epilogue_only=epilogue_only,
            fused_embedding=fused_embedding,
            selective_stages=selective_stages,
            rank=rank,
            dp_rank=dp_rank,
            seed=seed,
        )
        self.codec = PowerSGDCompressor(rank, seed=seed, matrix_view="trailing")

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        return self.codec.compress(tensor, state)

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        return self.codec.decompress(payload, shape)


def _register() -> None:
    from easgd_lightning.hooks.compressors import register_compressor

    register_compressor(OptimusCCCompressor)


_register()
