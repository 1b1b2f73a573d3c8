"""What the command line knows of each config group, asked of the registries.

The strategy group is read from the strategy registry's entry
(:class:`~easgd_lightning.strategies.registry.StrategySpec`: the class, its Hydra option
name, what it needs before launch); the compression group from the compressor registry
(:mod:`easgd_lightning.hooks.compressors`). No strategy or compression is named here.

The groups that build an object go through one rule, :mod:`easgd_lightning.cli.targets`
(``_target_``, every key an argument of it, ``hydra.utils.instantiate``); the ``*_rule``
functions say what is particular to each group: its default target (by ``name``), the


class the target must be, the keys easgd-train reads itself.
"""

from __future__ import annotations

from typing import Any

from easgd_lightning.cli.targets import GroupRule, target_path
from easgd_lightning.utils.errors import ConfigError

__all__ = [
    "PLAN_KEYS",
    "spec_of",
    "strategy_spec_of",
    "strategy_names",
    "min_world_size",
    "strategies_with",
    "compression_name",
    "compresses",
    "plain",
    "strategy_rule",
    "compression_rule",
    "model_rule",
    "data_rule",
    "shipped_model_targets",
    "own_target",
]


def strategy_names() -> list[str]:
    """The names ``strategy.name`` accepts (the strategy registry's)."""
    from easgd_lightning.strategies.registry import strategy_names as registered

    return registered()


def spec_of(name: Any):
    """The registry entry of ``strategy.name`` (its Hydra option name or its registered
    name; see easgd_lightning.strategies.registry).

    Raises:
        ConfigError: ``strategy.name=...`` is unknown, naming the registered names.
    """
    from easgd_lightning.strategies.registry import config_strategy_spec

    try:
        return config_strategy_spec(name)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def strategy_spec_of(cfg: Any):
    """The registry entry of ``cfg.strategy.name``."""
    return spec_of(cfg.strategy.get("name"))


def strategies_with(attribute: str) -> str:
    """The Hydra names of the strategies whose class sets ``attribute`` (for messages that
    say which strategies a key applies to)."""
    from easgd_lightning.strategies.registry import strategy_specs

    return ", ".join(sorted(s.config_name for s in strategy_specs().values() if getattr(s.cls, attribute, False)))


def min_world_size(name: str) -> int:
    """The fewest processes a strategy needs."""
    return spec_of(name).min_world_size


def compression_name(cfg: Any) -> str:
    """``cfg.compression.name`` (no compression where unset)."""
    from easgd_lightning.hooks.compressors import NO_COMPRESSION

    return cfg.compression.get("name", NO_COMPRESSION)


def compresses(cfg: Any) -> bool:
    """Whether ``cfg.compression`` names a compressor that the attach points apply by the
    ``min_numel`` rule: not no compression, not a pipeline-only codec (registry attribute
    ``pipeline_only``)."""
    from easgd_lightning.hooks.compressors import NO_COMPRESSION, compressor_class

    name = compression_name(cfg)
    if name == NO_COMPRESSION:
        return False
    try:
        return not compressor_class(name).pipeline_only
    except ValueError:
        return False


def plain(d: Any) -> dict:
    """A config node (or mapping, or None) as a plain dict, interpolations resolved."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(d, DictConfig):
        return OmegaConf.to_container(d, resolve=True)  # type: ignore[return-value]
    return dict(d or {})


#: base classes of Lightning's own: their arguments are set by the Trainer, not by strategy.*
_LIGHTNING_MODULES = ("pytorch_lightning.", "lightning.")

#: the compression group's SeCoPa planner keys (easgd-train's own; set on the built compressor)
PLAN_KEYS = ("plan", "replan_steps", "max_partitions")


def strategy_rule(cfg: Any):
    """``strategy``: the class registered as ``strategy.name`` or a subclass; easgd-train
    passes the compressor, the timeout and the class's ``cli_kwargs(cfg)``."""
    from easgd_lightning.strategies.registry import LIGHTNING_OPTIONS

    name = cfg.strategy.get("name")
    cls = spec_of(name).cls
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
    from easgd_lightning.hooks.compressors import compressor_class

    name = compression_name(cfg)
    try:
        cls = compressor_class(name)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return GroupRule("compression", target_path(cls), base=cls,
                     base_note=f" (the class of compression.name={name})", framework=("name", "two_way", *PLAN_KEYS))


def shipped_model_targets() -> dict[str, str]:
    """``model.name`` -> the dotted path of its network factory."""
    from easgd_lightning.models import MODEL_NAMES, model_factory

    return {name: target_path(model_factory(name)) for name in MODEL_NAMES}


def model_rule(cfg: Any):
    """``model``: a callable returning a network (wrapped in ClassifierModule with optim.*)
    or a LightningModule (used as it is); ``builder`` and ``channels_last`` are easgd-train's."""
    default = shipped_model_targets().get(cfg.model.get("name"), "")
    return GroupRule("model", default, framework=("name", "builder", "channels_last"))


def data_rule(cfg: Any):
    """``data``: a LightningDataModule class (the one registered as ``data.name`` by default)."""
    import pytorch_lightning as pl

    from easgd_lightning.data import DATA_NAMES, datamodule_target

    name = cfg.data.get("name")
    default = datamodule_target(name) if name in DATA_NAMES else ""
    return GroupRule("data", default, base=pl.LightningDataModule, framework=("name",))


def own_target(node: Any, shipped: Any) -> bool:
    """``node`` names a ``_target_`` of the user's own (not one of ``shipped``): its ``name``
    is then only a label."""
    target = node.get("_target_")
    return bool(target) and target not in set(shipped)
