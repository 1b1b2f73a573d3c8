"""3D parallelism (pipeline x tensor x data) over DeepSpeed's pipeline engine (``pipeline_3d``).

The model is a DeepSpeed ``PipelineModule`` (the LightningModule builds it in
``configure_pipeline(topology)``); DeepSpeed's ``PipeModelDataParallelTopology`` lays the
``pp * tp * dp`` ranks out as ``(pipe, data, model)`` and gives the pipe / model (tensor)
/ data groups. Training runs DeepSpeed's synchronous 1F1B ``TrainSchedule`` (Narayanan et
al., "PipeDream" / "Megatron-LM 2", 2021; DeepSpeed's ``PipelineEngine``):

* one Lightning step is one ``engine.train_batch``: the batch the Lightning data loader
  yields (``micro_batches * micro_batch_size`` samples per data-parallel replica) is cut
  into ``strategy.micro_batches`` micro-batches, the engine runs forward/backward over them
  with gradient accumulation, reduces gradients and steps the optimizer;
* ``train/loss`` (and ``val/loss``) are the engine's loss, averaged over micro-batches and
  data-parallel replicas, logged through Lightning on every rank;
* compression ``none`` or ``optimus_cc`` (:mod:`easgd_lightning.hooks.optimus_cc`);
  every inter-stage, data-parallel, tensor-parallel and embedding byte is metered
  (:class:`~easgd_lightning.parallel.engine.OptimusPipelineEngine`).

Lightning's own ``DeepSpeedStrategy`` refuses CPU accelerators; this strategy is a
``DDPStrategy`` (process groups, launchers, cluster environments) that never wraps the
module in DDP and drives the engine itself. It runs on CPU with gloo and on GPU with NCCL
(DeepSpeed's accelerator follows the Lightning accelerator).

Checkpoints are directories: ``stage{pp}_tp{tp}.pt`` per (stage, tensor rank), written by
the first data-parallel replica (model shard and optimizer state); with Optimus-CC, one
``optimus_stage{pp}_tp{tp}_dp{dp}.pt`` per rank (residuals and warm starts differ per
replica); and ``meta.pt`` (loops, callbacks, schedulers) written last by global rank 0,
after a barrier. Every file is written atomically, so a directory with ``meta.pt`` is
complete. Every rank restores its own shard.

After ``fit`` each rank's LightningModule holds its own stage (and tensor shard) of the
trained model; a checkpoint holds all of them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from torch.optim import Optimizer
from typing_extensions import override

from easgd_lightning.comm import ops
from easgd_lightning.compat.lightning import PATH
from easgd_lightning.hooks.optimus_cc import OptimusCCConfig
from easgd_lightning.parallel.layout import validate_layout
from easgd_lightning.strategies.registry import register_strategy, reject_unknown_kwargs
from easgd_lightning.utils.checkpoint import (
    CHECKSUM_KEY,
    CheckpointError,
    load_checkpoint_file,
    save_checkpoint_file,
    to_plain,
)
from easgd_lightning.utils.checks import check_int, check_positive

__all__ = ["Pipeline3DStrategy", "split_micro_batches", "resolve_optimus"]

log = logging.getLogger(__name__)

_SHARD_KEYS = ("state_dict", "optimizer_states")
_META = "meta.pt"


def split_micro_batches(batch: Any, micro_batches: int) -> list[tuple]:
    """Cut a ``(inputs, labels)`` batch into ``micro_batches`` equal ``(inputs, labels)`` pieces.

    Raises:
        ValueError: if the batch size is not a multiple of ``micro_batches``.
    """
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError("strategy=pipeline_3d expects batches of (inputs, labels)")
    inputs, labels = batch
    n = inputs.shape[0]
    if n % micro_batches != 0:
        raise ValueError(
            f"the batch size per replica ({n}, data.batch_size) must be a multiple of "
            f"strategy.micro_batches ({micro_batches})"
        )
    return list(zip(inputs.chunk(micro_batches), labels.chunk(micro_batches)))


def resolve_optimus(compression: Any) -> OptimusCCConfig | None:
    """The Optimus-CC settings from ``compression`` (None, a name, a mapping, a config or a
    compressor object carrying ``optimus_config``).

    Raises:
        ValueError: for any compression other than ``none`` and ``optimus_cc``.
    """
    if compression is None or compression == "none":
        return None
    if isinstance(compression, OptimusCCConfig):
        return compression
    if compression == "optimus_cc":
        return OptimusCCConfig()
    config = getattr(compression, "optimus_config", None)
    if isinstance(config, OptimusCCConfig):
        return config
    if isinstance(compression, Mapping):
        name = compression.get("name", "optimus_cc")
        if name == "none":
            return None
        if name == "optimus_cc":
            return OptimusCCConfig.from_mapping(dict(compression))
        compression = name
    name = getattr(compression, "name", compression)
    raise ValueError(
        f"strategy=pipeline_3d supports compression=none or compression=optimus_cc, got {name!r}"
    )


@register_strategy(
    "pipeline_3d",
    options=("pp", "tp", "dp", "micro_batches", "gradient_clipping", "activation_checkpoint_interval"),
)
class Pipeline3DStrategy(DDPStrategy):
    """Pipeline x tensor x data parallel training on DeepSpeed's PipelineEngine (``pipeline_3d``).

    Args:
        pp: Pipeline stages (``strategy.pp``).
        tp: Tensor-parallel degree (``strategy.tp``).
        dp: Data-parallel degree (``strategy.dp``; ``None``: world size / (pp * tp)).
        micro_batches: Micro-batches per step (``strategy.micro_batches``); the loader's
            batch per replica is cut into this many.
        compression: ``None``/``"none"`` or Optimus-CC (``"optimus_cc"``, a mapping of
            :class:`OptimusCCConfig` fields, an :class:`OptimusCCConfig`, or the
            ``optimus_cc`` compressor object).
        gradient_clipping: Global gradient-norm clipping inside the engine (0: off;
            ``Trainer(gradient_clip_val=...)`` is used when this is 0).
        activation_checkpoint_interval: DeepSpeed activation checkpointing (0: off).
        n_layer, n_head, d_model: The model's shape, for checking the layout before any
            process starts (also read from the LightningModule's ``pipeline_shape()``).
        deepspeed_config: Extra DeepSpeed config keys merged into the generated config.
        **kwargs: ``DDPStrategy`` arguments (``timeout``, ``process_group_backend``, ...).
    """

    #: one optimizer, stepped by the engine; the user's training_step is not called (the
    #: engine runs the pipeline schedule), so manual optimization cannot be honoured
    max_optimizers = 1
    supports_manual_optimization = False

    strategy_name = "pipeline_3d"
    min_world_size = 1
    #: what the CLI checks before launch (strategies/registry.py, StrategySpec): the model's
    #: pipeline form, fp32 (setup refuses other precision plugins), a checkpoint directory
    #: of per-stage shards completed by meta.pt; the fork server imports DeepSpeed once
    module_method = ("configure_pipeline", "pipeline form", "use model=gpt_tiny or a recipe=nlp3d/... recipe")
    required_precision = ("32-true", "fp32")
    checkpoint_index = _META
    preload_modules = ("easgd_lightning.parallel.engine",)
    supports_final_validate = True
    #: why ``easgd_lightning.fabric`` refuses it
    fabric_refusal = (
        "DeepSpeed's pipeline engine runs each batch's forward and backward itself (the "
        "micro-batch schedule across stages), so a hand-written loop has no forward, backward "
        "and step of its own to hook"
    )

    def __init__(
        self,
        pp: int = 1,
        tp: int = 1,
        dp: int | None = None,
        micro_batches: int = 4,
        compression: Any = None,
        gradient_clipping: float = 0.0,
        activation_checkpoint_interval: int = 0,
        n_layer: int | None = None,
        n_head: int | None = None,
        d_model: int | None = None,
        deepspeed_config: dict | None = None,
        **kwargs: Any,
    ) -> None:
        reject_unknown_kwargs(self, kwargs, DDPStrategy)  # the engine, not DDP, runs the model
        kwargs.setdefault("process_group_backend", None)
        super().__init__(**kwargs)
        for key, value in (("strategy.pp", pp), ("strategy.tp", tp), ("strategy.micro_batches", micro_batches)):
            check_int(key, value)
        check_int("strategy.dp", dp, nullable=True)
        self.pp, self.tp, self.dp = pp, tp, dp
        self.micro_batches = micro_batches
        self._optimus = resolve_optimus(compression)
        self.gradient_clipping = check_positive("strategy.gradient_clipping", gradient_clipping, allow_zero=True)
        self.activation_checkpoint_interval = check_int(
            "strategy.activation_checkpoint_interval", activation_checkpoint_interval, 0
        )
        self._shape = {"n_layer": n_layer, "n_head": n_head, "d_model": d_model}
        self._ds_extra = dict(deepspeed_config or {})
        self._topology: Any = None
        self._engine: Any = None
        self._pending_optimus_state: dict | None = None
        self._recent_losses: list[float] = []
        self.local_steps = 0

    # ------------------------------------------------------------------ config

    @classmethod
    def cli_kwargs(cls, cfg: Any) -> dict:
        """Constructor arguments the CLI takes from outside ``cfg.strategy``: the model's
        shape (for layout checks) and the Optimus-CC settings of ``cfg.compression``."""
        model = cfg.get("model", {}) or {}
        out: dict[str, Any] = {k: model.get(k) for k in ("n_layer", "n_head", "d_model")}
        compression = cfg.get("compression", {}) or {}
        if compression.get("name", "none") == "optimus_cc":
            from omegaconf import DictConfig, OmegaConf

            out["compression"] = (
                OmegaConf.to_container(compression, resolve=True)
                if isinstance(compression, DictConfig)
                else dict(compression)
            )
        return out

    def validate_world_size(self, world_size: int) -> None:
        """Check ``pp * tp * dp == world_size`` and the model shape (before processes start)."""
        dp = self.dp if self.dp is not None else max(1, world_size // (self.pp * self.tp))
        validate_layout(
            self.pp, self.tp, dp, world_size,
            n_layers=self._shape["n_layer"], n_heads=self._shape["n_head"],
            d_model=self._shape["d_model"], micro_batches=self.micro_batches,
        )

    @property
    def layout(self) -> dict[str, int]:
        """``{"pp", "tp", "dp"}`` once the world size is known."""
        return {"pp": self.pp, "tp": self.tp, "dp": self._resolved_dp()}

    def _resolved_dp(self) -> int:
        if self.dp is not None:
            return self.dp
        return max(1, self.world_size // (self.pp * self.tp))

    @property
    def engine(self) -> Any:
        """The :class:`~easgd_lightning.parallel.engine.OptimusPipelineEngine` (after setup)."""
        return self._engine

    @property
    def coords(self) -> dict[str, int]:
        """This rank's ``{"stage", "data", "model"}`` coordinates."""
        c = self._topology.get_coord(self.global_rank)
        return {"stage": c.pipe, "data": c.data, "model": getattr(c, "model", 0)}

    # ------------------------------------------------------------------ environment

    @override
    def setup_environment(self) -> None:
        if self.root_device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        super().setup_environment()
        ops.close_process_group_at_exit()
        dp = self._resolved_dp()
        validate_layout(
            self.pp, self.tp, dp, self.world_size,
            n_layers=self._shape["n_layer"], n_heads=self._shape["n_head"],
            d_model=self._shape["d_model"], micro_batches=self.micro_batches,
        )
        if self._topology is None:
            from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

            self._topology = PipeModelDataParallelTopology(
                num_pp=self.pp, num_mp=self.tp, num_dp=dp
            )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Replicas are data-parallel groups: stages and tensor ranks of one replica read
        the same samples."""
        return {"num_replicas": self._resolved_dp(), "rank": self.coords["data"]}

    # ------------------------------------------------------------------ setup

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if type(self.precision_plugin) is not Precision:
            raise ValueError(
                "strategy=pipeline_3d runs in fp32: set trainer.precision=32-true, got "
                f"{type(self.precision_plugin).__name__}"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                "strategy=pipeline_3d accumulates over strategy.micro_batches; set "
                f"trainer.accumulate_grad_batches=1 (got {trainer.accumulate_grad_batches})"
            )
        module = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING and not module.automatic_optimization:
            raise ValueError(
                "strategy=pipeline_3d does not support manual optimization (automatic_optimization"
                "=False): its engine runs forward, backward and the optimizer step itself; use "
                "automatic optimization with one optimizer"
            )
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self._engine is None:
            self._engine = self._build_engine(trainer, module, fitting)
        else:
            module.to(self.root_device)
            if fitting and self._engine.optimizer is None:
                raise RuntimeError(
                    "the pipeline engine was built without an optimizer (validate before fit); "
                    "call trainer.fit first"
                )
        self.setup_precision_plugin()

    def _build_engine(self, trainer: Any, module: Any, fitting: bool) -> Any:
        from easgd_lightning.parallel.engine import build_pipeline_engine, deepspeed_config

        if not hasattr(module, "configure_pipeline"):
            raise TypeError(
                "strategy=pipeline_3d needs a LightningModule with configure_pipeline(topology) "
                "returning a deepspeed.pipe.PipelineModule (see easgd_lightning.models.gpt."
                "GPTLightningModule)"
            )
        shape = dict(getattr(module, "pipeline_shape", lambda: {})() or {})
        validate_layout(
            self.pp, self.tp, self._resolved_dp(), self.world_size,
            n_layers=shape.get("n_layer"), n_heads=shape.get("n_head"),
            d_model=shape.get("d_model"), micro_batches=self.micro_batches,
        )
        pipe = module.configure_pipeline(
            self._topology, activation_checkpoint_interval=self.activation_checkpoint_interval
        )
        optimizer = None
        if fitting:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    "strategy=pipeline_3d drives one optimizer; configure_optimizers returned "
                    f"{len(self.optimizers)}"
                )
            optimizer = self.optimizers[0]
        batch_size = getattr(trainer.datamodule, "batch_size", None) if trainer.datamodule else None
        if batch_size is not None and batch_size % self.micro_batches != 0:
            raise ValueError(
                f"data.batch_size ({batch_size}) must be a multiple of strategy.micro_batches "
                f"({self.micro_batches})"
            )
        micro_batch_size = (batch_size or self.micro_batches) // self.micro_batches
        clip = self.gradient_clipping or float(trainer.gradient_clip_val or 0.0)
        config = deepspeed_config(
            micro_batch_size=micro_batch_size,
            micro_batches=self.micro_batches,
            dp=self._resolved_dp(),
            gradient_clipping=clip,
            extra=self._ds_extra,
        )
        return build_pipeline_engine(pipe, optimizer=optimizer, config=config, optimus=self._optimus)

    # ------------------------------------------------------------------ steps

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        batch = args[0] if args else kwargs["batch"]
        chunks = split_micro_batches(batch, self.micro_batches)
        loss = self._engine.train_batch(iter(chunks))
        self.local_steps += 1
        self._recent_losses = (self._recent_losses + [float(loss)])[-10:]
        # the engine's loss is already the mean over replicas, broadcast to every stage
        self.lightning_module.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss.detach()

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        return closure_loss  # the engine ran the backward passes inside train_batch

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        # The closure runs training_step, i.e. engine.train_batch, which already reduced
        # the gradients and stepped the optimizer (DeepSpeed's OptimizerStep instruction).
        return closure()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        batch = args[0] if args else kwargs["batch"]
        chunks = split_micro_batches(batch, self.micro_batches)
        loss = self._engine.eval_batch(iter(chunks), num_micro_batches=len(chunks))
        self.lightning_module.log(
            "val/loss", loss, prog_bar=True, on_step=False, on_epoch=True, sync_dist=True,
            batch_size=int(batch[0].shape[0]),
        )
        return loss

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("strategy=pipeline_3d supports fit and validate, not test")

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("strategy=pipeline_3d supports fit and validate, not predict")

    # ------------------------------------------------------------------ checkpoints

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the stage's modules exist only after configure_pipeline

    def _shard_name(self) -> str:
        c = self.coords
        return f"stage{c['stage']:02d}_tp{c['model']:02d}.pt"

    def _compressor_state_name(self) -> str:
        c = self.coords
        return f"optimus_stage{c['stage']:02d}_tp{c['model']:02d}_dp{c['data']:03d}.pt"

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PATH,
                        storage_options: Any | None = None) -> None:
        """Write this (stage, tensor rank)'s shard, then (rank 0) ``meta.pt`` last; every
        file atomically, with its checksum, tensors and plain data only (utils/checkpoint.py)."""
        path = Path(filepath)
        if self.coords["data"] == 0:
            shard = {k: checkpoint[k] for k in _SHARD_KEYS if k in checkpoint}
            shard["coords"] = dict(self.coords)
            save_checkpoint_file(shard, path / self._shard_name())
        if self._engine is not None and self._optimus is not None:
            # residuals and warm starts differ per replica: one file per rank
            state = to_plain(self._engine.optimus_state_dict(), "optimus_cc state")
            save_checkpoint_file(state, path / self._compressor_state_name())
        ops.barrier(kind="control")
        if self.is_global_zero:
            meta = {k: v for k, v in checkpoint.items() if k not in _SHARD_KEYS}
            meta["pipeline_3d"] = {**self.layout, "micro_batches": self.micro_batches}
            save_checkpoint_file(meta, path / _META)

    @override
    def load_checkpoint(self, checkpoint_path: PATH, weights_only: bool | None = None) -> dict:
        """This rank's part of the checkpoint directory (``meta.pt``, its stage shard, its
        Optimus-CC state), each file weights-only and checksum-verified. Every rank raises
        when any rank's part is unusable (one rank alone would leave the others waiting)."""
        path = Path(checkpoint_path)
        try:
            loaded, problem = self._read_checkpoint_part(path), None
        except (CheckpointError, ValueError) as err:
            loaded, problem = None, str(err)
        problems = ops.all_gather_object(problem) if self.world_size > 1 else [problem]
        if problem is not None:
            raise CheckpointError(f"pipeline_3d checkpoint refused: {problem}")
        failed = [(rank, msg) for rank, msg in enumerate(problems) if msg is not None]
        if failed:
            rank, msg = failed[0]
            raise CheckpointError(f"pipeline_3d checkpoint refused (rank {rank}'s part): {msg}")
        return loaded

    def _read_checkpoint_part(self, path: Path) -> dict:
        if not (path / _META).exists():
            raise CheckpointError(
                f"{path} is not a complete pipeline_3d checkpoint directory (no {_META})"
            )
        meta = load_checkpoint_file(path / _META)
        saved = meta.get("pipeline_3d", {})
        now = {**self.layout, "micro_batches": self.micro_batches}
        if any(saved.get(k) != now[k] for k in ("pp", "tp")):
            raise ValueError(
                f"checkpoint {path} was written with strategy.pp={saved.get('pp')} "
                f"strategy.tp={saved.get('tp')}; this run has pp={now['pp']} tp={now['tp']}"
            )
        shard = load_checkpoint_file(path / self._shard_name())
        for part in (meta, shard):
            part.pop(CHECKSUM_KEY, None)
        shard.pop("coords", None)
        state_file = path / self._compressor_state_name()
        self._pending_optimus_state = (
            load_checkpoint_file(state_file)
            if self._optimus is not None and state_file.exists()
            else None
        )
        return {**meta, **shard}

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if self._engine is not None and self._pending_optimus_state:
            self._engine.load_optimus_state_dict(self._pending_optimus_state)
        self._pending_optimus_state = None

    # ------------------------------------------------------------------ reporting

    def summary_extras(self) -> dict:
        """Layout, this rank's coordinates, the inter-stage counters and ``final_train_loss``
        (mean engine loss of the last 10 steps) for summary.json."""
        extras: dict[str, Any] = {"role": "worker", "layout": self.layout}
        if self._recent_losses:  # mean engine loss of the last (up to) 10 steps
            extras["final_train_loss"] = sum(self._recent_losses) / len(self._recent_losses)
        if self._topology is not None:
            extras["coords"] = self.coords
            # one rank per data-parallel replica counts that replica's samples
            extras["counts_samples"] = self.coords["stage"] == 0 and self.coords["model"] == 0
        if self._engine is not None:
            extras["pipeline"] = dict(self._engine.pipe_stats)
        extras["optimus_cc"] = dict(vars(self._optimus)) if self._optimus else None
        return extras
