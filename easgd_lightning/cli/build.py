"""Turn a resolved config into objects: strategy, compressor, model, data, logger, callbacks.

Every builder raises ``ConfigError`` naming the config key and the allowed values, so the
parent process can validate a whole config before any worker starts. The groups that build
an object go through one rule, :mod:`easgd_lightning.cli.targets` (``_target_``, every key
an argument of it, ``hydra.utils.instantiate``); the ``*_rule`` functions here say what is
particular to each group.
"""

from __future__ import annotations

import importlib
import logging
import os
from datetime import timedelta
from typing import Any

log = logging.getLogger("easgd_lightning")

__all__ = [
    "ConfigError",
    "strategy_names",
    "build_compression",
    "build_strategy",
    "build_comm",
    "build_model_and_data",
    "build_module",
    "build_data",
    "strategy_class",
    "strategy_rule",
    "compression_rule",
    "model_rule",
    "data_rule",
    "min_world_size",
    "validate_config",
    "validate_values",
    "check_hardware",
    "check_module_features",
    "check_resume",
    "threads_warning",
]


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and what is allowed."""


#: Hydra strategy option names that differ from the registered name
_HYDRA_NAMES = {"ddp": "ddp_compressed"}


def strategy_names() -> list[str]:
    """The names ``strategy.name`` accepts (the strategy registry's)."""
    from easgd_lightning.strategies.registry import strategy_names as registered

    return registered()


def _spec(name: Any):
    """The registry entry of ``strategy.name`` (see easgd_lightning.strategies.registry).

    Raises:
        ConfigError: ``strategy.name=...`` is unknown, naming the registered names.
    """
    from easgd_lightning.strategies.registry import strategy_spec

    try:
        return strategy_spec(_HYDRA_NAMES.get(name, name))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _plain(d: Any) -> dict:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(d, DictConfig):
        return OmegaConf.to_container(d, resolve=True)  # type: ignore[return-value]
    return dict(d or {})


# ----------------------------------------------------------------------------- the groups' rules
# Each group is checked and built by cli/targets.py (``_target_``, hydra.utils.instantiate);
# these say what is particular to each: its default target (by ``name``), the class the
# target must be, the keys easgd-train reads itself, and the arguments it builds.

#: base classes of Lightning's own: their arguments are set by the Trainer, not by strategy.*
_LIGHTNING_MODULES = ("pytorch_lightning.", "lightning.")
#: the compression group's SeCoPa planner keys (easgd-train's own; set on the built compressor)
_PLAN_KEYS = ("plan", "replan_steps", "max_partitions")


def strategy_rule(cfg: Any):
    """``strategy``: the class registered as ``strategy.name`` or a subclass; easgd-train
    passes the compressor, the timeout and the class's ``cli_kwargs(cfg)``."""
    from easgd_lightning.cli.targets import GroupRule, target_path
    from easgd_lightning.strategies.registry import LIGHTNING_OPTIONS

    name = cfg.strategy.get("name")
    cls = _spec(name).cls
    elsewhere = {"compression": "compression=NAME", "timeout": "timeout_s", "comm": "the comm group (comm.*)"}
    for key in getattr(cls, "cli_kwargs", lambda c: {})(cfg):
        elsewhere.setdefault(key, f"the rest of the config ({cls.__name__}.cli_kwargs)")
    return GroupRule("strategy", target_path(cls), base=cls, base_note=f" (the class of strategy.name={name})",
                     framework=("name",), elsewhere=elsewhere, stop_modules=_LIGHTNING_MODULES,
                     passthrough=LIGHTNING_OPTIONS)


def compression_rule(cfg: Any):
    """``compression``: the class registered as ``compression.name`` or a subclass;
    ``two_way`` (wrap it in TwoWayCompressor) and the attach point's SeCoPa planner keys
    (``plan``, ``replan_steps``, ``max_partitions``) are easgd-train's own keys."""
    from easgd_lightning.cli.targets import GroupRule, target_path
    from easgd_lightning.hooks.compressors import compressor_class

    name = cfg.compression.get("name", "none")
    try:
        cls = compressor_class(name)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return GroupRule("compression", target_path(cls), base=cls,
                     base_note=f" (the class of compression.name={name})", framework=("name", "two_way", *_PLAN_KEYS))


def _shipped_model_targets() -> dict[str, str]:
    """``model.name`` -> the dotted path of its network factory."""
    from easgd_lightning.cli.targets import target_path
    from easgd_lightning.models import MODEL_NAMES, model_factory

    return {name: target_path(model_factory(name)) for name in MODEL_NAMES}


def model_rule(cfg: Any):
    """``model``: a callable returning a network (wrapped in ClassifierModule with optim.*)
    or a LightningModule (used as it is); ``builder`` and ``channels_last`` are easgd-train's."""
    from easgd_lightning.cli.targets import GroupRule

    default = _shipped_model_targets().get(cfg.model.get("name"), "")
    return GroupRule("model", default, framework=("name", "builder", "channels_last"))


def data_rule(cfg: Any):
    """``data``: a LightningDataModule class (the one registered as ``data.name`` by default)."""
    import pytorch_lightning as pl

    from easgd_lightning.cli.targets import GroupRule
    from easgd_lightning.data import DATA_NAMES, datamodule_target

    name = cfg.data.get("name")
    default = datamodule_target(name) if name in DATA_NAMES else ""
    return GroupRule("data", default, base=pl.LightningDataModule, framework=("name",))


def _own_target(node: Any, shipped: Any) -> bool:
    """``node`` names a ``_target_`` of the user's own (not one of ``shipped``): its ``name``
    is then only a label."""
    target = node.get("_target_")
    return bool(target) and target not in set(shipped)


def _instantiate(cfg: Any, rule: Any, **kwargs: Any):
    """``instantiate_group``, a constructor's ValueError (a key out of range, named) or
    TypeError as a ConfigError."""
    from easgd_lightning.cli.targets import instantiate_group

    try:
        return instantiate_group(cfg, rule, **kwargs)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    except TypeError as err:
        raise ConfigError(f"{rule.group}={cfg[rule.group].get('name')}: {err}") from err


def build_compression(cfg: Any):
    """The compressor of ``cfg.compression`` (None for ``none``)."""
    from easgd_lightning.cli.targets import check_group
    from easgd_lightning.hooks.compressors.two_way import TwoWayCompressor
    from easgd_lightning.hooks.planner import check_plan_options

    rule = compression_rule(cfg)
    two_way = cfg.compression.get("two_way", False)
    _need_bool("compression.two_way", two_way)
    plan = {key: cfg.compression.get(key, default) for key, default in zip(_PLAN_KEYS, ("none", 0, 8))}
    try:
        check_plan_options(**plan)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if check_group(cfg, rule) is rule.base and cfg.compression.get("name", "none") == "none":
        return None  # dense: the strategies' own uncompressed path
    compressor = _instantiate(cfg, rule)
    if two_way:
        try:
            compressor = TwoWayCompressor(compressor)
        except ValueError as err:
            raise ConfigError(str(err)) from err
    for key, value in plan.items():  # read by the DDP hook (hooks/planner.py)
        setattr(compressor, key, value)
    return compressor


def build_comm(cfg: Any):
    """The :class:`~easgd_lightning.comm.layout.CommLayout` of ``cfg.comm`` (defaults when
    the config has no ``comm`` group).

    Raises:
        ConfigError: a bad or unknown ``comm.`` key.
    """
    from easgd_lightning.comm.layout import CommLayout

    opts = _plain(cfg.get("comm") if hasattr(cfg, "get") else None)
    opts.pop("_target_", None)
    try:
        return CommLayout(**opts)
    except TypeError:
        unknown = sorted(set(opts) - {"fusion_mb", "hierarchy", "procs_per_node", "allreduce", "aggregator"})
        raise ConfigError(
            f"comm.{unknown[0] if unknown else '?'}: not a comm option; the options are fusion_mb, "
            "hierarchy, procs_per_node, allreduce, aggregator"
        ) from None
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _takes_comm(cls: type) -> bool:
    """Whether the strategy class reads the ``comm`` group (``ddp``, ``sync_easgd``,
    ``local_sgd``: a ``comm`` constructor argument and ``hierarchical = True``)."""
    return bool(getattr(cls, "hierarchical", False))


def _plans_compression(cls: type) -> bool:
    """Whether the strategy class runs the SeCoPa planner (``compression.plan``): the
    compressed DDP hook's strategy (``ddp``) and its subclasses."""
    from easgd_lightning.strategies.ddp import CompressedDDPStrategy

    return issubclass(cls, CompressedDDPStrategy)


def min_world_size(name: str) -> int:
    """The fewest processes a strategy needs."""
    return _spec(name).min_world_size


def strategy_class(cfg: Any) -> type:
    """The strategy class ``cfg.strategy`` builds (``_target_``; keys checked)."""
    from easgd_lightning.cli.targets import check_group

    return check_group(cfg, strategy_rule(cfg))


def build_strategy(cfg: Any, *, world_size: int | None = None):
    """The strategy of ``cfg.strategy`` with the compressor of ``cfg.compression``."""
    rule = strategy_rule(cfg)
    cls = strategy_class(cfg)
    built: dict[str, Any] = {"timeout": timedelta(seconds=float(cfg.get("timeout_s", 300)))}
    compressor = build_compression(cfg)
    if compressor is not None:
        built["compression"] = compressor
    built.update(getattr(cls, "cli_kwargs", lambda c: {})(cfg))
    layout = build_comm(cfg)
    if layout.allreduce != "ring" and not getattr(cls, "switch_allreduce", False):
        raise ConfigError(f"comm.allreduce: {layout.allreduce} sums strategy=ddp's dense gradient buckets only, "
                          f"not strategy={cfg.strategy.get('name')}")
    plan = cfg.compression.get("plan", "none")
    if plan != "none" and not _plans_compression(cls):  # the planner lives in the DDP hook only
        raise ConfigError(f"compression.plan: {plan} plans strategy=ddp's compressed gradient buckets only, "
                          f"not strategy={cfg.strategy.get('name')}; there it must be none")
    if _takes_comm(cls):
        built["comm"] = layout
    elif layout.hierarchy != "flat":  # a recipe's comm.* in a strategy sweep: not an error
        log.warning("comm.hierarchy=%s does not apply to strategy=%s (ddp, sync_easgd and local_sgd "
                    "read the comm group): it reduces as it always does", layout.hierarchy, cfg.strategy.get("name"))
    if world_size is not None:
        try:
            layout.check_world(world_size)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    strategy = _instantiate(cfg, rule, **built)
    if world_size is not None:
        try:
            strategy.validate_world_size(world_size)
        except ValueError as err:
            raise ConfigError(str(err)) from err
    return strategy


def build_model_and_data(cfg: Any):
    """(LightningModule, LightningDataModule) for ``cfg.model``, ``cfg.data``, ``cfg.optim``."""
    dm = build_data(cfg)
    return build_module(cfg, dm), dm


def build_module(cfg: Any, dm: Any):
    """The LightningModule of ``cfg.model`` and ``cfg.optim`` for the data module ``dm``.

    ``model._target_`` is called with the model keys, plus what the run knows and the
    target takes where the config leaves it out: ``num_classes`` / ``in_features`` /
    ``vocab_size`` of ``dm``, ``seq_len`` (``data.seq_len``), ``optim`` (the keys of
    ``cfg.optim``) and ``seed``. A network is wrapped in :class:`ClassifierModule` with
    ``optim.*``; a LightningModule is used as it is. ``model.builder`` (``module:function``
    called with ``(cfg, dm)``), when set, builds instead.
    """
    import pytorch_lightning as pl

    from easgd_lightning.cli.targets import check_group
    from easgd_lightning.models import ClassifierModule

    rule = model_rule(cfg)
    builder = cfg.model.get("builder")
    if builder:  # a module:function returning (LightningModule) for custom model kinds
        check_group(cfg, rule)
        mod, fn = builder.split(":")
        return getattr(importlib.import_module(mod), fn)(cfg, dm)
    optim = _plain(cfg.optim)
    runtime = {"num_classes": getattr(dm, "num_classes", 10), "in_features": getattr(dm, "in_features", 64),
               "optim": optim, "seed": int(cfg.get("seed", 0))}
    if "seq_len" in cfg.data:
        runtime["seq_len"] = cfg.data.seq_len
    if getattr(dm, "vocab_size", None):
        runtime["vocab_size"] = dm.vocab_size
    built = _instantiate(cfg, rule, runtime=runtime)
    if isinstance(built, pl.LightningModule):
        return built
    optim["channels_last"] = bool(cfg.model.get("channels_last", False)) or bool(optim.get("channels_last", False))
    try:
        return ClassifierModule(built, **optim)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def build_data(cfg: Any):
    """The LightningDataModule of ``cfg.data`` (constructing it checks paths such as data.root).

    Raises:
        ConfigError: a bad data option, naming its ``data.`` key.
    """
    return _instantiate(cfg, data_rule(cfg))


# ----------------------------------------------------------------------------- value checks
# Each check reads a key of the composed config and raises ConfigError "<key>: <what is
# wrong>; <what is allowed>" so no worker ever starts on a value it would refuse later.

_PRECISIONS = ("32-true", "64-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")
#: Lightning's older spellings, still accepted by it
_PRECISION_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}
_ACCELERATORS = ("cpu", "gpu", "cuda", "auto")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _need_int(key: str, value: Any, low: int, *, allowed: tuple = ()) -> None:
    """``value`` is an integer >= ``low`` (or one of ``allowed``)."""
    if value in allowed and (value is None or _is_int(value)):
        return
    if not _is_int(value) or value < low:
        extra = "".join(f" or {a if a is not None else 'null'}" for a in allowed)
        raise ConfigError(f"{key}: must be an integer >= {low}{extra}, got {value!r}")


def _need_number(key: str, value: Any, *, low: float, low_open: bool = False,
                 high: float | None = None, nullable: bool = False) -> None:
    """``value`` is a number in [low, high) (or (low, high) with ``low_open``)."""
    if value is None and nullable:
        return
    ok = _is_number(value) and (value > low if low_open else value >= low)
    ok = ok and (high is None or value < high)
    if not ok:
        if high is not None:
            allowed = f"in {'(' if low_open else '['}{low:g}, {high:g})"
        else:
            allowed = f"{'>' if low_open else '>='} {low:g}"
        raise ConfigError(f"{key}: must be a number {allowed}, got {value!r}")


def _need_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: must be true or false, got {value!r}")


def _check_seed(cfg: Any) -> None:
    seed = cfg.get("seed", 0)
    if not _is_int(seed) or not 0 <= seed < 2**32:
        raise ConfigError(f"seed: must be an integer in [0, 2**32 - 1], got {seed!r}")


def _check_optim(cfg: Any) -> None:
    from easgd_lightning.models.classifier import OPTIMIZERS, SCHEDULES

    optim = cfg.optim
    name = optim.get("optimizer", "sgd")
    if name not in OPTIMIZERS:
        raise ConfigError(f"optim.optimizer: {name!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")
    _need_number("optim.lr", optim.get("lr"), low=0.0, low_open=True)
    _need_number("optim.momentum", optim.get("momentum", 0.0), low=0.0, high=1.0)
    _need_number("optim.weight_decay", optim.get("weight_decay", 0.0), low=0.0)
    _need_bool("optim.nesterov", optim.get("nesterov", False))
    schedule = optim.get("schedule", "constant")
    if schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule: {schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    _need_int("optim.warmup_steps", optim.get("warmup_steps", 0), 0)
    _need_int("optim.total_steps", optim.get("total_steps"), 1, allowed=(None,))
    _need_int("optim.step_size", optim.get("step_size", 1000), 1)
    _need_number("optim.gamma", optim.get("gamma", 0.1), low=0.0, low_open=True)
    _need_number("optim.min_lr", optim.get("min_lr", 0.0), low=0.0)
    for key in ("warmup_epochs", "step_size_epochs"):
        _need_number(f"optim.{key}", optim.get(key), low=0.0, nullable=True)
    for key in ("milestones", "milestone_epochs"):
        values = optim.get(key)
        if values is not None and (
            isinstance(values, (str, bytes)) or not hasattr(values, "__iter__")
            or not all(_is_number(v) and v >= 0 for v in values)
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
    _need_int("trainer.max_steps", max_steps, 1, allowed=(-1,))
    max_epochs = t.get("max_epochs")
    if max_epochs == -1 and _is_int(max_epochs) and max_steps == -1:
        raise ConfigError("trainer.max_epochs: -1 (no limit) needs trainer.max_steps >= 1")
    _need_int("trainer.max_epochs", max_epochs, 1, allowed=(-1,))
    _need_int("trainer.accumulate_grad_batches", t.get("accumulate_grad_batches", 1), 1)
    _need_int("trainer.log_every_n_steps", t.get("log_every_n_steps", 10), 1)
    _need_int("trainer.check_val_every_n_epoch", t.get("check_val_every_n_epoch", 1), 1, allowed=(None,))
    _need_int("trainer.num_sanity_val_steps", t.get("num_sanity_val_steps", 0), -1)
    _need_number("trainer.gradient_clip_val", t.get("gradient_clip_val"), low=0.0, nullable=True)
    algorithm = t.get("gradient_clip_algorithm")
    if algorithm is not None and algorithm not in ("norm", "value"):
        raise ConfigError(f"trainer.gradient_clip_algorithm: {algorithm!r} is unknown; choose one of norm, value (or null)")
    for key, low in (("limit_train_batches", 1), ("limit_val_batches", 0)):
        value = t.get(key)
        if value is None or (_is_int(value) and value >= low):
            continue
        if isinstance(value, float) and 0.0 < value <= 1.0:
            continue
        raise ConfigError(
            f"trainer.{key}: must be null, an integer >= {low} (batches) or a fraction in (0, 1], got {value!r}"
        )
    for key in ("deterministic", "enable_progress_bar"):
        _need_bool(f"trainer.{key}", t.get(key, False))
    _need_bool("allow_nonfinite_loss", cfg.get("allow_nonfinite_loss", False))
    _need_number("loss_explosion_factor", cfg.get("loss_explosion_factor"), low=1.0, low_open=True, nullable=True)


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
    if _is_int(devices) and devices > found:
        raise ConfigError(f"trainer.devices: {devices} GPUs per node asked for, this machine has {found}")


def _check_checkpoint(cfg: Any) -> None:
    ckpt = cfg.get("checkpoint") or {}
    _need_bool("checkpoint.enabled", ckpt.get("enabled", True))
    _need_int("checkpoint.every_n_epochs", ckpt.get("every_n_epochs", 1), 1)


def _check_data(cfg: Any) -> None:
    data = cfg.data
    _need_int("data.batch_size", data.get("batch_size", 1), 1)
    _need_int("data.num_workers", data.get("num_workers", 0), 0)
    if "val_batch_size" in data:
        _need_int("data.val_batch_size", data.get("val_batch_size"), 1, allowed=(None,))


#: model options that are layer sizes or counts (positive integers) where present
_MODEL_SIZES = ("hidden", "n_layer", "n_head", "d_model", "d_ff", "seq_len", "vocab_size")


def _check_model(cfg: Any) -> None:
    model = cfg.model
    for key in _MODEL_SIZES:
        if key not in model or (model.get(key) is None and key != "hidden"):
            continue
        value = model.get(key)
        sizes = list(value) if key == "hidden" and hasattr(value, "__iter__") and not isinstance(value, str) else [value]
        if not sizes or not all(_is_int(v) and v >= 1 for v in sizes):
            what = "a positive integer or a list of them" if key == "hidden" else "a positive integer"
            raise ConfigError(f"model.{key}: must be {what}, got {value!r}")
    net = model.get("_target_") or _shipped_model_targets().get(model.get("name"))
    if cfg.strategy.get("name") == "pipeline_3d" and not model.get("builder") and net in _shipped_model_targets().values():
        raise ConfigError(
            f"model.name: {model.get('name')!r} has no pipeline form (configure_pipeline), which "
            "strategy=pipeline_3d needs; use model=gpt_tiny or a recipe=nlp3d/... recipe"
        )


def _check_fault_values(cfg: Any) -> None:
    """``faults.*``: numbers of the right kind, and no key that does nothing alone (a step
    without its rank: nothing would be injected, and the run would look like it survived).
    ``faults.nan_rank`` null means every rank, so ``nan_at_step`` alone is valid."""
    faults = cfg.get("faults", {}) or {}
    slow_ms = faults.get("slow_ms")
    _need_number("faults.slow_ms", 0 if slow_ms is None else slow_ms, low=0.0)
    for key in ("crash_at_step", "nan_at_step"):
        _need_int(f"faults.{key}", faults.get(key), 1, allowed=(None,))
    for key in ("slow_rank", "crash_rank", "nan_rank"):
        _need_int(f"faults.{key}", faults.get(key), 0, allowed=(None,))
    if faults.get("crash_at_step") is not None and faults.get("crash_rank") is None:
        raise ConfigError(
            f"faults.crash_at_step: set faults.crash_rank too (the rank that crashes at step "
            f"{faults.get('crash_at_step')}); without it nothing crashes"
        )
    every = faults.get("kill_every_s")
    if every is not None:
        _need_number("faults.kill_every_s", every, low=0.0, low_open=True)
        if str((cfg.get("ft") or {}).get("name", "none")) != "torchft":
            raise ConfigError("faults.kill_every_s: needs ft=torchft (the launcher restarts the killed workers); "
                              "without it the first kill ends the run")
    _need_int("faults.kill_seed", faults.get("kill_seed"), 0, allowed=(None,))
    if faults.get("nan_rank") is not None and faults.get("nan_at_step") is None:
        raise ConfigError("faults.nan_rank: set faults.nan_at_step too (the step before which its parameter "
                          "becomes NaN); without it nothing is injected")


def _check_fault_ranks_step(cfg: Any, strategy: Any, world: int) -> None:
    """A fault on a rank that never takes a training step (the parameter server of the
    asynchronous strategies: the last rank) would never fire."""
    if not getattr(strategy, "uses_server", False):
        return
    server = world - 1
    faults = cfg.get("faults", {}) or {}
    for key in ("slow_rank", "crash_rank", "nan_rank"):
        if faults.get(key) == server:
            raise ConfigError(
                f"faults.{key}: rank {server} is strategy={cfg.strategy.get('name')}'s parameter server, which "
                f"never takes a training step, so the fault would never fire; choose a worker rank in [0, {server - 1}]"
            )


def _check_pipeline_precision(cfg: Any) -> None:
    """strategy=pipeline_3d runs in fp32 (strategies/pipeline.py refuses any other precision
    plugin in its setup, after the workers started)."""
    if cfg.strategy.get("name") != "pipeline_3d":
        return
    precision = str(cfg.trainer.get("precision", "32-true"))
    if _PRECISION_ALIASES.get(precision, precision) != "32-true":
        raise ConfigError(
            f"trainer.precision: strategy=pipeline_3d runs in fp32: set trainer.precision=32-true, got {precision}"
        )


def _check_model_fits_data(cfg: Any, dm: Any) -> None:
    """A language model (its ``_target_`` takes ``vocab_size``) needs token data: a data
    module with a ``vocab_size`` (data=text), or ``model.vocab_size`` set. On other data its
    embedding would be indexed with feature values (an index error in every worker)."""
    import inspect

    model = cfg.model
    if model.get("builder") or model.get("vocab_size") is not None or getattr(dm, "vocab_size", None):
        return
    try:
        from hydra._internal.utils import _locate

        target = _locate(str(model.get("_target_") or _shipped_model_targets().get(model.get("name"))))
        params = inspect.signature(target).parameters
    except Exception:  # the model's own rule reports a target it cannot import
        return
    if "vocab_size" in params:
        raise ConfigError(
            f"model={model.get('name')}: a language model needs token data with a vocabulary (data=text, or a "
            f"data module with vocab_size); data={cfg.data.get('name')} has none"
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
    if not _is_int(devices) or not _is_int(threads):
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


def _meta_module(cfg: Any, dm: Any):
    """``cfg``'s LightningModule with every tensor on the meta device (shapes, no memory, no
    initialisation cost; ``configure_model`` run for modules that build their layers there),
    or None when it cannot be built that way."""
    import torch

    try:
        with torch.device("meta"):
            module = build_module(cfg, dm)
            if next(iter(module.parameters()), None) is None and hasattr(module, "configure_model"):
                module.configure_model()
    except ConfigError:
        raise
    except Exception:  # the workers build it for real and report what is wrong
        log.debug("could not build the model on the meta device", exc_info=True)
        return None
    return module


def _count_optimizers(module: Any) -> int | None:
    """How many optimizers ``module.configure_optimizers()`` returns without a Trainer (None
    when it needs one, e.g. for a schedule in epochs: the strategy's setup checks then)."""
    try:
        from easgd_lightning.compat.lightning import configured_optimizers

        optimizers = configured_optimizers(module.configure_optimizers())
    except Exception:
        return None
    return len(optimizers)


def check_module_features(cfg: Any, module: Any) -> None:
    """Refuse, before launch, a module the strategy cannot train as written: more optimizers
    than it drives, manual optimization where it is not honoured, no pipeline form for
    ``pipeline_3d`` (each strategy class declares ``max_optimizers`` and
    ``supports_manual_optimization``; Lightning's DDP has no limit).

    Raises:
        ConfigError: naming the model and what the strategy allows.
    """
    if module is None:
        return
    name = cfg.strategy.get("name")
    cls = strategy_class(cfg)
    model = f"model={cfg.model.get('name')}"
    if not getattr(module, "automatic_optimization", True) and not getattr(cls, "supports_manual_optimization", True):
        raise ConfigError(
            f"{model}: uses manual optimization (automatic_optimization=False), which strategy={name} "
            "does not support; use automatic optimization or another strategy (see the README's feature table)"
        )
    limit = getattr(cls, "max_optimizers", None)
    count = _count_optimizers(module) if limit is not None else None
    if count is not None and count > limit:
        raise ConfigError(
            f"{model}: configure_optimizers returns {count} optimizers; strategy={name} drives exactly "
            f"{limit}: return one optimizer (parameter groups may differ in lr and weight decay), or use strategy=ddp"
        )
    if name == "pipeline_3d" and not hasattr(module, "configure_pipeline"):
        raise ConfigError(
            f"{model}: {type(module).__name__} has no pipeline form (configure_pipeline), which "
            "strategy=pipeline_3d needs; use model=gpt_tiny or a recipe=nlp3d/... recipe"
        )


def idle_compression_warning(cfg: Any, module: Any) -> str | None:
    """The warning for a compressor that can never engage, else None.

    Rule (hooks/_exchange.py): tensors with fewer than ``compression.min_numel`` elements
    travel dense. DDP compresses gradients (parameters that train); the elastic strategies
    compress parameters and floating-point buffers. When every such tensor is below the
    limit, nothing is compressed and the compression ratio is exactly 1.0.
    """
    from easgd_lightning.hooks.compressors.base import DEFAULT_MIN_NUMEL

    name = cfg.compression.get("name", "none")
    if name in ("none", "optimus_cc") or module is None:
        return None
    limit = cfg.compression.get("min_numel")
    limit = DEFAULT_MIN_NUMEL if limit is None else int(limit)
    tensors = [p for p in module.parameters() if p.requires_grad]
    if _spec(cfg.strategy.get("name")).name != "ddp_compressed":
        tensors = list(module.parameters()) + [b for b in module.buffers() if b.is_floating_point()]
    sizes = [t.numel() for t in tensors]
    if not sizes or max(sizes) >= limit:
        return None
    return (
        f"compression={name} never engages: every tensor of model={cfg.model.get('name')} has fewer "
        f"than compression.min_numel={limit} elements (largest: {max(sizes)}), so all travel dense "
        f"and the compression ratio is 1.0; set compression.min_numel={max(sizes)} or lower to compress"
    )


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
    from pathlib import Path

    from easgd_lightning.utils.checkpoint import (
        CheckpointError,
        checkpoint_identity,
        load_checkpoint_file,
        verify_checkpoint_dir,
    )

    name = cfg.strategy.get("name")
    if name == "pipeline_3d":  # a directory of per-stage shards (strategies/pipeline.py)
        if not (Path(path) / "meta.pt").is_file():
            raise ConfigError(f"checkpoint.resume: {path} is not a pipeline_3d checkpoint directory (no meta.pt)")
        try:
            verify_checkpoint_dir(path, "meta.pt")  # every shard readable, checksums matching
        except CheckpointError as err:
            raise ConfigError(f"checkpoint.resume: {err}") from None
        return {"checkpoint": str(path), "exact": None, "inexact_because": None}
    try:
        ckpt = load_checkpoint_file(path)
    except CheckpointError as err:
        raise ConfigError(f"checkpoint.resume: {err}") from None
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
    saved = {k: tuple(v.shape) for k, v in (ckpt.get("state_dict") or {}).items()}
    if module is not None and saved:
        here = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        differ = sorted(set(saved) ^ set(here)) or sorted(k for k in saved if saved[k] != here[k])
        if differ:
            k = differ[0]
            raise ConfigError(
                f"checkpoint.resume: {path} holds another model than model={cfg.model.get('name')} "
                f"({len(differ)} tensors differ, e.g. {k}: {list(saved[k]) if k in saved else 'absent'} "
                f"in the checkpoint, {list(here[k]) if k in here else 'absent'} here)"
            )
    point = resume_point(ckpt)
    _check_something_to_train(cfg, path, point)
    point = {"checkpoint": str(path), **point}
    if point["inexact_because"] and os.environ.get("RANK", "0") == "0":
        log.warning("checkpoint.resume: the resume is inexact: %s", point["inexact_because"])
    return point


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
    if _is_int(max_steps) and max_steps != -1 and step >= max_steps:
        raise ConfigError(
            f"checkpoint.resume: {path} is at step {step} and trainer.max_steps={max_steps}: nothing would be "
            f"trained; set trainer.max_steps above {step}"
        )
    if _is_int(max_epochs) and max_epochs != -1 and done >= max_epochs:
        raise ConfigError(
            f"checkpoint.resume: {path} has finished {done} epochs and trainer.max_epochs={max_epochs}: nothing "
            f"would be trained; set trainer.max_epochs above {done}"
        )


def validate_config(cfg: Any, *, hardware: bool = True) -> dict[str, Any]:
    """Check everything that can be checked before processes start.

    Returns:
        What the checks learnt that the summary records: ``resume`` (:func:`check_resume`).

    Args:
        hardware: also check that the accelerator asked for exists on this machine (off to
            validate, say, a GPU recipe on a laptop).

    Raises:
        ConfigError: with one line naming the key and the allowed values.
    """
    from easgd_lightning.data import DATA_NAMES, datamodule_target
    from easgd_lightning.models import MODEL_NAMES

    name = cfg.strategy.get("name")
    _spec(name)
    own_model = cfg.model.get("builder") or _own_target(cfg.model, _shipped_model_targets().values())
    if cfg.model.get("name") not in MODEL_NAMES and not own_model:
        raise ConfigError(
            f"model.name={cfg.model.get('name')!r} is unknown; choose one of {', '.join(MODEL_NAMES)}"
        )
    if cfg.data.get("name") not in DATA_NAMES and not _own_target(cfg.data, map(datamodule_target, DATA_NAMES)):
        raise ConfigError(
            f"data.name={cfg.data.get('name')!r} is unknown; choose one of {', '.join(DATA_NAMES)}"
        )
    devices = cfg.trainer.devices
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ConfigError(f"trainer.devices must be a positive integer, got {devices!r}")
    nodes = cfg.trainer.get("num_nodes", 1)
    if not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"trainer.num_nodes must be a positive integer, got {nodes!r}")
    world = devices * nodes
    need = min_world_size(name)
    if world < need:
        raise ConfigError(
            f"trainer.devices={devices} (x num_nodes={nodes}) is too few for strategy={name}: "
            f"it needs at least {need} processes"
        )
    timeout = cfg.get("timeout_s", 300)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"timeout_s must be > 0 seconds, got {timeout!r}")
    from easgd_lightning.cli.launch import resolve_start_method

    try:
        resolve_start_method(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    _check_fault_values(cfg)
    faults = cfg.get("faults", {}) or {}
    for key in ("slow_rank", "crash_rank", "nan_rank", "kill_rank"):
        r = faults.get(key)
        if r is not None and not (isinstance(r, int) and 0 <= r < world):
            raise ConfigError(f"faults.{key} must be a rank in [0, {world - 1}], got {r!r}")
    if faults.get("crash_rank") is not None and not (
        isinstance(faults.get("crash_at_step"), int) and faults.get("crash_at_step") >= 1
    ):
        raise ConfigError("faults.crash_at_step must be a step >= 1 when faults.crash_rank is set")
    if faults.get("kill_rank") is not None and not (
        isinstance(faults.get("kill_at_step"), int) and faults.get("kill_at_step") >= 1
    ):
        raise ConfigError("faults.kill_at_step must be a step >= 1 when faults.kill_rank is set")
    from easgd_lightning.ft.config import check_ft

    check_ft(cfg, world)  # the ft group (ft=none: nothing to check)
    if (faults.get("slow_ms") or 0) < 0:
        raise ConfigError(f"faults.slow_ms must be >= 0, got {faults.get('slow_ms')}")
    validate_values(cfg)
    from easgd_lightning.cli.search import check_search

    try:
        check_search(cfg.get("search"))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    from easgd_lightning.cli.targets import check_group
    from easgd_lightning.cli.trainer_config import trainer_rule

    for rule in (strategy_rule(cfg), compression_rule(cfg), model_rule(cfg), data_rule(cfg), trainer_rule()):
        check_group(cfg, rule)  # every key is an argument of the group's _target_ (or easgd-train's own)
    if hardware:
        check_hardware(cfg)
    _check_pipeline_precision(cfg)
    dm = build_data(cfg)  # a bad data.root (or other data option) fails here, before any process
    _check_model_fits_data(cfg, dm)
    threads = cfg.get("threads_per_process")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ConfigError(f"threads_per_process must be a positive integer or null, got {threads!r}")
    logger = cfg.logger.get("name")
    if logger not in ("wandb", "tensorboard", "csv", "none"):
        raise ConfigError(f"logger.name={logger!r} is unknown; choose one of wandb, tensorboard, csv, none")
    strategy = build_strategy(cfg, world_size=world)
    _check_fault_ranks_step(cfg, strategy, world)
    if name in ("sync_easgd", "easgd_round_robin"):  # alpha = lr * rho needs the optimizer's lr
        try:
            from easgd_lightning.strategies import elastic

            elastic.resolve_alpha(
                world_size=world,
                alpha=cfg.strategy.get("alpha"),
                beta=cfg.strategy.get("beta"),
                rho=cfg.strategy.get("rho"),
                lr=cfg.optim.lr,
            )
        except ValueError as err:
            raise ConfigError(str(err)) from err
    module = _meta_module(cfg, dm)  # shapes only: cheap even for ImageNet models
    check_module_features(cfg, module)
    if module is not None and hasattr(strategy, "validate_module"):  # the strategy's own rules
        try:
            strategy.validate_module(module)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if cfg.compression.get("name", "none") not in ("none", "optimus_cc"):
        warning = idle_compression_warning(cfg, module)
        if warning and os.environ.get("RANK", "0") == "0":  # once per run, not once per rank
            log.warning(warning)
    warning = threads_warning(cfg)
    if warning and os.environ.get("LOCAL_RANK", "0") == "0":  # once per node
        log.warning(warning)
    return {"resume": check_resume(cfg, world, module)}
