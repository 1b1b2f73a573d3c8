"""Every private Lightning / torch.distributed name this project touches, in one place.

Each function or constant below reads, imports or replaces one private name. Outside this
module (and :mod:`easgd_lightning.parallel.deepspeed_compat`, which does the same for
DeepSpeed's pipeline engine) the package reads, imports and patches no private name of
pytorch_lightning, lightning_fabric or torch.distributed. The one exception is a method a
subclass must define under Lightning's private name to replace it; each such override is
listed in :data:`PRIVATE_OVERRIDES`. ``tests/unit/compat/test_compat_lightning.py`` asserts that
each name still exists with the signature and behaviour relied on here, and that no class
of the package overrides a private Lightning method not listed, so an upgrade that changes
one fails there, by name, instead of hanging a distributed run. (Two torch autograd /
tensor internals that PyTorch's own DDP relies on are used where they are needed:
``Variable._execution_engine.queue_callback`` in :mod:`easgd_lightning.hooks.ddp` and
``Tensor._version`` in :mod:`easgd_lightning.hooks.compressors.base`.)

Why each is needed (the asynchronous strategies' ranks run apart after set-up, so any
collective that Lightning runs on its own would re-synchronise them or hang on a dead rank):

* ``_TrainingEpochLoop._broadcast_sigterm_tensor``: Lightning broadcasts a SIGTERM flag
  from rank 0 before every training batch; replaced per trainer by a local check.
* ``_SignalConnector`` and ``Trainer._signal_connector`` (its ``_sigterm_notifier_fn``,
  ``received_sigterm``): Lightning's SIGTERM handler broadcasts inside the handler.
* ``pytorch_lightning.strategies.ddp._sync_module_states``: ``DDPStrategy.setup`` outside
  fitting broadcasts the module's state from rank 0.
* ``DDPStrategy._timeout``: the process group timeout the strategy was given.
* ``LightningModule._trainer``: the trainer, or None when not attached (the public
  ``trainer`` property raises then).
* ``torch.distributed.distributed_c10d._get_default_store``: the rendezvous store when no
  ``MASTER_ADDR``/``MASTER_PORT`` is set (heartbeats live there).
* ``Work._source_rank``: the sender of a receive from any source.

And, not about asynchrony:

* ``pytorch_lightning.core.optimizer._configure_optimizers``: how Lightning reads what
  ``configure_optimizers`` returned (the CLI counts optimizers before launch:
  :func:`configured_optimizers`).
* ``lightning_fabric.utilities.types._PATH``: the path type in the signatures of the
  checkpoint methods we override (:data:`PATH`).
* ``DDPStrategy._register_ddp_hooks`` (:data:`DDP_HOOKS_STEP`): the step of
  ``DDPStrategy.configure_ddp`` that registers DDP communication hooks, on CUDA only;
  ``ddp_compressed`` overrides it to register its hook on every device.
* ``ModelCheckpoint._save_topk_checkpoint`` and ``_save_last_checkpoint``
  (:data:`CHECKPOINT_TOPK_STEP`, :data:`CHECKPOINT_LAST_STEP`): the two writes of a
  checkpoint, epoch file first; ``LastFirstCheckpoint`` overrides both to write
  ``last.ckpt`` first.
* ``lightning_fabric``'s ``Strategy._backward_sync_control``: what
  ``fabric.no_backward_sync(model)`` uses to skip the gradient all-reduce; the Fabric
  strategies without one set it to None (:func:`drop_backward_sync_control`).
* ``WandbLogger._wandb_init`` (its ``"anonymous"`` key): Lightning always passes
  ``anonymous=None`` to ``wandb.init``, and wandb warns at every run that the setting has
  no effect (:func:`drop_wandb_anonymous`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytorch_lightning.strategies.ddp as _pl_ddp
import torch.distributed as dist
from lightning_fabric.utilities.types import _PATH as PATH
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.connectors.signal_connector import (
    _SignalConnector as SignalConnector,
)

__all__ = [
    "PATH",
    "drop_backward_sync_control",
    "drop_wandb_anonymous",
    "DDP_HOOKS_STEP",
    "CHECKPOINT_TOPK_STEP",
    "CHECKPOINT_LAST_STEP",
    "PRIVATE_OVERRIDES",
    "SignalConnector",
    "configured_optimizers",
    "replace_sigterm_broadcast",
    "sigterm_broadcast_replacement",
    "set_signal_connector",
    "set_sigterm_notifier",
    "mark_sigterm_received",
    "module_state_sync_skipped",
    "process_group_timeout",
    "attached_trainer",
    "default_store",
    "source_rank",
    "pipeline_slice_group",
]

_SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"

#: ``DDPStrategy.configure_ddp`` wraps the model, then calls this (``self``) to register
#: the DDP communication hooks (Lightning: CUDA only). ``CompressedDDPStrategy`` defines
#: it to register its compression hook on every device.
DDP_HOOKS_STEP = "_register_ddp_hooks"

#: ``ModelCheckpoint``'s writes of the top-k (epoch) file and of ``last.ckpt``
#: (``self, trainer, monitor_candidates``), called in that order wherever it saves.
#: ``LastFirstCheckpoint`` defines both to write ``last.ckpt`` first.
CHECKPOINT_TOPK_STEP = "_save_topk_checkpoint"
CHECKPOINT_LAST_STEP = "_save_last_checkpoint"

#: (Lightning class, private method name) for every private method a class of this
#: package overrides by name; the test checks each still exists with the signature relied
#: on, and that no other private Lightning method is overridden.
PRIVATE_OVERRIDES: tuple[tuple[type, str], ...] = (
    (DDPStrategy, DDP_HOOKS_STEP),
    (ModelCheckpoint, CHECKPOINT_TOPK_STEP),
    (ModelCheckpoint, CHECKPOINT_LAST_STEP),
)


def drop_backward_sync_control(strategy: Any) -> None:
    """Set a Fabric strategy's ``_backward_sync_control`` to None: it has no gradient
    all-reduce to skip. Fabric's ``DDPStrategy`` sets DDP's ``no_sync`` there, a TypeError
    on a module DDP does not wrap; with None, ``fabric.no_backward_sync(model)`` warns that
    the strategy skips nothing and runs the block as it is."""
    strategy._backward_sync_control = None


# ------------------------------------------------------------------ configure_optimizers
def drop_wandb_anonymous(logger: Any) -> Any:
    """Remove the ``anonymous`` argument Lightning's ``WandbLogger`` hands ``wandb.init``
    (always present, None unless asked for; wandb warns that it has no effect) when it was
    not asked for. Returns ``logger``."""
    init = getattr(logger, "_wandb_init", None)
    if isinstance(init, dict) and init.get("anonymous") is None:
        init.pop("anonymous", None)
    return logger


def configured_optimizers(configured: Any) -> list:
    """The optimizers in what ``LightningModule.configure_optimizers()`` returned (any of
    the forms Lightning accepts: one optimizer, a list, a dict, lists of optimizers and
    schedulers), read the way Lightning reads it.

    Raises:
        MisconfigurationException: a value Lightning would refuse (Lightning's message).
    """
    from pytorch_lightning.core.optimizer import _configure_optimizers

    optimizers, _, _ = _configure_optimizers(configured)
    return list(optimizers)


# ------------------------------------------------------------------ per-batch SIGTERM broadcast
def replace_sigterm_broadcast(trainer: Any, check: Callable[[], None]) -> bool:
    """Run ``check()`` instead of Lightning's per-batch SIGTERM broadcast on ``trainer``'s
    training epoch loop (this trainer only). False when the loop has no such step."""
    loop = trainer.fit_loop.epoch_loop
    if not hasattr(loop, _SIGTERM_BROADCAST):
        return False
    setattr(loop, _SIGTERM_BROADCAST, check)
    return True


def sigterm_broadcast_replacement(trainer: Any) -> Callable[[], None] | None:
    """The check a strategy installed with :func:`replace_sigterm_broadcast` (None: the loop
    still runs Lightning's own broadcast)."""
    return vars(trainer.fit_loop.epoch_loop).get(_SIGTERM_BROADCAST)


# ------------------------------------------------------------------ SIGTERM handler
def set_signal_connector(trainer: Any, connector: SignalConnector) -> None:
    """Make ``connector`` (a :class:`SignalConnector` subclass) the trainer's signal connector."""
    trainer._signal_connector = connector


def set_sigterm_notifier(trainer: Any, notify: Callable[[int, Any], None]) -> bool:
    """Replace what Lightning's SIGTERM handler calls (its default broadcasts the signal);
    read by ``register_signal_handlers``, so call it before that runs. False without one."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None:
        return False
    connector._sigterm_notifier_fn = notify
    return True


def mark_sigterm_received(trainer: Any) -> None:
    """What Lightning's handler records: the loops stop at their next check."""
    trainer._signal_connector.received_sigterm = True


# ------------------------------------------------------------------ DDPStrategy internals
@contextmanager
def module_state_sync_skipped() -> Iterator[None]:
    """Within this block ``DDPStrategy.setup`` outside fitting does not broadcast the
    module's state from rank 0 (ranks that run apart would never all join it)."""
    original = _pl_ddp._sync_module_states
    _pl_ddp._sync_module_states = lambda module: None
    try:
        yield
    finally:
        _pl_ddp._sync_module_states = original


def process_group_timeout(strategy: Any, default_s: float = 300.0) -> float:
    """The process-group timeout a ``DDPStrategy`` was given, in seconds."""
    timeout = getattr(strategy, "_timeout", None)
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(default_s)


def attached_trainer(module: Any) -> Any:
    """``module``'s trainer, or None when it is not attached to one."""
    return getattr(module, "_trainer", None) if module is not None else None


# ------------------------------------------------------------------ torch.distributed
def default_store() -> Any:
    """The default process group's rendezvous store."""
    return dist.distributed_c10d._get_default_store()


def source_rank(work: Any) -> int:
    """The global rank that sent what a receive from any source (``src=None``) received."""
    fn = getattr(work, "_source_rank", None) or work.source_rank
    return int(fn())


# ------------------------------------------------------------------ DeepSpeed
def pipeline_slice_group(module: Any) -> Any:
    """The slice-parallel (tensor-parallel) process group of a DeepSpeed ``PipelineModule``
    (through its public ``mpu()``, the process grid; no private DeepSpeed name is read)."""
    return module.mpu().get_slice_parallel_group()
