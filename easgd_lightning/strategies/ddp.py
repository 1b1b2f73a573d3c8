"""Metered, compression-capable DDP (``ddp_compressed``; ``strategy=ddp`` in our Hydra tree).

Gradient all-reduce through torch ``DistributedDataParallel`` with a communication hook
registered on every backend. Lightning's own ``DDPStrategy`` registers hooks only on CUDA;
this subclass registers :func:`easgd_lightning.hooks.ddp.register_compression_hook` on
CPU/gloo too, so every byte is metered and compressors work everywhere. With
``compression=None`` it is plain DDP (averaged gradients) plus metering.

Communication layout (``comm`` group): GradientFlow's lazy all-reduce is DDP's own
bucketing, so ``comm.fusion_mb`` becomes DDP's ``bucket_cap_mb`` (unless given) and every
bucket is one message (DDP's first bucket is smaller, its own rule); the compressed hook
fuses the payloads inside a bucket the same way. ``comm.hierarchy=node`` reduces each
bucket inside the node first (dense hook; not with a compressor).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from easgd_lightning.comm import ops
from easgd_lightning.compat.lightning import PATH, process_group_timeout
from easgd_lightning.hooks.ddp import check_allreduce, register_compression_hook
from easgd_lightning.strategies.base import comm_layout_for, open_comm, optimizer_steps_per_epoch
from easgd_lightning.strategies.registry import register_strategy, reject_unknown_kwargs
from easgd_lightning.utils.checkpoint import check_saved_world_size

log = logging.getLogger(__name__)

__all__ = ["CompressedDDPStrategy", "CompressedDDPMixin", "optimizer_steps_per_epoch"]


class CompressedDDPMixin:
    """What ``ddp_compressed`` adds to a DDP strategy, the Trainer's
    (:class:`CompressedDDPStrategy`) and Lightning Fabric's
    (:class:`easgd_lightning.fabric.CompressedDDPFabricStrategy`) alike: the options, the
    compression hook on the ``DistributedDataParallel`` module, the compressor bound to the
    training run, the step count and the summary."""

    hierarchical = True
    switch_allreduce = True  # comm.allreduce=switch: the dense hook sums through comm.switch

    def _take_options(
        self, compression: Any, hook_options: dict | None, comm: Any, kwargs: dict, ddp_base: type
    ) -> None:
        """Check and store the options (before ``ddp_base.__init__(**kwargs)``): refuse keys
        neither ``ddp_base`` nor ``DistributedDataParallel`` reads; ``comm.fusion_mb``
        becomes DDP's ``bucket_cap_mb`` unless given."""
        reject_unknown_kwargs(self, kwargs, ddp_base, DistributedDataParallel)
        self._comm = comm_layout_for(self, comm, compression)
        check_allreduce(self._comm.allreduce, self._comm.aggregator, compression)
        kwargs.setdefault("bucket_cap_mb", self._comm.fusion_mb)
        self._compression = compression
        self._hook_options = dict(hook_options or {})
        self.hook_state: Any = None
        self._local_steps = 0

    def _register_hook(self, ddp_model: DistributedDataParallel, plan_dir: str | None) -> None:
        """Register the compression hook on ``ddp_model`` (:attr:`hook_state` its state);
        the SeCoPa planner writes its plan under ``plan_dir``."""
        self.hook_state = register_compression_hook(
            ddp_model,
            self._compression,
            group=self._hook_group(),
            layout=self._comm,
            allreduce=self._comm.allreduce,
            aggregator=self._comm.aggregator,
            plan_dir=plan_dir,
            timeout_s=process_group_timeout(self),
            **self._hook_options,
        )

    def _hook_group(self):
        """The group the hook exchanges over (None: the default process group; under
        ``ft=torchft`` the Manager's quorum, ft/strategies.py)."""
        return None

    def _bind_compressor(self, optimizers: list, steps_per_epoch: int | None) -> None:
        """DGC, sparse_gc: warm-up epochs become steps, and the compressor owns the momentum."""
        bind = getattr(self._compression, "bind_training", None)
        if callable(bind):
            for note in bind(optimizers, steps_per_epoch):
                rank_zero_warn(note)

    @property
    def local_steps(self) -> int:
        """Optimizer steps this rank has taken."""
        return self._local_steps

    def summary_extras(self) -> dict:
        stats = getattr(self.hook_state, "compression_stats", None)
        return {
            "hook": type(self.hook_state).__name__,
            "comm": self._comm.as_dict(),
            **({"compression_stats": stats()} if callable(stats) else {}),
        }


@register_strategy("ddp_compressed", options=())
class CompressedDDPStrategy(CompressedDDPMixin, DDPStrategy):
    """DDP whose gradient buckets go through our (optionally compressing) comm hook.

    Args:
        compression: a compressor from ``easgd_lightning.hooks.build_compressor`` or None.
        hook_options: extra keyword options for the hook (e.g. ``min_numel``, ``memory``).
        comm: the ``comm`` layout (``CommLayout`` or its options: ``fusion_mb``,
            ``hierarchy``, ``procs_per_node``, ``allreduce``, ``aggregator``); None: the
            defaults. ``comm.allreduce=switch`` sums the dense buckets through the emulated
            in-network aggregator of :mod:`easgd_lightning.comm.switch` (NetReduce; needs
            compression=none); ``comm.aggregator`` says who starts its process (``rank0``
            or ``external``: bench/cluster.py --aggregator switch).
        **kwargs: passed to Lightning's ``DDPStrategy``.
    """

    strategy_name = "ddp_compressed"
    #: the Hydra option (conf/strategy/ddp.yaml, strategy.name=ddp): Lightning's "ddp" stays its own
    config_name = "ddp"
    min_world_size = 1
    #: the compressor runs in the DDP gradient hook: on the gradients of trainable
    #: parameters, with the SeCoPa planner (compression.plan) there
    gradient_hook = True

    def __init__(
        self, compression: Any = None, hook_options: dict | None = None, comm: Any = None, **kwargs: Any
    ):
        self._take_options(compression, hook_options, comm, kwargs, DDPStrategy)
        super().__init__(**kwargs)
        self._resume_rank_state: dict | None = None

    def validate_world_size(self, world_size: int) -> None:
        """Any number of processes runs DDP (one averages nothing, but is valid)."""
        if world_size < self.min_world_size:
            raise ValueError(f"trainer.devices: ddp_compressed needs at least 1 process, got {world_size}")

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        open_comm(self._comm)

    @override
    def _register_ddp_hooks(self) -> None:
        """Register our compression hook on the DDP model, on every device (Lightning's own
        step registers hooks on CUDA only). Overrides a private Lightning step by name:
        :data:`~easgd_lightning.compat.lightning.DDP_HOOKS_STEP`, checked by
        ``tests/unit/compat/test_compat_lightning.py``."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._register_hook(self.model, getattr(trainer, "default_root_dir", None))
        if self._resume_rank_state is not None:
            self._restore_rank_state(self._resume_rank_state)
            self._resume_rank_state = None

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._bind_compressor(self.optimizers, optimizer_steps_per_epoch(self.lightning_module.trainer))

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Restore once the module has its training precision: Lightning's default restores
        into the module before ``64-true`` converts it, rounding the weights to float32."""
        return True

    def _rank_state(self) -> dict:
        """This rank's step count and hook state (residuals and compressor state differ
        per rank), as tensors and plain data."""
        hook = getattr(self.hook_state, "state_dict", None)
        return {"steps": self._local_steps, "hook": hook() if callable(hook) else None}

    def _restore_rank_state(self, state: dict) -> None:
        self._local_steps = int(state.get("steps", 0))
        hook = state.get("hook")
        load = getattr(self.hook_state, "load_state_dict", None)
        if hook is None or not callable(load):
            return
        if hook.get("compressor") != getattr(self._compression, "name", None):
            log.warning(
                "checkpoint compression state is for %r, this run uses %r: not restored",
                hook.get("compressor"), getattr(self._compression, "name", None),
            )
            return
        load(hook, device=self.root_device)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PATH, storage_options: Any | None = None) -> None:
        """Add ``checkpoint["ddp"]``: every rank's step count and hook state (a collective:
        Lightning calls this on every rank), then rank 0 writes."""
        mine = self._rank_state()
        ranks = ops.all_gather_object(mine) if dist.is_available() and dist.is_initialized() else [mine]
        checkpoint["ddp"] = {"strategy": "ddp", "world_size": self.world_size, "ranks": ranks}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        saved = checkpoint.get("ddp")
        if saved is None:
            return
        check_saved_world_size(saved, self.world_size)
        state = saved["ranks"][self.global_rank]
        if self.hook_state is None:  # restored before DDP is configured: apply at registration
            self._resume_rank_state = state
        else:
            self._restore_rank_state(state)

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        self._local_steps += 1
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def teardown(self) -> None:
        self._comm.close()
        super().teardown()
