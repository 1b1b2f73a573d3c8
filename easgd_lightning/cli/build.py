"""Turn a resolved config into objects: strategy, compressor, model, data, logger, callbacks.

Every builder raises ``ConfigError`` naming the config key and the allowed values, so the
parent process can validate a whole config before any worker starts.
"""

from __future__ import annotations

import importlib
from datetime import timedelta
from typing import Any

__all__ = [
    "ConfigError",
    "STRATEGY_NAMES",
    "strategy_names",
    "build_compression",
    "build_strategy",
    "build_model_and_data",
    "build_data",
    "min_world_size",
    "validate_config",
]


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and what is allowed."""


#: Hydra ``strategy.name`` -> (module, class). ``ddp`` selects our metered CompressedDDPStrategy.
STRATEGY_NAMES: dict[str, tuple[str, str]] = {
    "ddp": ("easgd_lightning.strategies.ddp", "CompressedDDPStrategy"),
    "sync_easgd": ("easgd_lightning.strategies.sync_easgd", "SyncEASGDStrategy"),
    "easgd_round_robin": ("easgd_lightning.strategies.round_robin", "RoundRobinEASGDStrategy"),
    "async_easgd": ("easgd_lightning.strategies.async_easgd", "AsyncEASGDStrategy"),
    "async_measgd": ("easgd_lightning.strategies.async_easgd", "AsyncMEASGDStrategy"),
    "async_sgd": ("easgd_lightning.strategies.async_easgd", "AsyncSGDStrategy"),
    "async_msgd": ("easgd_lightning.strategies.async_easgd", "AsyncMSGDStrategy"),
    "hogwild_easgd": ("easgd_lightning.strategies.hogwild", "HogwildEASGDStrategy"),
    "hogwild_sgd": ("easgd_lightning.strategies.hogwild", "HogwildSGDStrategy"),
    "local_sgd": ("easgd_lightning.strategies.local_sgd", "LocalSGDStrategy"),
    "pipeline_3d": ("easgd_lightning.strategies.pipeline", "Pipeline3DStrategy"),
}


def _strategy_available(name: str) -> bool:
    module = STRATEGY_NAMES[name][0]
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name == module:
            return False
        raise
    return True


def strategy_names() -> list[str]:
    """Strategy names whose module is present in this installation."""
    return [n for n in STRATEGY_NAMES if _strategy_available(n)]


def _strategy_class(name: str) -> type:
    if name not in STRATEGY_NAMES or not _strategy_available(name):
        raise ConfigError(
            f"strategy.name={name!r} is unknown; choose one of {', '.join(strategy_names())}"
        )
    module, cls = STRATEGY_NAMES[name]
    return getattr(importlib.import_module(module), cls)


def _plain(d: Any) -> dict:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(d, DictConfig):
        return OmegaConf.to_container(d, resolve=True)  # type: ignore[return-value]
    return dict(d or {})


def build_compression(cfg_compression: Any):
    """The compressor for ``cfg.compression`` (None for ``none``).

    Returns:
        (compressor or None, hook options dict)
    """
    opts = _plain(cfg_compression)
    name = opts.get("name", "none")
    if name == "none":
        return None, {}
    try:
        from easgd_lightning.hooks import build_compressor
    except ImportError as err:  # pragma: no cover - compressors always ship
        raise ConfigError(f"compression.name={name!r}: compressors unavailable ({err})") from err
    try:  # every key of conf/compression/NAME.yaml (min_numel, memory, ...) is a compressor option
        return build_compressor(**opts), {}
    except ValueError as err:
        raise ConfigError(str(err)) from err


def min_world_size(name: str) -> int:
    """The fewest processes a strategy needs."""
    cls = _strategy_class(name)
    return int(getattr(cls, "min_world_size", 1))


def build_strategy(cfg: Any, *, world_size: int | None = None):
    """Instantiate the strategy of ``cfg.strategy`` with the compressor of ``cfg.compression``."""
    opts = _plain(cfg.strategy)
    name = opts.pop("name", None)
    cls = _strategy_class(name)
    compressor, hook_opts = build_compression(cfg.compression)
    kwargs: dict[str, Any] = dict(opts)
    timeout = timedelta(seconds=float(cfg.get("timeout_s", 300)))
    if name == "ddp":
        kwargs["compression"] = compressor
        kwargs["hook_options"] = hook_opts
    else:
        if compressor is not None:
            kwargs["compression"] = compressor
            if hook_opts and getattr(cls, "accepts_hook_options", False):
                kwargs["hook_options"] = hook_opts
        kwargs.update(getattr(cls, "cli_kwargs", lambda c: {})(cfg))
    try:
        strategy = cls(timeout=timeout, **kwargs)
    except TypeError as err:
        raise ConfigError(f"strategy={name}: {err}") from err
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if world_size is not None and hasattr(strategy, "validate_world_size"):
        try:
            strategy.validate_world_size(world_size)
        except ValueError as err:
            raise ConfigError(str(err)) from err
    return strategy


def build_model_and_data(cfg: Any):
    """(LightningModule, LightningDataModule) for ``cfg.model``, ``cfg.data``, ``cfg.optim``."""
    from easgd_lightning.models import ClassifierModule, build_model

    model_opts = _plain(cfg.model)
    model_name = model_opts.pop("name", None)
    builder = model_opts.pop("builder", None)
    channels_last = bool(model_opts.pop("channels_last", False))
    dm = build_data(cfg)
    if builder:  # a module:function returning (LightningModule) for custom model kinds
        mod, fn = builder.split(":")
        return getattr(importlib.import_module(mod), fn)(cfg, dm), dm
    model_kwargs = dict(model_opts)
    model_kwargs.setdefault("num_classes", getattr(dm, "num_classes", 10))
    if model_name == "mlp":
        model_kwargs.setdefault("in_features", getattr(dm, "in_features", 64))
    try:
        net = build_model(model_name, **model_kwargs)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    except TypeError as err:
        raise ConfigError(f"model={model_name}: {err}") from err
    optim = _plain(cfg.optim)
    optim["channels_last"] = channels_last or bool(optim.get("channels_last", False))
    try:
        return ClassifierModule(net, **optim), dm
    except ValueError as err:
        raise ConfigError(str(err)) from err


def build_data(cfg: Any):
    """The LightningDataModule of ``cfg.data`` (constructing it checks paths such as data.root).

    Raises:
        ConfigError: a bad data option, naming its ``data.`` key.
    """
    from easgd_lightning.data import build_datamodule

    data_opts = _plain(cfg.data)
    data_name = data_opts.pop("name", None)
    try:
        return build_datamodule(data_name, **data_opts)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    except TypeError as err:
        raise ConfigError(f"data={data_name}: {err}") from err


def validate_config(cfg: Any) -> None:
    """Check everything that can be checked before processes start.

    Raises:
        ConfigError: with one line naming the key and the allowed values.
    """
    from easgd_lightning.data import DATA_NAMES
    from easgd_lightning.models import MODEL_NAMES

    name = cfg.strategy.get("name")
    _strategy_class(name)
    if cfg.model.get("name") not in MODEL_NAMES and not cfg.model.get("builder"):
        raise ConfigError(
            f"model.name={cfg.model.get('name')!r} is unknown; choose one of {', '.join(MODEL_NAMES)}"
        )
    if cfg.data.get("name") not in DATA_NAMES:
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
    faults = cfg.get("faults", {}) or {}
    for key in ("slow_rank", "crash_rank"):
        r = faults.get(key)
        if r is not None and not (isinstance(r, int) and 0 <= r < world):
            raise ConfigError(f"faults.{key} must be a rank in [0, {world - 1}], got {r!r}")
    if faults.get("crash_rank") is not None and not (
        isinstance(faults.get("crash_at_step"), int) and faults.get("crash_at_step") >= 1
    ):
        raise ConfigError("faults.crash_at_step must be a step >= 1 when faults.crash_rank is set")
    if (faults.get("slow_ms") or 0) < 0:
        raise ConfigError(f"faults.slow_ms must be >= 0, got {faults.get('slow_ms')}")
    build_data(cfg)  # a bad data.root (or other data option) fails here, before any process
    from easgd_lightning.models.classifier import SCHEDULES

    schedule = cfg.optim.get("schedule", "constant")
    if schedule not in SCHEDULES:
        raise ConfigError(f"optim.schedule={schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    threads = cfg.trainer.get("threads_per_process")
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ConfigError(f"trainer.threads_per_process must be a positive integer or null, got {threads!r}")
    logger = cfg.logger.get("name")
    if logger not in ("wandb", "csv", "none"):
        raise ConfigError(f"logger.name={logger!r} is unknown; choose one of wandb, csv, none")
    strategy = build_strategy(cfg, world_size=world)
    if hasattr(strategy, "_validate_world") and name in ("sync_easgd", "easgd_round_robin"):
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
