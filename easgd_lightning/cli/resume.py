"""``checkpoint.resume``: the checkpoint is intact, was written by this run's strategy,
world size and model, and leaves something to train (checked before launch)."""

from __future__ import annotations

import logging
import os
from typing import Any

from easgd_lightning.cli.rules import strategy_spec_of
from easgd_lightning.utils.checks import is_int
from easgd_lightning.utils.errors import ConfigError

log = logging.getLogger("easgd_lightning")

__all__ = ["check_resume", "resume_point"]


def check_resume(cfg: Any, world: int, module: Any) -> dict[str, Any] | None:
    """``checkpoint.resume``: an intact checkpoint (file present, non-empty, readable with
    ``weights_only=True``, checksum matching) written by this strategy, world size and model
    (``module``: this run's module on the meta device, or None when it cannot be built so),
    that leaves something to train (``trainer.max_epochs`` / ``trainer.max_steps`` beyond it).

    Returns:
        None without ``checkpoint.resume``; else what ``summary.json`` records as ``resume``
        (:func:`resume_point`): where the checkpoint stands and whether the resume is exact.
        A checkpoint written in the middle of an epoch (a run stopped by SIGINT / SIGTERM)
        resumes inexactly: this logs one line saying so and why.

    Raises:
        ConfigError: ``"checkpoint.resume: <path> <what is wrong>"``.
    """
    path = (cfg.get("checkpoint") or {}).get("resume")
    if path is None:
        return None
    from easgd_lightning.utils.checkpoint import CheckpointError, load_checkpoint_file

    index = strategy_spec_of(cfg).checkpoint_index
    if index is not None:  # a directory of shards (pipeline_3d: per stage, completed by meta.pt)
        return _check_shard_dir(cfg, path, index)
    try:
        ckpt = load_checkpoint_file(path)
    except CheckpointError as err:
        raise ConfigError(f"checkpoint.resume: {err}") from None
    _check_identity(cfg, path, ckpt, world)
    _check_same_model(cfg, path, ckpt, module)
    point = resume_point(ckpt)
    _check_something_to_train(cfg, path, point)
    point = {"checkpoint": str(path), **point}
    if point["inexact_because"] and os.environ.get("RANK", "0") == "0":
        log.warning("checkpoint.resume: the resume is inexact: %s", point["inexact_because"])
    return point


def _check_shard_dir(cfg: Any, path: Any, index: str) -> dict[str, Any]:
    """A checkpoint directory of shards: ``index`` present, every shard readable, checksums
    matching."""
    from pathlib import Path

    from easgd_lightning.utils.checkpoint import CheckpointError, verify_checkpoint_dir

    if not (Path(path) / index).is_file():
        raise ConfigError(
            f"checkpoint.resume: {path} is not a {cfg.strategy.get('name')} checkpoint directory (no {index})"
        )
    try:
        verify_checkpoint_dir(path, index)
    except CheckpointError as err:
        raise ConfigError(f"checkpoint.resume: {err}") from None
    return {"checkpoint": str(path), "exact": None, "inexact_because": None}


def _check_identity(cfg: Any, path: Any, ckpt: dict, world: int) -> None:
    """The checkpoint was written by this run's strategy and number of processes."""
    from easgd_lightning.utils.checkpoint import checkpoint_identity

    name = cfg.strategy.get("name")
    saved_strategy, saved_world = checkpoint_identity(ckpt)
    if saved_strategy is not None and saved_strategy != name:
        raise ConfigError(
            f"checkpoint.resume: {path} was written by strategy={saved_strategy}; this run has "
            f"strategy={name} (resume with the strategy that wrote it)"
        )
    if saved_world is not None and saved_world != world:
        raise ConfigError(
            f"checkpoint.resume: {path} was written by {saved_world} processes; this run has {world} "
            "(trainer.devices x trainer.num_nodes must match to resume)"
        )


def _check_same_model(cfg: Any, path: Any, ckpt: dict, module: Any) -> None:
    """The checkpoint's tensors have the names and shapes of ``module``'s (when known)."""
    saved = {k: tuple(v.shape) for k, v in (ckpt.get("state_dict") or {}).items()}
    if module is None or not saved:
        return
    here = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    differ = sorted(set(saved) ^ set(here)) or sorted(k for k in saved if saved[k] != here[k])
    if differ:
        k = differ[0]
        raise ConfigError(
            f"checkpoint.resume: {path} holds another model than model={cfg.model.get('name')} "
            f"({len(differ)} tensors differ, e.g. {k}: {list(saved[k]) if k in saved else 'absent'} "
            f"in the checkpoint, {list(here[k]) if k in here else 'absent'} here)"
        )


def resume_point(ckpt: dict) -> dict[str, Any]:
    """Where a Lightning checkpoint stands: ``epochs_done`` (epochs whose training finished),
    ``step`` (optimizer steps), ``mid_epoch`` (it was written inside an epoch: ``SignalStop``
    on SIGINT / SIGTERM), ``exact`` and ``inexact_because``.

    Rule: Lightning resumes a mid-epoch checkpoint by iterating the interrupted epoch's data
    loader again from its first batch (the loaders here have no resumable position:
    ``state_dict`` / ``load_state_dict``), so the batches seen, and the steps after the
    resume, differ from those of the run that was not interrupted: inexact. A checkpoint
    written at the end of an epoch resumes exactly.
    """
    loops = (ckpt.get("loops") or {}).get("fit_loop") or {}
    batches = loops.get("epoch_loop.batch_progress") or {}
    epochs = (loops.get("epoch_progress") or {}).get("current") or {}
    in_epoch = int((batches.get("current") or {}).get("completed", 0) or 0)
    mid = bool(batches) and not batches.get("is_last_batch", True) and in_epoch > 0
    done = int(epochs.get("processed", ckpt.get("epoch", 0)) or 0)
    step = int(ckpt.get("global_step", 0) or 0)
    because = None
    if mid:
        because = (
            f"it was written in the middle of epoch {done} (after {in_epoch} of its batches, step {step}: a run "
            f"stopped by a signal) and the data loader has no resumable position, so epoch {done} is iterated "
            "again from its first batch; the steps after the resume differ from those of an uninterrupted run "
            "(resume from an end-of-epoch checkpoint, checkpoints/epochNNN.ckpt, for an exact one)"
        )
    return {"epochs_done": done, "step": step, "mid_epoch": mid, "exact": not mid, "inexact_because": because}


def _check_something_to_train(cfg: Any, path: Any, point: dict) -> None:
    """A resume that would train nothing (Lightning then returns at once and the run would
    report ok) is refused, naming the keys."""
    t = cfg.trainer
    max_epochs, max_steps = t.get("max_epochs"), t.get("max_steps", -1)
    done, step = point["epochs_done"], point["step"]
    if is_int(max_steps) and max_steps != -1 and step >= max_steps:
        raise ConfigError(
            f"checkpoint.resume: {path} is at step {step} and trainer.max_steps={max_steps}: nothing would be "
            f"trained; set trainer.max_steps above {step}"
        )
    if is_int(max_epochs) and max_epochs != -1 and done >= max_epochs:
        raise ConfigError(
            f"checkpoint.resume: {path} has finished {done} epochs and trainer.max_epochs={max_epochs}: nothing "
            f"would be trained; set trainer.max_epochs above {done}"
        )
