"""The ``trainer`` config group is the Trainer's own arguments, built with ``_target_``.

Rule: every key of ``trainer`` is an argument of the class named by ``trainer._target_``
(``pytorch_lightning.Trainer`` or a subclass of it; the default when a config has no
``_target_``) and reaches it unchanged through ``hydra.utils.instantiate``. Any other key is
refused before launch with one line naming it and the valid keys (until this module, the worker passed a
fixed list of keys and silently dropped the rest). The arguments easgd-train builds from
other config groups (:data:`SET_ELSEWHERE`) are refused too, naming where they are set.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from easgd_lightning.cli.build import ConfigError

__all__ = ["SET_ELSEWHERE", "DEFAULT_TARGET", "check_trainer_keys", "build_trainer"]

DEFAULT_TARGET = "pytorch_lightning.Trainer"

#: Trainer arguments easgd-train builds from other config keys: where each one is chosen
SET_ELSEWHERE = {
    "strategy": "strategy=NAME (and compression=NAME)",
    "logger": "logger=wandb|csv|none",
    "callbacks": "easgd-train's own callbacks (checkpoint, faults, metrics)",
    "plugins": "easgd-train's verified checkpoint I/O",
    "enable_checkpointing": "checkpoint.enabled",
    "default_root_dir": "hydra.run.dir=DIR",
}

#: defaults of easgd-train that differ from Lightning's; a trainer key overrides them
_DEFAULTS = {"enable_model_summary": False}


def _trainer_class(target: Any) -> type:
    """The class ``trainer._target_`` names; it must be a Lightning Trainer."""
    import pytorch_lightning as pl
    from hydra.utils import get_class

    try:
        cls = get_class(str(target))
    except Exception as err:
        raise ConfigError(
            f"trainer._target_: cannot import {target!r}; use {DEFAULT_TARGET} or a subclass of it"
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, pl.Trainer)):
        raise ConfigError(f"trainer._target_: {target!r} is no subclass of {DEFAULT_TARGET}")
    return cls


def _arguments(cls: type) -> set[str]:
    """Named arguments of ``cls(...)``: those of each ``__init__`` up the class hierarchy
    until one takes no ``**kwargs`` (a subclass passing the rest on to Trainer)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names |= {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    names.discard("self")
    return names


def check_trainer_keys(cfg: Any) -> type:
    """Every key of ``cfg.trainer`` is an argument of its Trainer class.

    Returns:
        The Trainer class (``trainer._target_``).

    Raises:
        ConfigError: ``trainer.KEY: unknown key; did you mean ...? valid keys: ...`` (one line),
            or ``trainer.KEY: set by ...`` for an argument easgd-train builds itself.
    """
    keys = [str(k) for k in cfg.trainer.keys()]
    cls = _trainer_class(cfg.trainer.get("_target_", DEFAULT_TARGET))
    allowed = _arguments(cls) - set(SET_ELSEWHERE)
    for key in keys:
        if key == "_target_" or key in allowed:
            continue
        if key in SET_ELSEWHERE:
            raise ConfigError(f"trainer.{key}: easgd-train sets it from {SET_ELSEWHERE[key]}; remove it from trainer")
        valid = sorted(allowed)
        match = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f"did you mean trainer.{match[0]}? " if match else ""
        raise ConfigError(
            f"trainer.{key}: unknown key; {hint}valid keys of trainer (arguments of "
            f"{cls.__module__}.{cls.__qualname__}): {', '.join(valid)}"
        )
    return cls


def build_trainer(cfg: Any, **built: Any):
    """The Trainer of ``cfg.trainer`` (``hydra.utils.instantiate``), with the arguments
    easgd-train builds itself (``built``: strategy, logger, callbacks, ...) added."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cls = check_trainer_keys(cfg)
    keys = OmegaConf.to_container(cfg.trainer, resolve=True)
    arguments = {k: v for k, v in keys.items() if k != "_target_"}
    target = f"{cls.__module__}.{cls.__qualname__}"
    return instantiate({"_target_": target, **_DEFAULTS, **arguments}, **built, _convert_="all")
