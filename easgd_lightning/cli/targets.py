"""Config groups built from ``_target_`` with ``hydra.utils.instantiate``.

The five groups that build an object (``strategy``, ``compression``, ``model``, ``data``,
``trainer``) follow one rule, written once here:

* ``GROUP._target_`` names the class (or factory function) that builds the group; a user
  may name a subclass of their own. Without ``_target_`` the group's default is used (the
  class registered under ``GROUP.name``; ``pytorch_lightning.Trainer`` for ``trainer``).
* Every other key is an argument of the target's signature (for a class, of each
  ``__init__`` up the hierarchy while it passes ``**kwargs`` on), or one of the few keys
  easgd-train reads itself (``name``, and those a :class:`GroupRule` lists). Any other key
  is refused before launch with one line naming ``GROUP.KEY`` and the valid keys.
* Arguments easgd-train builds from other config groups (a strategy's compressor, the
  Trainer's strategy and callbacks) are passed at build time and refused as config keys,
  naming where they are set. Values from the run (a model's ``num_classes`` from its data
  module) fill arguments the target takes and the config leaves out.

Range and type checks stay where they were: in ``cli/build.py`` and in the classes'
constructors, which run in the launcher too (``validate_config`` builds every group once).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from easgd_lightning.utils.errors import ConfigError

__all__ = ["GroupRule", "target_path", "target_arguments", "check_group", "instantiate_group"]


@dataclass(frozen=True)
class GroupRule:
    """How one config group is checked and built.

    Attributes:
        group: the config group (``strategy``).
        default: the target when the group has no ``_target_`` (a dotted path).
        base: the target must be this class or a subclass of it (None: any callable).
        base_name: how refusals name ``base`` (default: its dotted path).
        base_note: why, appended to the refusal (``the class of strategy.name=sync_easgd``).
        framework: keys easgd-train reads itself; never passed to the target.
        elsewhere: arguments easgd-train passes at build time, with where they are set;
            refused as keys of the group.
        stop_modules: module prefixes of base classes whose arguments are not config keys
            (Lightning's own strategy classes: the Trainer sets their arguments) ...
        passthrough: ... except these.
    """

    group: str
    default: str
    base: type | None = None
    base_name: str = ""
    base_note: str = ""
    framework: tuple[str, ...] = ()
    elsewhere: Mapping[str, str] = field(default_factory=dict)
    stop_modules: tuple[str, ...] = ()
    passthrough: tuple[str, ...] = ()


def target_path(obj: Any) -> str:
    """The dotted path of a class or function (what ``_target_`` holds)."""
    return f"{obj.__module__}.{obj.__qualname__}"


def _node(cfg: Any, group: str) -> Any:
    return cfg.get(group) or {}


def _locate(rule: GroupRule, node: Any) -> Callable:
    """The object ``GROUP._target_`` names, checked against ``rule.base``."""
    from hydra._internal.utils import _locate as locate  # hydra.utils.get_object logs 3 lines first

    target = node.get("_target_") or rule.default
    base = f"{rule.base_name or target_path(rule.base)}{rule.base_note}" if rule.base is not None else ""
    try:
        obj = locate(str(target))
    except Exception as err:
        use = f"; use {base} or a subclass of it" if base else ""
        raise ConfigError(f"{rule.group}._target_: cannot import {target!r}{use}") from err
    if rule.base is not None and not (isinstance(obj, type) and issubclass(obj, rule.base)):
        raise ConfigError(f"{rule.group}._target_: {target!r} is no subclass of {base}")
    if not callable(obj):
        raise ConfigError(f"{rule.group}._target_: {target!r} is not a class or function")
    return obj


def target_arguments(target: Callable, stop_modules: tuple[str, ...] = (), passthrough: tuple[str, ...] = ()) -> set[str]:
    """Named arguments of ``target(...)``: those of a function, or of each ``__init__`` up a
    class hierarchy until one takes no ``**kwargs`` (a subclass passing the rest on). A
    class from ``stop_modules`` ends the walk and contributes only ``passthrough``."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if not isinstance(target, type):
        return {p.name for p in inspect.signature(target).parameters.values() if p.kind in kinds}
    names: set[str] = set()
    for klass in target.__mro__:
        if stop_modules and klass is not target and klass.__module__.startswith(stop_modules):
            names |= set(passthrough)
            break
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names |= {p.name for p in params if p.kind in kinds}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    names.discard("self")
    return names


def check_group(cfg: Any, rule: GroupRule) -> Callable:
    """Every key of ``cfg.<group>`` is an argument of its target or a framework key.

    Returns:
        The target (class or function) ``_target_`` names.

    Raises:
        ConfigError: ``GROUP.KEY: unknown key; did you mean ...? valid keys of GROUP
            (arguments of TARGET): ...`` (one line), or ``GROUP.KEY: easgd-train sets it
            from ...`` for an argument easgd-train builds itself, or a ``GROUP._target_``
            that cannot be imported or is of the wrong kind.
    """
    group, node = rule.group, _node(cfg, rule.group)
    target = _locate(rule, node)
    arguments = target_arguments(target, rule.stop_modules, rule.passthrough) - set(rule.elsewhere)
    allowed = arguments | set(rule.framework)
    for key in (str(k) for k in node.keys()):
        if key == "_target_" or key in allowed:
            continue
        if key in rule.elsewhere:
            raise ConfigError(f"{group}.{key}: easgd-train sets it from {rule.elsewhere[key]}; remove it from {group}")
        valid = sorted(allowed)
        match = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hint = f"did you mean {group}.{match[0]}? " if match else ""
        raise ConfigError(
            f"{group}.{key}: unknown key; {hint}valid keys of {group} (arguments of "
            f"{target_path(target)}{', and ' + ', '.join(rule.framework) if rule.framework else ''}): "
            f"{', '.join(valid)}"
        )
    return target


def instantiate_group(cfg: Any, rule: GroupRule, *, runtime: Mapping[str, Any] | None = None, **built: Any) -> Any:
    """Check ``cfg.<group>`` and build it with ``hydra.utils.instantiate``.

    Args:
        runtime: values from the run that fill the target's arguments the config leaves
            out (only those the target takes), e.g. a model's ``num_classes``.
        **built: arguments easgd-train builds itself (``rule.elsewhere``), always passed.

    Raises:
        ConfigError: a key check of :func:`check_group`. What the target itself raises
            (a ValueError naming a key out of range) is raised unchanged, not wrapped.

    The config's keys go through ``hydra.utils.instantiate`` (``_partial_``: a nested
    ``_target_`` is built too); ``runtime`` and ``built`` objects are passed to the result
    as they are (never copied into the config).
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf import DictConfig, OmegaConf

    target = check_group(cfg, rule)
    node = _node(cfg, rule.group)
    keys = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    arguments = {k: v for k, v in keys.items() if k != "_target_" and k not in rule.framework}
    takes = target_arguments(target, rule.stop_modules, rule.passthrough)
    filled = {k: v for k, v in (runtime or {}).items() if k in takes and k not in arguments}
    try:  # the config's keys (nested _target_ too); the built objects are passed as they are
        factory = instantiate({"_target_": target_path(target), **arguments}, _partial_=True, _convert_="all")
    except InstantiationException as err:  # hydra wraps a nested target's own error: raise that
        cause = err.__cause__
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None
    return factory(**filled, **built)
