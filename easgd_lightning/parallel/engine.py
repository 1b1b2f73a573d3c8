"""DeepSpeed's pipeline engine with metered point-to-point traffic and Optimus-CC hooks.

:class:`OptimusPipelineEngine` is DeepSpeed's :class:`~deepspeed.runtime.pipe.engine.
PipelineEngine` (its 1F1B ``TrainSchedule``, buffers, loss scaling and optimizer step)
with the instructions that communicate replaced by versions that go through
:mod:`easgd_lightning.comm.ops`, so every byte is metered by kind:

* ``SendActivation`` / ``RecvActivation`` / ``SendGrad`` / ``RecvGrad``: ``pipeline``;
  ``SendGrad`` optionally compressed (Optimus-CC CB, LEP, epilogue-only);
* ``ReduceTiedGrads``: ``embedding`` (skipped when fused, FE);
* ``ReduceGrads``: ``data_parallel`` (dense, or PowerSGD on the selected stages, SC); with
  FE the tied embedding is reduced here over first+last stages of all replicas
  (``embedding``);
* the loss aggregation: ``control``.

Activations between stages are one tensor (the GPT of :mod:`easgd_lightning.models.gpt`);
with ``tp > 1`` every tensor-parallel rank sends its (identical) copy to its peer of the
same tensor-parallel index in the next stage.

Which backward message is compressed is decided on both sides from the micro-batch index
(the ``k``-th ``SendGrad`` of a batch pairs with the receiver's ``k``-th ``RecvGrad``), so
no extra metadata travels and the receiver always knows the factor shapes.

The instructions are replaced through the public hooks of
:class:`~easgd_lightning.parallel.deepspeed_compat.PipelineEngineHooks`, which holds (and
checks against the installed DeepSpeed) every use of DeepSpeed's private engine API.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from easgd_lightning.comm import ops
from easgd_lightning.hooks.optimus_cc import (
    ActivationGradCompressor,
    DataParallelPowerSGD,
    OptimusCCConfig,
    dense_all_reduce_mean_,
    is_epilogue_send,
    resolve_selective_stages,
)
from easgd_lightning.parallel.deepspeed_compat import (
    PipelineEngineHooks,
    construct_engine,
    skip_shm_op_build,
)

__all__ = [
    "OptimusPipelineEngine",
    "build_pipeline_engine",
    "deepspeed_config",
    "init_deepspeed_comm",
]

log = logging.getLogger(__name__)

_META_LEN = 16
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]


def init_deepspeed_comm() -> None:
    """Attach DeepSpeed's communication layer to the already initialised torch process group.

    ``torch.distributed`` must be initialised (gloo on CPU, NCCL on GPU); DeepSpeed then
    wraps that default group instead of creating its own.
    """
    from deepspeed import comm as ds_dist

    if not dist.is_initialized():
        raise RuntimeError("initialise torch.distributed before building the pipeline")
    if dist.get_backend() == "gloo":
        skip_shm_op_build()  # the CPU backend's op for inference all-reduce: unused here
    ds_dist.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)


def deepspeed_config(
    *,
    micro_batch_size: int,
    micro_batches: int,
    dp: int,
    gradient_clipping: float = 0.0,
    extra: dict | None = None,
) -> dict:
    """The DeepSpeed config the pipeline engine runs with (fp32, ZeRO off).

    Args:
        micro_batch_size: Samples per micro-batch on one replica.
        micro_batches: Micro-batches per step (DeepSpeed's gradient accumulation steps).
        dp: Data-parallel degree.
        gradient_clipping: Global-norm clipping (0: off).
        extra: Keys merged on top (advanced DeepSpeed options).
    """
    cfg = {
        "train_micro_batch_size_per_gpu": int(micro_batch_size),
        "gradient_accumulation_steps": int(micro_batches),
        "train_batch_size": int(micro_batch_size * micro_batches * dp),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 0},
        "gradient_clipping": float(gradient_clipping),
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False},
        "dump_state": False,
    }
    if extra:
        cfg.update(extra)
    return cfg


class OptimusPipelineEngine(PipelineEngineHooks):
    """PipelineEngine whose communication is metered and optionally Optimus-CC compressed.

    Construct it with :func:`build_pipeline_engine`. Keyword ``optimus`` (an
    :class:`OptimusCCConfig` or ``None`` for uncompressed) is taken before the DeepSpeed
    engine arguments.
    """

    def __init__(self, *args: Any, optimus: OptimusCCConfig | None = None, **kwargs: Any) -> None:
        self.optimus = optimus
        super().__init__(*args, **kwargs)
        grid = self.grid
        self._prev_rank = grid.stage_to_global(self.stage_id - 1) if self.stage_id > 0 else None
        self._next_rank = (
            grid.stage_to_global(self.stage_id + 1) if self.stage_id < self.num_stages - 1 else None
        )
        self._grad_sends = 0
        self._grad_recvs = 0
        self._grad_recv_buf: torch.Tensor | None = None
        self.pipe_stats = {
            "activation_bytes": 0,
            "grad_bytes": 0,
            "grad_dense_bytes": 0,
            "grad_sends_compressed": 0,
            "grad_sends_dense": 0,
        }
        opt = optimus
        self._cb_on = bool(opt and opt.compressed_backprop and self.num_stages > 1)
        self._cb: ActivationGradCompressor | None = None
        if self._cb_on and self.stage_id > 0:
            self._cb = ActivationGradCompressor(
                rank=opt.rank,
                lazy_error_propagation=opt.lazy_error_propagation,
                seed=opt.seed + 7919 * self.stage_id,
            )
        # Shapes only; the receiver's factor shapes come from this helper too.
        self._shape_helper = ActivationGradCompressor(rank=opt.rank if opt else 1)
        self._tied = [w for w, _ in self.module.get_tied_weights_and_groups()]
        self._tied_ids = {id(w) for w in self._tied}
        self._fused = bool(opt and opt.fused_embedding and self.num_stages > 1)
        self._fused_group = self._build_fused_group() if self._fused else None
        self._selected_stages: list[int] = (
            resolve_selective_stages(opt.selective_stages, self.num_stages) if opt else []
        )
        self._dp_powersgd: DataParallelPowerSGD | None = None
        if opt and self.stage_id in self._selected_stages and self.dp_world_size > 1:
            self._dp_powersgd = DataParallelPowerSGD(
                rank=opt.dp_rank,
                group=grid.get_data_parallel_group(),
                world_size=self.dp_world_size,
                seed=opt.seed + 104729 * (self.stage_id + 1),
            )

    # ------------------------------------------------------------------ setup helpers

    def _build_fused_group(self) -> Any:
        """One group per tensor-parallel index: first and last stage of every replica.

        Every rank takes part in creating every group (``new_group`` is collective).
        """
        topo = self.grid.topology()
        axes = topo.get_axis_names()
        tp = topo.get_dim("model") if "model" in axes else 1
        mine = None
        for m in range(max(tp, 1)):
            ranks = []
            for stage in (0, self.num_stages - 1):
                for d in range(self.dp_world_size):
                    coords = {"pipe": stage, "data": d}
                    if "model" in axes:
                        coords["model"] = m
                    ranks.append(topo.get_rank(**coords))
            ranks = sorted(set(ranks))
            group = ops.new_group(ranks)
            if self.global_rank in ranks:
                mine = group
        return mine

    def _compress_message(self, micro_batch: int, sender_stage: int) -> bool:
        """Whether backward message ``micro_batch`` from ``sender_stage`` is compressed."""
        if not self._cb_on:
            return False
        if self.optimus.epilogue_only:
            return is_epilogue_send(micro_batch, self.micro_batches, self.num_stages, sender_stage)
        return True

    # ------------------------------------------------------------------ schedule

    def start_schedule(self) -> None:
        self._grad_sends = 0
        self._grad_recvs = 0

    # ------------------------------------------------------------------ p2p

    def _send_meta(self, tensor: torch.Tensor, dst: int) -> None:
        meta = torch.zeros(_META_LEN, dtype=torch.int64)
        meta[0] = _DTYPES.index(tensor.dtype)
        meta[1] = tensor.dim()
        meta[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        ops.send(meta.to(self.device), dst, kind="pipeline")

    def _recv_meta(self, src: int) -> tuple[torch.dtype, list[int]]:
        meta = torch.zeros(_META_LEN, dtype=torch.int64, device=self.device)
        ops.recv(meta, src, kind="pipeline")
        meta = meta.cpu()
        ndim = int(meta[1])
        return _DTYPES[int(meta[0])], [int(v) for v in meta[2 : 2 + ndim]]

    def send_activations(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if not torch.is_tensor(outputs):
            raise TypeError(
                "OptimusPipelineEngine sends one activation tensor between stages; got "
                f"{type(outputs).__name__}"
            )
        if self.first_output_send:
            self.first_output_send = False
            self._send_meta(outputs, self._next_rank)
        ops.send(outputs.contiguous(), self._next_rank, kind="pipeline")
        self.pipe_stats["activation_bytes"] += ops.nbytes(outputs)

    def recv_activations(self, buffer_id: int) -> None:
        if self.pipe_recv_buf is None:
            dtype, shape = self._recv_meta(self._prev_rank)
            self.pipe_recv_buf = torch.zeros(shape, dtype=dtype, device=self.device)
        ops.recv(self.pipe_recv_buf, self._prev_rank, kind="pipeline")
        received = self.pipe_recv_buf.clone().detach()
        received.requires_grad = received.is_floating_point()
        self.pipe_buffers["inputs"][buffer_id] = received

    def send_grads(self, buffer_id: int) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        grad = inputs.grad
        if grad is None:
            raise RuntimeError("stage input has no gradient to send back")
        micro_batch = self._grad_sends
        self._grad_sends += 1
        dense_bytes = ops.nbytes(grad)
        self.pipe_stats["grad_dense_bytes"] += dense_bytes
        if self._compress_message(micro_batch, self.stage_id) and self._shape_helper.factor_shapes(
            grad.shape
        ):
            p, q = self._cb.compress(grad)
            ops.send(p, self._prev_rank, kind="pipeline", dense_bytes=dense_bytes)
            ops.send(q, self._prev_rank, kind="pipeline", dense_bytes=0)
            self.pipe_stats["grad_bytes"] += ops.nbytes(p, q)
            self.pipe_stats["grad_sends_compressed"] += 1
        else:
            message = self._cb.dense(grad) if self._cb is not None else grad
            ops.send(message.contiguous(), self._prev_rank, kind="pipeline")
            self.pipe_stats["grad_bytes"] += dense_bytes
            self.pipe_stats["grad_sends_dense"] += 1
        self.pipe_buffers["inputs"][buffer_id] = None

    def recv_grads(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        micro_batch = self._grad_recvs
        self._grad_recvs += 1
        shapes = None
        if self._compress_message(micro_batch, self.stage_id + 1):
            shapes = self._shape_helper.factor_shapes(outputs.shape)
        if shapes is not None:
            p = torch.empty(shapes[0], dtype=outputs.dtype, device=self.device)
            q = torch.empty(shapes[1], dtype=outputs.dtype, device=self.device)
            ops.recv(p, self._next_rank, kind="pipeline")
            ops.recv(q, self._next_rank, kind="pipeline")
            self.grad_layer = ActivationGradCompressor.decompress(p, q, outputs.shape)
        else:
            buf = self._grad_recv_buf
            if buf is None or buf.shape != outputs.shape or buf.dtype != outputs.dtype:
                buf = self._grad_recv_buf = torch.empty_like(outputs)
            ops.recv(buf, self._next_rank, kind="pipeline")
            self.grad_layer = buf

    # ------------------------------------------------------------------ reductions

    def reduce_tied_grads(self) -> None:
        if self._fused:
            return  # FE: reduced together with the data-parallel gradients
        for weight, group in self.module.get_tied_weights_and_groups():
            if weight.grad is not None:
                ops.all_reduce(weight.grad, kind="embedding", group=group)

    def reduce_grads(self) -> None:
        """Data-parallel reduction (runs inside the engine's gradient boundary)."""
        params = [p for p in self.module.parameters() if p.requires_grad and p.grad is not None]
        if self.dp_world_size > 1:
            group = self.grid.get_data_parallel_group()
            untied = [p for p in params if id(p) not in self._tied_ids]
            tied = [p for p in params if id(p) in self._tied_ids]
            if self._dp_powersgd is not None:
                self._dp_powersgd.reduce_(untied)
            else:
                dense_all_reduce_mean_(
                    [p.grad for p in untied], group=group, world_size=self.dp_world_size,
                    kind="data_parallel",
                )
            if not self._fused:
                # tied weights stay exact so both copies remain equal
                dense_all_reduce_mean_(
                    [p.grad for p in tied], group=group, world_size=self.dp_world_size,
                    kind="data_parallel",
                )
        if self._fused:
            for weight in self._tied:
                if weight.grad is None:
                    continue
                ops.all_reduce(weight.grad, kind="embedding", group=self._fused_group)
                weight.grad.div_(self.dp_world_size)

    def aggregate_total_loss(self) -> torch.Tensor:
        """Mean loss over micro-batches and replicas, broadcast from the last stage."""
        last = self.grid.stage_to_global(self.num_stages - 1)
        self.agg_additional_losses = None
        if self.is_last_stage():
            loss = self.scale_loss_by_micro_batches(self.total_loss).detach().float()
            self.dp_group_loss = loss.clone()
            agg = loss.clone().reshape(1)
            if self.is_data_parallel:
                ops.all_reduce(agg, kind="control", group=self.grid.get_data_parallel_group())
                agg /= self.dp_world_size
            losses = torch.cat([self.dp_group_loss.reshape(1), agg])
            if self.is_pipe_parallel:
                ops.broadcast(losses, last, kind="control", group=self.grid.get_pipe_parallel_group())
        else:
            losses = torch.zeros(2, device=self.device)
            ops.broadcast(losses, last, kind="control", group=self.grid.get_pipe_parallel_group())
            self.dp_group_loss = losses[0].clone()
        return losses[1].clone()

    # ------------------------------------------------------------------ state

    def optimus_state_dict(self) -> dict:
        """Compressor state (warm starts, residuals) and counters, for checkpoints."""
        return {
            "cb": self._cb.state_dict() if self._cb is not None else None,
            "dp_powersgd": self._dp_powersgd.state_dict() if self._dp_powersgd else None,
            "pipe_stats": dict(self.pipe_stats),
        }

    def load_optimus_state_dict(self, state: dict | None) -> None:
        """Restore what :meth:`optimus_state_dict` saved."""
        if not state:
            return
        if self._cb is not None and state.get("cb"):
            self._cb.load_state_dict(state["cb"])
        if self._dp_powersgd is not None and state.get("dp_powersgd"):
            self._dp_powersgd.load_state_dict(state["dp_powersgd"])
        self.pipe_stats.update(state.get("pipe_stats", {}))


def build_pipeline_engine(
    module: Any,
    *,
    optimizer: torch.optim.Optimizer,
    config: dict,
    optimus: OptimusCCConfig | None = None,
    lr_scheduler: Any = None,
) -> OptimusPipelineEngine:
    """Build an :class:`OptimusPipelineEngine` the way ``deepspeed.initialize`` builds a
    ``PipelineEngine`` for a ``PipelineModule`` (``deepspeed.initialize`` hard-codes the
    engine class; the steps are :func:`~easgd_lightning.parallel.deepspeed_compat.construct_engine`).

    Args:
        module: A ``deepspeed.pipe.PipelineModule``.
        optimizer: A torch optimizer over ``module``'s parameters (stepped by the engine).
        config: DeepSpeed config dict (see :func:`deepspeed_config`).
        optimus: Optimus-CC settings, or ``None`` for the uncompressed engine.
        lr_scheduler: Optional scheduler DeepSpeed steps with the optimizer.
    """
    init_deepspeed_comm()
    return construct_engine(
        OptimusPipelineEngine, module, config=config, optimus=optimus, optimizer=optimizer,
        lr_scheduler=lr_scheduler,
    )
