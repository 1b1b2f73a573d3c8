"""Type and range of every config value the workers read, checked before launch.

Each check reads a key of the composed config and raises ConfigError "<key>: <what is
wrong>; <what is allowed>" so no worker ever starts on a value it would refuse later.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from easgd_lightning import ft
from easgd_lightning.cli.rules import shipped_model_targets, strategy_spec_of
from easgd_lightning.utils.errors import ConfigError

__all__ = [
    "LOGGERS",
    "START_METHODS",
    "is_int",
    "is_number",
    "need_int",
    "need_number",
    "need_bool",
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


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def need_int(key: str, value: Any, low: int, *, allowed: tuple = ()) -> None:
    """``value`` is an integer >= ``low`` (or one of ``allowed``)."""
    if value in allowed and (value is None or is_int(value)):
        return
    if not is_int(value) or value < low:
        extra = "".join(f" or {a if a is not None else 'null'}" for a in allowed)
        raise ConfigError(f"{key}: must be an integer >= {low}{extra}, got {value!r}")


def need_number(key: str, value: Any, *, low: float, low_open: bool = False,
                 high: float | None = None, nullable: bool = False) -> None:
    """``value`` is a number in [low, high) (or (low, high) with ``low_open``)."""
    if value is None and nullable:
        return
    ok = is_number(value) and (value > low if low_open else value >= low)
    ok = ok and (high is None or value < high)
    if not ok:
        if high is not None:
            allowed = f"in {'(' if low_open else '['}{low:g}, {high:g})"
        else:
            allowed = f"{'>' if low_open else '>='} {low:g}"
        raise ConfigError(f"{key}: must be a number {allowed}, got {value!r}")


def need_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: must be true or false, got {value!r}")


def _check_seed(cfg: Any) -> None:
    seed = cfg.get("seed", 0)
    if not is_int(seed) or not 0 <= seed < 2**32:
        raise ConfigError(f"seed: must be an integer in [0, 2**32 - 1], got {seed!r}")


def _check_optim(cfg: Any) -> None:
    from easgd_lightning.models.classifier import OPTIMIZERS, SCHEDULES

    optim = cfg.optim
    name = optim.get("optimizer", "sgd")
    if name not in OPTIMIZERS:
        raise ConfigError(f"optim.optimizer: {name!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")
    need_number("optim.lr", optim.get("lr"), low=0.0, low_open=True)
    need_number("optim.momentum", optim.get("momentum", 0.0), low=0.0, high=1.0)
    need_number("optim.weight_decay", optim.get("weight_decay", 0.0), low=0.0)
    need_bool("optim.nesterov", optim.get("nesterov", False))
    schedule = optim.get("schedule", "constant")
    if schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule: {schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    need_int("optim.warmup_steps", optim.get("warmup_steps", 0), 0)
    need_int("optim.total_steps", optim.get("total_steps"), 1, allowed=(None,))
    need_int("optim.step_size", optim.get("step_size", 1000), 1)
    need_number("optim.gamma", optim.get("gamma", 0.1), low=0.0, low_open=True)
    need_number("optim.min_lr", optim.get("min_lr", 0.0), low=0.0)
    for key in ("warmup_epochs", "step_size_epochs"):
        need_number(f"optim.{key}", optim.get(key), low=0.0, nullable=True)
    for key in ("milestones", "milestone_epochs"):
        values = optim.get(key)
        if values is not None and (
            isinstance(values, (str, bytes)) or not hasattr(values, "__iter__")
            or not all(is_number(v) and v >= 0 for v in values)
        ):
            raise ConfigError(f"optim.{key}: must be a list of numbers >= 0 or null, got {values!r}")


def _check_trainer(cfg: Any) -> None:
    t = cfg.trainer
    accelerator = t.get("accelerator", "cpu")
    if accelerator not in _ACCELERATORS:
        raise ConfigError(
            f"trainer.accelerator: {accelerator!r} is unknown; choose one of {', '.join(_ACCELERATORS)}"
        )
    on_gpu = accelerator in ("gpu", "cuda")
    precision = t.get("precision", "32-true")
    precision = _PRECISION_ALIASES.get(str(precision), precision)
    if str(precision) not in _PRECISIONS:
        raise ConfigError(f"trainer.precision: {precision!r} is unknown; choose one of {', '.join(_PRECISIONS)}")
    if str(precision).startswith("16-") and not on_gpu:
        raise ConfigError(
            f"trainer.precision: {precision} needs a GPU (Lightning would run bf16-mixed instead); "
            "on CPU choose one of 32-true, 64-true, bf16-mixed, bf16-true"
        )
    max_steps = t.get("max_steps", -1)
    need_int("trainer.max_steps", max_steps, 1, allowed=(-1,))
    max_epochs = t.get("max_epochs")
    if max_epochs == -1 and is_int(max_epochs) and max_steps == -1:
        raise ConfigError("trainer.max_epochs: -1 (no limit) needs trainer.max_steps >= 1")
    need_int("trainer.max_epochs", max_epochs, 1, allowed=(-1,))
    need_int("trainer.accumulate_grad_batches", t.get("accumulate_grad_batches", 1), 1)
    need_int("trainer.log_every_n_steps", t.get("log_every_n_steps", 10), 1)
    need_int("trainer.check_val_every_n_epoch", t.get("check_val_every_n_epoch", 1), 1, allowed=(None,))
    need_int("trainer.num_sanity_val_steps", t.get("num_sanity_val_steps", 0), -1)
    need_number("trainer.gradient_clip_val", t.get("gradient_clip_val"), low=0.0, nullable=True)
    algorithm = t.get("gradient_clip_algorithm")
    if algorithm is not None and algorithm not in ("norm", "value"):
        raise ConfigError(f"trainer.gradient_clip_algorithm: {algorithm!r} is unknown; choose one of norm, value (or null)")
    for key, low in (("limit_train_batches", 1), ("limit_val_batches", 0)):
        value = t.get(key)
        if value is None or (is_int(value) and value >= low):
            continue
        if isinstance(value, float) and 0.0 < value <= 1.0:
            continue
        raise ConfigError(
            f"trainer.{key}: must be null, an integer >= {low} (batches) or a fraction in (0, 1], got {value!r}"
        )
    for key in ("deterministic", "enable_progress_bar"):
        need_bool(f"trainer.{key}", t.get(key, False))
    need_bool("allow_nonfinite_loss", cfg.get("allow_nonfinite_loss", False))
    need_number("loss_explosion_factor", cfg.get("loss_explosion_factor"), low=1.0, low_open=True, nullable=True)


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
    need_bool("checkpoint.enabled", ckpt.get("enabled", True))
    need_int("checkpoint.every_n_epochs", ckpt.get("every_n_epochs", 1), 1)


def _check_data(cfg: Any) -> None:
    data = cfg.data
    need_int("data.batch_size", data.get("batch_size", 1), 1)
    need_int("data.num_workers", data.get("num_workers", 0), 0)
    if "val_batch_size" in data:
        need_int("data.val_batch_size", data.get("val_batch_size"), 1, allowed=(None,))

#: model options that are layer sizes or counts (positive integers) where present
_MODEL_SIZES = ("hidden", "n_layer", "n_head", "d_model", "d_ff", "seq_len", "vocab_size")


def _check_model(cfg: Any) -> None:
    model = cfg.model
    for key in _MODEL_SIZES:
        if key not in model or (model.get(key) is None and key != "hidden"):
            continue
        value = model.get(key)
        sizes = list(value) if key == "hidden" and hasattr(value, "__iter__") and not isinstance(value, str) else [value]
        if not sizes or not all(is_int(v) and v >= 1 for v in sizes):
            what = "a positive integer or a list of them" if key == "hidden" else "a positive integer"
            raise ConfigError(f"model.{key}: must be {what}, got {value!r}")
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


def check_fault_values(cfg: Any) -> None:
    """``faults.*``: numbers of the right kind, and no key that does nothing alone (a step
    without its rank: nothing would be injected, and the run would look like it survived).
    ``faults.nan_rank`` null means every rank, so ``nan_at_step`` alone is valid."""
    faults = cfg.get("faults", {}) or {}
    slow_ms = faults.get("slow_ms")
    need_number("faults.slow_ms", 0 if slow_ms is None else slow_ms, low=0.0)
    for key in ("crash_at_step", "nan_at_step"):
        need_int(f"faults.{key}", faults.get(key), 1, allowed=(None,))
    for key in ("slow_rank", "crash_rank", "nan_rank"):
        need_int(f"faults.{key}", faults.get(key), 0, allowed=(None,))
    if faults.get("crash_at_step") is not None and faults.get("crash_rank") is None:
        raise ConfigError(
            f"faults.crash_at_step: set faults.crash_rank too (the rank that crashes at step "
            f"{faults.get('crash_at_step')}); without it nothing crashes"
        )
    every = faults.get("kill_every_s")
    if every is not None:
        need_number("faults.kill_every_s", every, low=0.0, low_open=True)
        if not ft.enabled(cfg):
            raise ConfigError("faults.kill_every_s: needs ft=torchft (the launcher restarts the killed workers); "
                              "without it the first kill ends the run")
    need_int("faults.kill_seed", faults.get("kill_seed"), 0, allowed=(None,))
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


def validate_values(cfg: Any) -> None:
    """Type and range of every option the workers read (seed, optim, trainer, checkpoint,
    data, model): a bad one fails here instead of in every worker.

    Raises:
        ConfigError: ``"<key>: <what is wrong>; <what is allowed>"``.
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
    method = launcher.get("start_method", "auto")
    if method not in START_METHODS:
        raise ValueError(f"launcher.start_method={method!r} is unknown; choose one of {', '.join(START_METHODS)}")
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
