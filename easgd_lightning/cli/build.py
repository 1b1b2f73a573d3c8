"""Turn a resolved config into objects: strategy, compressor, comm layout, model, data.

Every builder raises ``ConfigError`` naming the config key and the allowed values. The
strategy and the compressor are those the registries give for ``strategy.name`` and
``compression.name`` (:mod:`easgd_lightning.cli.rules`); what a strategy takes from the
rest of the config it says itself (class attributes ``hierarchical``, ``switch_allreduce``,
``gradient_hook``, classmethod ``cli_kwargs``).
"""

from __future__ import annotations

import importlib
import logging
from datetime import timedelta
from typing import Any

from easgd_lightning.cli.rules import (
    PLAN_KEYS,
    compression_name,
    compression_rule,
    data_rule,
    min_world_size,
    model_rule,
    plain,
    strategies_with,
    strategy_names,
    strategy_rule,
)
from easgd_lightning.cli.targets import check_group, instantiate_group
from easgd_lightning.utils.checks import check_bool
from easgd_lightning.utils.errors import ConfigError, config_errors

log = logging.getLogger("easgd_lightning")

__all__ = [
    "ConfigError",
    "strategy_names",
    "min_world_size",
    "build_compression",
    "build_strategy",
    "build_comm",
    "build_model_and_data",
    "build_module",
    "build_data",
    "strategy_class",
]


def _instantiate(cfg: Any, rule: Any, **kwargs: Any):
    """``instantiate_group``, a constructor's ValueError (a key out of range, named) or
    TypeError as a ConfigError."""
    try:
        return instantiate_group(cfg, rule, **kwargs)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    except TypeError as err:
        raise ConfigError(f"{rule.group}={cfg[rule.group].get('name')}: {err}") from err


def build_compression(cfg: Any):
    """The compressor of ``cfg.compression`` (None for ``none``)."""
    from easgd_lightning.hooks.compressors import NO_COMPRESSION
    from easgd_lightning.hooks.compressors.two_way import TwoWayCompressor
    from easgd_lightning.hooks.planner import NO_PLAN, check_plan_options

    rule = compression_rule(cfg)
    plan = {key: cfg.compression.get(key, default) for key, default in zip(PLAN_KEYS, (NO_PLAN, 0, 8))}
    with config_errors():
        two_way = check_bool("compression.two_way", cfg.compression.get("two_way", False))
        check_plan_options(**plan)
    if check_group(cfg, rule) is rule.base and compression_name(cfg) == NO_COMPRESSION:
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

    opts = plain(cfg.get("comm") if hasattr(cfg, "get") else None)
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
    """Whether the strategy class reads the ``comm`` group (a ``comm`` constructor argument;
    class attribute ``hierarchical = True``)."""
    return bool(getattr(cls, "hierarchical", False))


def _plans_compression(cls: type) -> bool:
    """Whether the strategy class runs the SeCoPa planner (``compression.plan``): a strategy
    whose compressor runs in the DDP gradient hook (class attribute ``gradient_hook``)."""
    return bool(getattr(cls, "gradient_hook", False))


def strategy_class(cfg: Any) -> type:
    """The strategy class ``cfg.strategy`` builds (``_target_``; keys checked)."""
    return check_group(cfg, strategy_rule(cfg))


def _check_comm_and_plan(cfg: Any, cls: type, layout: Any) -> None:
    """``comm.allreduce`` other than ring needs a strategy that sums dense buckets through it
    (class attribute ``switch_allreduce``); ``compression.plan`` one whose compressor runs in
    the DDP gradient hook (``gradient_hook``): the planner lives there only."""
    from easgd_lightning.hooks.planner import NO_PLAN

    name = cfg.strategy.get("name")
    if layout.allreduce != "ring" and not getattr(cls, "switch_allreduce", False):
        raise ConfigError(f"comm.allreduce: {layout.allreduce} sums strategy={strategies_with('switch_allreduce')}'s "
                          f"dense gradient buckets only, not strategy={name}")
    plan = cfg.compression.get("plan", NO_PLAN)
    if plan != NO_PLAN and not _plans_compression(cls):
        raise ConfigError(f"compression.plan: {plan} plans strategy={strategies_with('gradient_hook')}'s compressed "
                          f"gradient buckets only, not strategy={name}; there it must be {NO_PLAN}")


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
    _check_comm_and_plan(cfg, cls, layout)
    if _takes_comm(cls):
        built["comm"] = layout
    elif layout.hierarchy != "flat":  # a recipe's comm.* in a strategy sweep: not an error
        log.warning("comm.hierarchy=%s does not apply to strategy=%s (%s read the comm group): it reduces as it "
                    "always does", layout.hierarchy, cfg.strategy.get("name"), strategies_with("hierarchical"))
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

    from easgd_lightning.models import ClassifierModule

    rule = model_rule(cfg)
    builder = cfg.model.get("builder")
    if builder:  # a module:function returning (LightningModule) for custom model kinds
        check_group(cfg, rule)
        mod, fn = builder.split(":")
        return getattr(importlib.import_module(mod), fn)(cfg, dm)
    optim = plain(cfg.optim)
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
