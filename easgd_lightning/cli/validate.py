"""Validate a whole composed config before any process starts.

:func:`validate_config` runs every check that can run in the launcher: the values
(:mod:`easgd_lightning.cli.values`), every group's keys (:mod:`easgd_lightning.cli.targets`),
the ``ft`` group, the search space, then builds the data module, the strategy and the
model (on the meta device) to ask them: the strategy's own refusals (its registry entry and
class: ``validate_world_size``, ``validate_module``, ``max_optimizers``,
``supports_manual_optimization``, ``module_method``, ``check_optimizer_lr``) and the resume
checkpoint (:mod:`easgd_lightning.cli.resume`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from easgd_lightning.cli.build import build_data, build_module, build_strategy, strategy_class
from easgd_lightning.cli.resume import check_resume
from easgd_lightning.cli.rules import (
    compresses,
    compression_name,
    compression_rule,
    data_rule,
    model_rule,
    own_target,
    shipped_model_targets,
    spec_of,
    strategy_rule,
    strategy_spec_of,
)
from easgd_lightning.cli.targets import check_group
from easgd_lightning.cli.values import (
    LOGGERS,
    check_fault_values,
    check_hardware,
    check_strategy_precision,
    resolve_start_method,
    threads_warning,
    validate_values,
)
from easgd_lightning.utils.checks import check_int, check_positive, is_int
from easgd_lightning.utils.errors import ConfigError, config_errors

log = logging.getLogger("easgd_lightning")

__all__ = [
    "ConfigError",
    "validate_config",
    "check_module_features",
    "idle_compression_warning",
    "meta_module",
]


def _check_fault_ranks_step(cfg: Any, strategy: Any, world: int) -> None:
    """A fault on a rank that never takes a training step (a parameter server of the
    asynchronous strategies: the last ``strategy.servers`` ranks) would never fire."""
    if not getattr(strategy, "uses_server", False):
        return
    first_server = world - int(getattr(strategy, "servers", 1) or 1)
    faults = cfg.get("faults", {}) or {}
    for key in ("slow_rank", "crash_rank", "nan_rank"):
        rank = faults.get(key)
        if is_int(rank) and first_server <= rank < world:
            raise ConfigError(
                f"faults.{key}: rank {rank} is strategy={cfg.strategy.get('name')}'s parameter server, which "
                f"never takes a training step, so the fault would never fire; choose a worker rank in "
                f"[0, {first_server - 1}]"
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

        target = _locate(str(model.get("_target_") or shipped_model_targets().get(model.get("name"))))
        params = inspect.signature(target).parameters
    except Exception:  # the model's own rule reports a target it cannot import
        return
    if "vocab_size" in params:
        raise ConfigError(
            f"model={model.get('name')}: a language model needs token data with a vocabulary (data=text, or a "
            f"data module with vocab_size); data={cfg.data.get('name')} has none"
        )


def meta_module(cfg: Any, dm: Any):
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
    than it drives, manual optimization where it is not honoured, no method the strategy
    needs (each strategy class declares ``max_optimizers`` and
    ``supports_manual_optimization``, Lightning's DDP has no limit; its registry entry
    ``module_method``: pipeline_3d's ``configure_pipeline``).

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
    need = spec_of(name).module_method
    if need and not hasattr(module, need[0]):
        method, form, fix = need
        raise ConfigError(f"{model}: {type(module).__name__} has no {form} ({method}), which strategy={name} needs; {fix}")


def idle_compression_warning(cfg: Any, module: Any) -> str | None:
    """The warning for a compressor that can never engage, else None.

    Rule (hooks/_exchange.py): tensors with fewer than ``compression.min_numel`` elements
    travel dense. DDP (``gradient_hook``) compresses gradients (parameters that train); the elastic strategies
    compress parameters and floating-point buffers. When every such tensor is below the
    limit, nothing is compressed and the compression ratio is exactly 1.0.
    """
    from easgd_lightning.hooks.compressors.base import DEFAULT_MIN_NUMEL

    name = compression_name(cfg)
    if not compresses(cfg) or module is None:
        return None
    limit = cfg.compression.get("min_numel")
    limit = DEFAULT_MIN_NUMEL if limit is None else int(limit)
    tensors = [p for p in module.parameters() if p.requires_grad]
    if not getattr(strategy_spec_of(cfg).cls, "gradient_hook", False):
        tensors = list(module.parameters()) + [b for b in module.buffers() if b.is_floating_point()]
    sizes = [t.numel() for t in tensors]
    if not sizes or max(sizes) >= limit:
        return None
    return (
        f"compression={name} never engages: every tensor of model={cfg.model.get('name')} has fewer "
        f"than compression.min_numel={limit} elements (largest: {max(sizes)}), so all travel dense "
        f"and the compression ratio is 1.0; set compression.min_numel={max(sizes)} or lower to compress"
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
    _check_names(cfg)
    world = _check_world(cfg)
    _check_launcher_and_faults(cfg, world)
    validate_values(cfg)
    _check_search_and_groups(cfg)
    if hardware:
        check_hardware(cfg)
    check_strategy_precision(cfg)
    dm = build_data(cfg)  # a bad data.root (or other data option) fails here, before any process
    _check_model_fits_data(cfg, dm)
    _check_threads_and_logger(cfg)
    strategy = build_strategy(cfg, world_size=world)
    _check_fault_ranks_step(cfg, strategy, world)
    _check_optimizer_lr(cfg, world)
    module = meta_module(cfg, dm)  # shapes only: cheap even for ImageNet models
    _check_module(cfg, strategy, module)
    _warn_once(cfg, module)
    return {"resume": check_resume(cfg, world, module)}


def _check_names(cfg: Any) -> None:
    """``strategy.name``, ``model.name`` and ``data.name`` are registered (or the group names
    a ``_target_`` of the user's own)."""
    from easgd_lightning.data import DATA_NAMES, datamodule_target
    from easgd_lightning.models import MODEL_NAMES

    spec_of(cfg.strategy.get("name"))
    own_model = cfg.model.get("builder") or own_target(cfg.model, shipped_model_targets().values())
    if cfg.model.get("name") not in MODEL_NAMES and not own_model:
        raise ConfigError(
            f"model.name={cfg.model.get('name')!r} is unknown; choose one of {', '.join(MODEL_NAMES)}"
        )
    if cfg.data.get("name") not in DATA_NAMES and not own_target(cfg.data, map(datamodule_target, DATA_NAMES)):
        raise ConfigError(
            f"data.name={cfg.data.get('name')!r} is unknown; choose one of {', '.join(DATA_NAMES)}"
        )


def _check_world(cfg: Any) -> int:
    """The number of processes (``trainer.devices`` x ``trainer.num_nodes``), at least the
    strategy's fewest (its registry entry)."""
    with config_errors():
        devices = check_int("trainer.devices", cfg.trainer.devices, 1)
        nodes = check_int("trainer.num_nodes", cfg.trainer.get("num_nodes", 1), 1)
    world = devices * nodes
    name = cfg.strategy.get("name")
    need = spec_of(name).min_world_size
    if world < need:
        raise ConfigError(
            f"trainer.devices={devices} (x num_nodes={nodes}) is too few for strategy={name}: "
            f"it needs at least {need} processes"
        )
    return world


def _check_launcher_and_faults(cfg: Any, world: int) -> None:
    """``timeout_s``, ``launcher.start_method``, ``faults.*`` (ranks within the world) and
    the ``ft`` group."""
    from easgd_lightning.ft.config import check_ft

    with config_errors():
        check_positive("timeout_s", cfg.get("timeout_s", 300), unit="seconds")
        resolve_start_method(cfg)
    check_fault_values(cfg)
    _check_fault_ranks(cfg, world)
    check_ft(cfg, world)  # the ft group (ft=none: nothing to check)


@config_errors()
def _check_fault_ranks(cfg: Any, world: int) -> None:
    """Every ``faults.*_rank`` is a rank of the world (an integer in [0, world - 1]), with
    its step where it needs one (the step's type: :func:`check_fault_values`)."""
    faults = cfg.get("faults", {}) or {}
    for key in ("slow_rank", "crash_rank", "nan_rank", "kill_rank"):
        check_int(f"faults.{key}", faults.get(key), 0, world - 1, nullable=True)
    for rank, step, what in (("crash_rank", "crash_at_step", "crashes"), ("kill_rank", "kill_at_step", "is killed")):
        if faults.get(rank) is not None and faults.get(step) is None and not (
                rank == "kill_rank" and faults.get("kill_at_end")):
            raise ConfigError(f"faults.{rank}: set faults.{step} too (the step >= 1 at which rank "
                              f"{faults.get(rank)} {what}); without it nothing happens")


def _check_search_and_groups(cfg: Any) -> None:
    """``search.*``, and every key of the groups that build an object is an argument of the
    group's ``_target_`` (or easgd-train's own)."""
    from easgd_lightning.cli.search import check_search
    from easgd_lightning.cli.trainer_config import trainer_rule

    try:
        check_search(cfg.get("search"))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for rule in (strategy_rule(cfg), compression_rule(cfg), model_rule(cfg), data_rule(cfg), trainer_rule()):
        check_group(cfg, rule)


def _check_threads_and_logger(cfg: Any) -> None:
    """``threads_per_process`` (an integer >= 1 or null) and ``logger.name``."""
    with config_errors():
        check_int("threads_per_process", cfg.get("threads_per_process"), 1, nullable=True)
    logger = cfg.logger.get("name")
    if logger not in LOGGERS:
        raise ConfigError(f"logger.name={logger!r} is unknown; choose one of {', '.join(LOGGERS)}")


def _check_optimizer_lr(cfg: Any, world: int) -> None:
    """The strategy's options with ``optim.lr`` (class method ``check_optimizer_lr``: where
    alpha = lr * rho, class attribute ``alpha_from_lr``)."""
    check = getattr(strategy_class(cfg), "check_optimizer_lr", None)
    if check is None:
        return
    try:
        check(cfg.strategy, world, cfg.optim.lr)
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _check_module(cfg: Any, strategy: Any, module: Any) -> None:
    """The module the strategy would train (on the meta device): its features, and the
    strategy's own rules (``validate_module``)."""
    check_module_features(cfg, module)
    if module is not None and hasattr(strategy, "validate_module"):
        try:
            strategy.validate_module(module)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def _warn_once(cfg: Any, module: Any) -> None:
    """The warnings of a config that runs but wastes its effort: a compressor that never
    engages (once per run), more threads than cores (once per node)."""
    if compresses(cfg):
        warning = idle_compression_warning(cfg, module)
        if warning and os.environ.get("RANK", "0") == "0":  # once per run, not once per rank
            log.warning(warning)
    warning = threads_warning(cfg)
    if warning and os.environ.get("LOCAL_RANK", "0") == "0":  # once per node
        log.warning(warning)
