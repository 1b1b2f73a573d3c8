"""A small GPT decoder (pre-LayerNorm, tied input/output embedding) for 3D parallelism.

The model is a flat list of layers so DeepSpeed's :class:`~deepspeed.pipe.PipelineModule`
can cut it into stages:

``TokenEmbedding (tied) -> PositionEmbedding -> GPTBlock x n_layer -> FinalNorm ->
TokenEmbedding.logits (tied)``

Each block is ``h = h + Attn(LN(h)); h = h + MLP(LN(h))`` with causal multi-head
attention (Radford et al., "Language Models are Unsupervised Multitask Learners", 2019).
The fused QKV and the first MLP projection are column-parallel, the attention output and
second MLP projection row-parallel, and the token embedding vocab-parallel
(:mod:`easgd_lightning.parallel.tensor_parallel`), so a block splits over ``tp`` ranks by
heads. Between stages travels one float tensor ``(micro_batch, seq_len, d_model)``.

Layer ``i`` is initialised from ``torch.manual_seed(base_seed + i)`` (DeepSpeed's
``seed_layers``), so :class:`GPT` (single process) and any ``pp x tp`` split of
:func:`build_gpt_pipeline` start from the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from easgd_lightning.compat import lightning as compat
from easgd_lightning.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelContext,
    VocabParallelEmbedding,
)
from easgd_lightning.utils.checks import check_float, check_int, check_positive

__all__ = [
    "GPTConfig",
    "TokenEmbedding",
    "PositionEmbedding",
    "GPTBlock",
    "FinalNorm",
    "tied_logits",
    "gpt_loss",
    "gpt_layer_specs",
    "seed_layer",
    "GPT",
    "build_gpt_pipeline",
    "TIED_KEY",
    "GPTLightningModule",
    "build_lightning_module",
    "gpt_module",
]

TIED_KEY = "embed"


@dataclass
class GPTConfig:
    """Shape of the decoder.

    Attributes:
        vocab_size: Token vocabulary (256 for byte-level text); padded up to a multiple of
            ``tp`` by :meth:`padded_vocab`.
        seq_len: Tokens per sample (the context length).
        n_layer: Transformer blocks.
        n_head: Attention heads; ``tp`` must divide it.
        d_model: Hidden width; ``n_head`` must divide it.
        d_ff: MLP width (default ``4 * d_model``).
        dropout: Dropout on embeddings, attention output and MLP output (0 keeps
            tensor-parallel ranks trivially consistent).
        init_std: Standard deviation of the normal weight initialisation.
    """

    vocab_size: int = 256
    seq_len: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    d_ff: int | None = None
    dropout: float = 0.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for key in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            check_int(f"model.{key}", getattr(self, key))
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})"
            )
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        check_float("model.dropout", self.dropout, 0.0, 1.0, hi_open=True)

    def padded_vocab(self, tp: int = 1) -> int:
        """Vocabulary rounded up to a multiple of ``tp`` (Megatron pads the same way)."""
        return int(math.ceil(self.vocab_size / tp) * tp)

    def as_dict(self) -> dict[str, Any]:
        """Plain dict of the fields."""
        return asdict(self)


class TokenEmbedding(VocabParallelEmbedding):
    """The tied token embedding: lookup at the start, ``logits`` at the end."""

    def __init__(self, cfg: GPTConfig, tp: TensorParallelContext) -> None:
        super().__init__(cfg.padded_vocab(tp.size), cfg.d_model, tp, init_std=cfg.init_std)


class PositionEmbedding(nn.Module):
    """Adds learned absolute position embeddings (replicated on tensor-parallel ranks)."""

    def __init__(self, cfg: GPTConfig, tp: TensorParallelContext | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * cfg.init_std)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.drop(hidden + self.weight[: hidden.shape[1]])


class GPTBlock(nn.Module):
    """Pre-LN transformer block, split by heads over the tensor-parallel group."""

    def __init__(self, cfg: GPTConfig, tp: TensorParallelContext) -> None:
        super().__init__()
        if cfg.n_head % tp.size != 0:
            raise ValueError(
                f"model.n_head ({cfg.n_head}) must be divisible by strategy.tp ({tp.size})"
            )
        self.n_local_heads = cfg.n_head // tp.size
        self.head_dim = cfg.d_model // cfg.n_head
        # Output rows of the fused projection are laid out (head, {q,k,v}, head_dim), so a
        # contiguous column-parallel slice holds whole heads.
        std_out = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = ColumnParallelLinear(cfg.d_model, 3 * cfg.d_model, tp, init_std=cfg.init_std)
        self.proj = RowParallelLinear(cfg.d_model, cfg.d_model, tp, init_std=std_out)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = ColumnParallelLinear(cfg.d_model, cfg.d_ff, tp, init_std=cfg.init_std)
        self.fc2 = RowParallelLinear(cfg.d_ff, cfg.d_model, tp, init_std=std_out)
        self.drop = nn.Dropout(cfg.dropout)
        self.dropout_p = cfg.dropout

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, t, _ = hidden.shape
        qkv = self.qkv(self.ln1(hidden)).view(b, t, self.n_local_heads, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attn = attn.transpose(1, 2).reshape(b, t, self.n_local_heads * self.head_dim)
        hidden = hidden + self.drop(self.proj(attn))
        return hidden + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(hidden)))))


class FinalNorm(nn.LayerNorm):
    """The LayerNorm before the output projection."""

    def __init__(self, cfg: GPTConfig, tp: TensorParallelContext | None = None) -> None:
        super().__init__(cfg.d_model)


def tied_logits(embedding: TokenEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """The tied output projection (``forward_fn`` of the second use of the embedding)."""
    return embedding.logits(hidden)


def gpt_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; padded vocabulary entries never appear as labels."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def seed_layer(seed: int) -> None:
    """Seed torch before building one layer (DeepSpeed's ``seed_fn``; accepts numpy ints)."""
    torch.manual_seed(int(seed))


def gpt_layer_specs(cfg: GPTConfig, tp: TensorParallelContext) -> list:
    """The decoder as DeepSpeed layer specs (built lazily, only on the owning stage)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec(TIED_KEY, TokenEmbedding, cfg, tp, tied_weight_attr=["weight"]),
        LayerSpec(PositionEmbedding, cfg, tp),
        *[LayerSpec(GPTBlock, cfg, tp) for _ in range(cfg.n_layer)],
        LayerSpec(FinalNorm, cfg, tp),
        TiedLayerSpec(
            TIED_KEY, TokenEmbedding, cfg, tp, forward_fn=tied_logits, tied_weight_attr=["weight"]
        ),
    ]


class GPT(nn.Module):
    """The same decoder in one process (reference for tests and ``pp = 1`` runs).

    Layer ``i`` is built after ``torch.manual_seed(base_seed + i)``, exactly as
    :func:`build_gpt_pipeline` builds it on its stage, so the weights match.

    Args:
        cfg: Model shape.
        tp: Tensor-parallel context (default: unsplit).
        base_seed: Seed of layer 0.
    """

    def __init__(
        self, cfg: GPTConfig, tp: TensorParallelContext | None = None, base_seed: int = 1234
    ) -> None:
        super().__init__()
        tp = tp or TensorParallelContext()
        self.cfg = cfg
        torch.manual_seed(base_seed)
        self.embed = TokenEmbedding(cfg, tp)
        torch.manual_seed(base_seed + 1)
        self.pos = PositionEmbedding(cfg, tp)
        blocks = []
        for i in range(cfg.n_layer):
            torch.manual_seed(base_seed + 2 + i)
            blocks.append(GPTBlock(cfg, tp))
        self.blocks = nn.ModuleList(blocks)
        torch.manual_seed(base_seed + 2 + cfg.n_layer)
        self.norm = FinalNorm(cfg, tp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.pos(self.embed(tokens))
        for block in self.blocks:
            hidden = block(hidden)
        return tied_logits(self.embed, self.norm(hidden))


def build_gpt_pipeline(
    cfg: GPTConfig,
    topology: Any,
    *,
    base_seed: int = 1234,
    activation_checkpoint_interval: int = 0,
) -> tuple[Any, TensorParallelContext]:
    """The decoder as a DeepSpeed ``PipelineModule`` over ``topology``.

    ``torch.distributed`` must be initialised and ``LOCAL_RANK`` set. Blocks are divided
    evenly over the pipeline stages (the embedding goes with the first stage, the norm
    and tied output projection with the last).

    Args:
        cfg: Model shape.
        topology: A DeepSpeed ``ProcessTopology`` with axes ``pipe``, ``data`` and
            optionally ``model`` (tensor parallel).
        base_seed: Seed of layer 0 (layer ``i`` uses ``base_seed + i``).
        activation_checkpoint_interval: DeepSpeed activation checkpointing (0: off).

    Returns:
        The pipeline module and the tensor-parallel context its layers share (its group
        is the grid's slice-parallel group).
    """
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    from easgd_lightning.parallel.engine import init_deepspeed_comm

    init_deepspeed_comm()
    axes = topology.get_axis_names()
    tp_size = topology.get_dim("model") if "model" in axes else 1
    tp_rank = topology.get_coord(dist.get_rank()).model if "model" in axes else 0
    tp = TensorParallelContext(size=max(tp_size, 1), rank=tp_rank)
    # no_grad: DeepSpeed broadcasts the tied weights in place while building; recorded by
    # autograd that would turn the tied embedding into a non-leaf tensor.
    with torch.no_grad():
        module = PipelineModule(
            layers=gpt_layer_specs(cfg, tp),
            topology=topology,
            loss_fn=gpt_loss,
            seed_layers=True,
            seed_fn=seed_layer,
            base_seed=base_seed,
            partition_method="type:GPTBlock",
            activation_checkpoint_interval=activation_checkpoint_interval,
        )
    if tp.enabled:
        tp.group = compat.pipeline_slice_group(module)
    return module, tp


# --------------------------------------------------------------------------- Lightning


class GPTLightningModule(pl.LightningModule):
    """The GPT for ``strategy=pipeline_3d`` (and, unsplit, for any other strategy).

    Under :class:`~easgd_lightning.strategies.pipeline.Pipeline3DStrategy` the strategy
    calls :meth:`configure_pipeline` with its DeepSpeed topology; the module then holds
    only this rank's stage (``self.pipe``) and the loss is the pipeline's ``gpt_loss``.
    Under any other strategy :meth:`configure_model` builds the whole :class:`GPT`.

    Args:
        config: :class:`GPTConfig` or a mapping of its fields.
        optimizer: ``adamw`` (default) or ``sgd`` (with ``momentum``, ``nesterov``).
        lr: Learning rate; weight_decay applies to matrices only.
        betas: AdamW betas.
        momentum, nesterov: SGD options.
        warmup_steps: Linear warm-up in optimizer steps.
        schedule: ``constant`` or ``cosine`` (to ``min_lr`` at ``total_steps``).
        total_steps: Cosine horizon (``None``: the trainer's estimated steps).
        min_lr: Floor of the cosine schedule.
        base_seed: Layer ``i`` is initialised from ``base_seed + i``.
    """

    def __init__(
        self,
        config: GPTConfig | dict | None = None,
        optimizer: str = "adamw",
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        schedule: str = "constant",
        total_steps: int | None = None,
        min_lr: float = 0.0,
        base_seed: int = 1234,
        momentum: float = 0.9,
        nesterov: bool = False,
    ) -> None:
        super().__init__()
        if optimizer not in ("adamw", "sgd"):
            raise ValueError(f"optim.optimizer={optimizer!r}; choose one of adamw, sgd")
        if schedule not in ("constant", "cosine"):
            raise ValueError(f"optim.schedule={schedule!r}; choose one of constant, cosine")
        check_positive("optim.lr", lr)
        self.cfg = config if isinstance(config, GPTConfig) else GPTConfig(**dict(config or {}))
        self.lr, self.weight_decay, self.betas = lr, weight_decay, tuple(betas)
        self.warmup_steps, self.schedule, self.total_steps = warmup_steps, schedule, total_steps
        self.min_lr, self.base_seed = min_lr, base_seed
        self.optimizer_name, self.momentum, self.nesterov = optimizer, momentum, nesterov
        self.pipe: nn.Module | None = None
        self.net: GPT | None = None
        self.save_hyperparameters({"model": self.cfg.as_dict(), "lr": lr,
                                   "weight_decay": weight_decay, "schedule": schedule})

    # -- pipeline_3d protocol
    def pipeline_shape(self) -> dict[str, int]:
        """The shape the 3D layout is checked against."""
        return {"n_layer": self.cfg.n_layer, "n_head": self.cfg.n_head, "d_model": self.cfg.d_model}

    def configure_pipeline(self, topology: Any, activation_checkpoint_interval: int = 0):
        """Build this rank's stage as a DeepSpeed ``PipelineModule`` (called by the strategy)."""
        self.pipe, _ = build_gpt_pipeline(
            self.cfg, topology, base_seed=self.base_seed,
            activation_checkpoint_interval=activation_checkpoint_interval,
        )
        return self.pipe

    # -- plain (unsplit) path
    def configure_model(self) -> None:
        strategy = self._trainer.strategy if self._trainer is not None else None
        if self.pipe is None and self.net is None and not hasattr(strategy, "engine"):
            self.net = GPT(self.cfg, base_seed=self.base_seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.net is None:
            raise RuntimeError("forward() runs on the unsplit model; under pipeline_3d the "
                               "engine runs the stages")
        return self.net(tokens)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = gpt_loss(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", gpt_loss(self(x), y), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        params = (self.pipe or self.net or self).parameters()
        params = [p for p in params if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        if self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(
                groups, lr=self.lr, momentum=self.momentum, nesterov=self.nesterov
            )
        else:
            optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas)
        if self.schedule == "constant" and not self.warmup_steps:
            return optimizer
        total = self.total_steps
        if total is None:
            total = int(self.trainer.estimated_stepping_batches) if self._trainer else 1000
        warmup, floor = int(self.warmup_steps), self.min_lr / self.lr

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if self.schedule == "constant":
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def gpt_module(
    vocab_size: int = 256,
    seq_len: int = 64,
    n_layer: int = 4,
    n_head: int = 4,
    d_model: int = 128,
    d_ff: int | None = None,
    dropout: float = 0.0,
    init_std: float = 0.02,
    optim: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> GPTLightningModule:
    """The GPT of this shape (:class:`GPTConfig`), trained with ``optim`` (the keys of the
    config's ``optim``): ``conf/model/gpt_tiny.yaml``'s ``_target_``. easgd-train passes
    ``optim``, ``seed``, ``seq_len`` (``data.seq_len``) and ``vocab_size`` (the data
    module's) where the model config leaves them out.
    """
    optim = dict(optim or {})
    shape = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, n_head=n_head,
                      d_model=d_model, d_ff=d_ff, dropout=dropout, init_std=init_std)
    return GPTLightningModule(
        shape,
        optimizer=str(optim.get("optimizer", "adamw")),
        momentum=float(optim.get("momentum", 0.9)),
        nesterov=bool(optim.get("nesterov", False)),
        lr=float(optim.get("lr", 3e-4)),
        weight_decay=float(optim.get("weight_decay", 0.0)),
        betas=tuple(optim.get("betas", (0.9, 0.95))),
        warmup_steps=int(optim.get("warmup_steps", 0)),
        schedule=str(optim.get("schedule", "constant")),
        total_steps=optim.get("total_steps"),
        min_lr=float(optim.get("min_lr", 0.0)),
        base_seed=int(seed) + 1234,
    )


def build_lightning_module(cfg: Any, datamodule: Any = None) -> GPTLightningModule:
    """The GPT of a whole config (a ``model.builder`` of one's own may start from it):
    the shape from ``cfg.model`` (``seq_len`` defaults to ``cfg.data.seq_len``,
    ``vocab_size`` to the data module's), the optimizer from ``cfg.optim``.
    """
    from omegaconf import DictConfig, OmegaConf

    def plain(node: Any) -> dict:
        if isinstance(node, DictConfig):
            return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
        return dict(node or {})

    model = plain(cfg.get("model"))
    for key in ("name", "builder", "_target_"):
        model.pop(key, None)
    fields = set(GPTConfig.__dataclass_fields__)
    unknown = sorted(set(model) - fields)
    if unknown:
        raise ValueError(f"unknown model key(s) {unknown} for the GPT; valid: {sorted(fields)}")
    data = plain(cfg.get("data"))
    model.setdefault("seq_len", data.get("seq_len", 64))
    if datamodule is not None and getattr(datamodule, "vocab_size", None):
        model.setdefault("vocab_size", datamodule.vocab_size)
    return gpt_module(**model, optim=plain(cfg.get("optim")), seed=int(cfg.get("seed", 0)))
