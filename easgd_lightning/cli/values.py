"""Type and range of every config value the workers read, checked before launch.

Each check reads a key of the composed config and raises a ConfigError of one line in the
words of :mod:`easgd_lightning.utils.checks` (``<key> must be <what is allowed>, got
<value>``), so no worker ever starts on a value it would refuse later.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from easgd_lightning import ft
from easgd_lightning.cli.rules import shipped_model_targets, strategy_spec_of
from easgd_lightning.utils.checks import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_int_list,
    check_int_or_fraction,
    check_momentum,
    check_number_list,
    check_positive,
    is_int,
)
from easgd_lightning.utils.errors import ConfigError, config_errors

__all__ = [
    "LOGGERS",
    "START_METHODS",
    "validate_values",
    "check_fault_values",
    "check_strategy_precision",
    "check_hardware",
    "resolve_start_method",
    "threads_warning",
]

_PRECISIONS = ("32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")

#: Lightning's older spellings, still accepted by it
_PRECISION_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}

_ACCELERATORS = ("cpu", "gpu", "cuda", "auto")
#: ``logger.name`` values (the worker builds them; ``none``: no experiment logger)
LOGGERS = ("wandb", "tensorboard", "csv", "none")


def _check_seed(cfg: Any) -> None:
    check_int("seed", cfg.get("seed", 0), 0, 2**32 - 1)


def _check_optim(cfg: Any) -> None:
    from easgd_lightning.models.classifier import OPTIMIZERS, SCHEDULES

    optim = cfg.optim
    check_choice("optim.optimizer", optim.get("optimizer", "sgd"), OPTIMIZERS)
    check_positive("optim.lr", optim.get("lr"))
    check_momentum("optim.momentum", optim.get("momentum", 0.0))
    check_positive("optim.weight_decay", optim.get("weight_decay", 0.0), allow_zero=True)
    check_bool("optim.nesterov", optim.get("nesterov", False))
    check_choice("optim.schedule", optim.get("schedule", "constant"), SCHEDULES)
    check_int("optim.warmup_steps", optim.get("warmup_steps", 0), 0)
    check_int("optim.total_steps", optim.get("total_steps"), 1, nullable=True)
    check_int("optim.step_size", optim.get("step_size", 1000), 1)
    check_positive("optim.gamma", optim.get("gamma", 0.1))
    check_positive("optim.min_lr", optim.get("min_lr", 0.0), allow_zero=True)
    for key in ("warmup_epochs", "step_size_epochs"):
        check_positive(f"optim.{key}", optim.get(key), allow_zero=True, nullable=True)
    for key in ("milestones", "milestone_epochs"):
        check_number_list(f"optim.{key}", optim.get(key), 0, nullable=True, allow_empty=True)


def _check_trainer(cfg: Any) -> None:
    t = cfg.trainer
    on_gpu = check_choice("trainer.accelerator", t.get("accelerator", "cpu"), _ACCELERATORS) in ("gpu", "cuda")
    precision = t.get("precision", "32-true")
    precision = check_choice("trainer.precision", _PRECISION_ALIASES.get(str(precision), str(precision)), _PRECISIONS)
    if precision.startswith("16-") and not on_gpu:
        raise ConfigError(
            f"trainer.precision: {precision} needs a GPU (Lightning would run bf16-mixed instead); "
            "on CPU choose one of 32-true, 64-true, bf16-mixed, bf16-true"
        )
    max_steps = t.get("max_steps", -1)
    check_int("trainer.max_steps", max_steps, 1, also=(-1,))
    max_epochs = t.get("max_epochs")
    if max_epochs == -1 and is_int(max_epochs) and max_steps == -1:
        raise ConfigError("trainer.max_epochs: -1 (no limit) needs trainer.max_steps >= 1")
    check_int("trainer.max_epochs", max_epochs, 1, also=(-1,))
    check_int("trainer.accumulate_grad_batches", t.get("accumulate_grad_batches", 1), 1)
    check_int("trainer.log_every_n_steps", t.get("log_every_n_steps", 10), 1)
    check_int("trainer.check_val_every_n_epoch", t.get("check_val_every_n_epoch", 1), 1, nullable=True)
    check_int("trainer.num_sanity_val_steps", t.get("num_sanity_val_steps", 0), -1)
    check_positive("trainer.gradient_clip_val", t.get("gradient_clip_val"), allow_zero=True, nullable=True)
    check_choice("trainer.gradient_clip_algorithm", t.get("gradient_clip_algorithm"), ("norm", "value"), nullable=True)
    for key, low in (("limit_train_batches", 1), ("limit_val_batches", 0)):
        check_int_or_fraction(f"trainer.{key}", t.get(key), low, nullable=True)
    for key in ("deterministic", "enable_progress_bar"):
        check_bool(f"trainer.{key}", t.get(key, False))
    check_bool("allow_nonfinite_loss", cfg.get("allow_nonfinite_loss", False))
    check_float("loss_explosion_factor", cfg.get("loss_explosion_factor"), 1.0, lo_open=True, nullable=True)


def check_hardware(cfg: Any) -> None:
    """The accelerator asked for exists here: ``trainer.devices`` GPUs per node for
    ``trainer.accelerator=gpu`` (checked where the job runs, i.e. on the node).

    Raises:
        ConfigError: naming trainer.accelerator or trainer.devices.
    """
    accelerator = cfg.trainer.get("accelerator", "cpu")
    if accelerator not in ("gpu", "cuda"):
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found == 0:
        raise ConfigError(
            f"trainer.accelerator: {accelerator} asked for, but this machine has no CUDA GPU; "
            "use trainer=cpu (trainer.accelerator=cpu)"
        )
    devices = cfg.trainer.devices
    if is_int(devices) and devices > found:
        raise ConfigError(f"trainer.devices: {devices} GPUs per node asked for, this machine has {found}")


def _check_checkpoint(cfg: Any) -> None:
    ckpt = cfg.get("checkpoint") or {}
    check_bool("checkpoint.enabled", ckpt.get("enabled", True))
    check_int("checkpoint.every_n_epochs", ckpt.get("every_n_epochs", 1), 1)


def _check_data(cfg: Any) -> None:
    data = cfg.data
    check_int("data.batch_size", data.get("batch_size", 1), 1)
    check_int("data.num_workers", data.get("num_workers", 0), 0)
    if "val_batch_size" in data:
        check_int("data.val_batch_size", data.get("val_batch_size"), 1, nullable=True)

#: model options that are layer sizes or counts (positive integers) where present
_MODEL_SIZES = ("hidden", "n_layer", "n_head", "d_model", "d_ff", "seq_len", "vocab_size")


def _check_model(cfg: Any) -> None:
    model = cfg.model
    for key in _MODEL_SIZES:
        if key not in model or (model.get(key) is None and key != "hidden"):
            continue
        value = model.get(key)
        if key == "hidden" and not is_int(value):  # one hidden layer's width, or a list of them
            check_int_list("model.hidden", value, 1)
        else:
            check_int(f"model.{key}", value, 1)
    _check_model_method(cfg)


def _check_model_method(cfg: Any) -> None:
    """A strategy that needs a LightningModule method (registry: ``module_method``) refuses
    a shipped network: a plain ``nn.Module`` factory has no such method."""
    need = strategy_spec_of(cfg).module_method
    model = cfg.model
    net = model.get("_target_") or shipped_model_targets().get(model.get("name"))
    if need and not model.get("builder") and net in shipped_model_targets().values():
        method, form, fix = need
        raise ConfigError(
            f"model.name: {model.get('name')!r} has no {form} ({method}), which "
            f"strategy={cfg.strategy.get('name')} needs; {fix}"
        )


@config_errors()
def check_fault_values(cfg: Any) -> None:
    """``faults.*``: numbers of the right kind, and no key that does nothing alone (a step
    without its rank: nothing would be injected, and the run would look like it survived).
    ``faults.nan_rank`` null means every rank, so ``nan_at_step`` alone is valid."""
    faults = cfg.get("faults", {}) or {}
    check_positive("faults.slow_ms", faults.get("slow_ms"), allow_zero=True, nullable=True)
    for key in ("crash_at_step", "nan_at_step", "kill_at_step"):
        check_int(f"faults.{key}", faults.get(key), 1, nullable=True)
    for key in ("slow_rank", "crash_rank", "nan_rank", "kill_rank"):
        check_int(f"faults.{key}", faults.get(key), 0, nullable=True)
    check_bool("faults.kill_at_end", faults.get("kill_at_end", False))
    if faults.get("kill_at_end") and faults.get("kill_at_step") is not None:
        raise ConfigError("faults.kill_at_end: set it or faults.kill_at_step, not both (when faults.kill_rank "
                          "SIGKILLs itself: at that step, or after its last one)")
    if faults.get("crash_at_step") is not None and faults.get("crash_rank") is None:
        raise ConfigError(
            f"faults.crash_at_step: set faults.crash_rank too (the rank that crashes at step "
            f"{faults.get('crash_at_step')}); without it nothing crashes"
        )
    every = faults.get("kill_every_s")
    if every is not None:
        check_positive("faults.kill_every_s", every, unit="seconds")
        if not ft.enabled(cfg):
            raise ConfigError("faults.kill_every_s: needs ft=torchft (the launcher restarts the killed workers); "
                              "without it the first kill ends the run")
    check_int("faults.kill_seed", faults.get("kill_seed"), 0, nullable=True)
    if faults.get("nan_rank") is not None and faults.get("nan_at_step") is None:
        raise ConfigError("faults.nan_rank: set faults.nan_at_step too (the step before which its parameter "
                          "becomes NaN); without it nothing is injected")


def check_strategy_precision(cfg: Any) -> None:
    """A strategy that runs in one precision only (registry: ``required_precision``;
    pipeline_3d: fp32, its setup refuses any other precision plugin, after the workers
    started)."""
    need = strategy_spec_of(cfg).required_precision
    if need is None:
        return
    value, short = need
    precision = str(cfg.trainer.get("precision", "32-true"))
    if _PRECISION_ALIASES.get(precision, precision) != value:
        raise ConfigError(
            f"trainer.precision: strategy={cfg.strategy.get('name')} runs in {short}: set trainer.precision={value}, "
            f"got {precision}"
        )


def threads_warning(cfg: Any, cores: int | None = None) -> str | None:
    """The warning for more torch threads on this machine than it has cores, else None.

    Rule: with more than one thread per rank, ``threads_per_process`` (null:
    ``$OMP_NUM_THREADS``, else 1) x ``trainer.devices`` (the processes this node runs) must
    not exceed the cores this process may use (``os.sched_getaffinity``); above that the ranks' threads (and their
    ``data.num_workers`` loader processes) time-share the cores and every step slows down
    many times over. A recipe written for a bigger node (recipe=imagenet/alexnet_knl: 4 x 16
    threads) warns on a small machine, naming the override that fits it.
    """
    threads = cfg.get("threads_per_process") or int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    devices = cfg.trainer.get("devices")
    if not is_int(devices) or not is_int(threads):
        return None
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
    if threads <= 1 or threads * devices <= cores:  # one thread per rank: nothing to lower here
        return None
    loaders = int(cfg.data.get("num_workers", 0) or 0)
    extra = f" (plus data.num_workers={loaders} loader processes per rank)" if loaders else ""
    fit = max(1, cores // devices)
    return (
        f"threads_per_process={threads} x trainer.devices={devices} = {threads * devices} threads{extra} on a "
        f"machine with {cores} cores: the ranks will time-share the cores and run many times slower; on this "
        f"machine use threads_per_process={fit}" + (f" trainer.devices={cores}" if devices > cores else "")
        + (" data.num_workers=0" if loaders else "")
    )


@config_errors()
def validate_values(cfg: Any) -> None:
    """Type and range of every option the workers read (seed, optim, trainer, checkpoint,
    data, model): a bad one fails here instead of in every worker.

    Raises:
        ConfigError: ``"<key> must be <what is allowed>, got <value>"`` (the words of
            :mod:`easgd_lightning.utils.checks`).
    """
    _check_seed(cfg)
    _check_optim(cfg)
    _check_trainer(cfg)
    _check_checkpoint(cfg)
    _check_data(cfg)
    _check_model(cfg)


# ---------------------------------------------------------------------------- start method
START_METHODS = ("auto", "fork", "spawn")


def _uses_gpu(cfg: Any) -> bool:
    accelerator = str(cfg.trainer.get("accelerator", "cpu")).lower()
    if accelerator in ("gpu", "cuda"):
        return True
    if accelerator == "auto":
        import torch

        return torch.cuda.is_available()
    return False


def resolve_start_method(cfg: Any) -> str:
    """``launcher.start_method`` of ``cfg`` as ``fork`` or ``spawn`` (``auto``: fork on Linux
    for a CPU run, spawn for a GPU one).

    Raises:
        ValueError: an unknown method, or ``fork`` where it cannot work (one line, naming
            the key).
    """
    launcher = cfg.get("launcher") or {}
    method = check_choice("launcher.start_method", launcher.get("start_method", "auto"), START_METHODS)
    linux = sys.platform.startswith("linux")
    gpu = _uses_gpu(cfg)
    if method == "fork" and gpu:
        raise ValueError(
            "launcher.start_method=fork cannot start GPU ranks (a process forked after CUDA is "
            "initialised is broken); use spawn or auto"
        )
    if method == "fork" and not linux:
        raise ValueError("launcher.start_method=fork needs Linux; use spawn or auto")
    if method == "auto":
        return "fork" if linux and not gpu else "spawn"
    return method
