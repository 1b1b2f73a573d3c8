"""The one registry of strategies: name, class, fewest processes, options.

Each strategy class registers itself with :func:`register_strategy` (the decorator on its
class). Everything that needs to know the strategies reads this registry: the CLI (the
names ``strategy.name`` accepts, the minimum world size checked before launch, the options
``strategy.*`` may set), and Lightning's ``StrategyRegistry`` through
:func:`register_strategies` (the pattern of Lightning's own ``register_strategies``), so
``pl.Trainer(strategy="sync_easgd")`` works.

:class:`StrategyProtocol` is what the CLI and the run summary read from a strategy object.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

__all__ = [
    "StrategySpec",
    "StrategyProtocol",
    "register_strategy",
    "config_strategy_spec",
    "strategy_modules",
    "strategy_spec",
    "strategy_specs",
    "strategy_names",
    "check_options",
    "LIGHTNING_OPTIONS",
    "reject_unknown_kwargs",
    "register_strategies",
]

T = TypeVar("T", bound=type)


@dataclass(frozen=True)
class StrategySpec:
    """One registered strategy.

    Attributes:
        name: ``strategy.name`` in the config, ``pl.Trainer(strategy=name)`` in Python.
        cls: the Lightning ``Strategy`` subclass.
        options: the keys ``strategy.*`` may set (the keyword arguments of ``cls`` that a
            config gives; ``name`` aside).
        min_world_size: the fewest processes the strategy runs with.
        description: the first line of the class docstring.
        config_name: the Hydra option (``conf/strategy/<config_name>.yaml``) and the
            ``strategy.name`` it sets, where it differs from ``name`` (class attribute
            ``config_name``; Lightning's own ``ddp`` keeps its name, ours is ``ddp_compressed``).
        module_method: ``(method, what it is, the fix)``: a LightningModule method the
            strategy needs (class attribute ``module_method``; None: none), refused before
            launch for a model without it.
        required_precision: ``(trainer.precision, its short name)``: the one precision it
            runs in (class attribute ``required_precision``; None: any).
        checkpoint_index: the file that makes a checkpoint directory complete, for a
            strategy that checkpoints a directory of shards (class attribute
            ``checkpoint_index``; None: one Lightning checkpoint file).
        preload: modules the launcher's fork server imports once before forking the ranks
            (class attribute ``preload_modules``; e.g. DeepSpeed's).
    """

    name: str
    cls: type
    options: tuple[str, ...]
    min_world_size: int
    description: str
    config_name: str = ""
    module_method: tuple[str, str, str] | None = None
    required_precision: tuple[str, str] | None = None
    checkpoint_index: str | None = None
    preload: tuple[str, ...] = ()


@runtime_checkable
class StrategyProtocol(Protocol):
    """What the CLI and ``summary.json`` read from every registered strategy."""

    #: the registry name (``strategy.name``)
    strategy_name: str
    #: the fewest processes (checked before launch)
    min_world_size: int

    @property
    def local_steps(self) -> int:
        """Optimizer steps this rank has taken (``summary.json``: ``steps``)."""
        ...

    def summary_extras(self) -> dict:
        """Strategy-specific fields of this rank for ``summary.json`` (``extras``)."""
        ...

    def validate_world_size(self, world_size: int) -> None:
        """Raise ValueError (one line naming the key) when ``world_size`` processes cannot run
        this strategy as configured; called before launch."""
        ...


_SPECS: dict[str, StrategySpec] = {}

#: keys of Lightning's DDPStrategy that every strategy takes from ``strategy.*`` too (the
#: imagenet recipes choose the backend: gloo, mpi, or null for NCCL on CUDA)
LIGHTNING_OPTIONS = ("process_group_backend",)


def _first_doc_line(cls: type) -> str:
    lines = (cls.__doc__ or cls.__name__).strip().splitlines()
    return lines[0] if lines else cls.__name__


def register_strategy(name: str, *, options: Iterable[str] | None = None) -> Callable[[T], T]:
    """Class decorator: register ``cls`` as ``name`` with its ``strategy.*`` options (default:
    the class's ``_OPTIONS``).

    The class's ``strategy_name`` becomes ``name`` and its ``min_world_size`` (default 1)
    is recorded. Registering another class under a taken name is an error.
    """
    def decorate(cls: T) -> T:
        keys = tuple(options if options is not None else cls._OPTIONS)
        held = _SPECS.get(name)
        if held is not None and held.cls is not cls and held.cls.__qualname__ != cls.__qualname__:
            raise ValueError(f"strategy name {name!r} is registered already, by {held.cls.__qualname__}")
        cls.strategy_name = name
        # Lightning's pattern: the class adds itself to a StrategyRegistry. This replaces the
        # method inherited from DDPStrategy, which would register Lightning's "ddp" names.
        cls.register_strategies = classmethod(_register_self)
        _SPECS[name] = StrategySpec(
            name=name,
            cls=cls,
            options=keys,
            min_world_size=int(getattr(cls, "min_world_size", 1)),
            description=_first_doc_line(cls),
            config_name=getattr(cls, "config_name", None) or name,
            module_method=getattr(cls, "module_method", None),
            required_precision=getattr(cls, "required_precision", None),
            checkpoint_index=getattr(cls, "checkpoint_index", None),
            preload=tuple(getattr(cls, "preload_modules", ())),
        )
        return cls

    return decorate


def _register_self(cls: type, registry: Any) -> None:
    """``cls.register_strategies(registry)``: add ``cls`` under its own name (skipped when the
    name is taken, e.g. by Lightning's own)."""
    if cls.strategy_name not in registry:
        registry.register(cls.strategy_name, cls, description=_first_doc_line(cls))


def strategy_modules() -> list[str]:
    """The modules of the strategies package, by their files (``strategies/*.py`` and its
    subpackages): where a strategy class registers itself. A new strategy is a new module
    here; no list names it."""
    import pkgutil
    from pathlib import Path

    here = Path(__file__).parent
    prefix = __name__.rsplit(".", 1)[0] + "."
    return sorted(m.name for m in pkgutil.walk_packages([str(here)], prefix) if m.name != __name__)


def _load() -> None:
    """Import the strategy modules (their decorators fill the registry): found by their files
    (:func:`strategy_modules`), not imported by name, so this module imports no strategy."""
    import importlib

    for name in strategy_modules():
        importlib.import_module(name)


def strategy_specs() -> dict[str, StrategySpec]:
    """Every registered strategy, by name, in alphabetical order."""
    _load()
    return dict(sorted(_SPECS.items()))


def strategy_names() -> list[str]:
    """The names ``strategy.name`` accepts."""
    return list(strategy_specs())


def strategy_spec(name: Any) -> StrategySpec:
    """The registered strategy ``name``.

    Raises:
        ValueError: ``strategy.name=...: unknown; choose one of ...`` (one line).
    """
    specs = strategy_specs()
    if name not in specs:
        raise ValueError(f"strategy.name={name!r} is unknown; choose one of {', '.join(specs)}")
    return specs[name]


def config_strategy_spec(name: Any) -> StrategySpec:
    """The strategy a config's ``strategy.name`` names: its Hydra option name
    (:attr:`StrategySpec.config_name`) or its registered name.

    Raises:
        ValueError: ``strategy.name=...: unknown; choose one of ...`` (one line).
    """
    by_config = {spec.config_name: spec for spec in strategy_specs().values()}
    return by_config[name] if name in by_config else strategy_spec(name)


def check_options(name: str, keys: Iterable[str]) -> None:
    """Every key of ``keys`` is an option of strategy ``name``.

    Raises:
        ValueError: ``strategy.KEY is not an option of NAME; its options are: ...``.
    """
    spec = strategy_spec(name)
    unknown = [k for k in keys if k not in spec.options and k not in LIGHTNING_OPTIONS]
    if unknown:
        raise ValueError(
            f"strategy.{sorted(unknown)[0]} is not an option of {name}; its options are: "
            f"{', '.join(spec.options) or '(none)'} (and Lightning's {', '.join(LIGHTNING_OPTIONS)})"
        )


def _keywords(fn: Callable) -> frozenset[str]:
    """The named keyword arguments of ``fn`` (for a class: of its ``__init__``)."""
    params = inspect.signature(fn.__init__ if isinstance(fn, type) else fn).parameters.values()
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self")


def reject_unknown_kwargs(
    strategy: Any, kwargs: dict, *readers: Callable, known: Iterable[str] = ()
) -> None:
    """Refuse keyword arguments that no one in ``readers`` names (the Lightning base class
    the rest goes to, e.g. ``DDPStrategy``; plus ``DistributedDataParallel`` where the model
    is wrapped) and that are not in ``known``, which would otherwise be passed on and never
    read.

    Raises:
        ValueError: ``strategy.KEY is not an option of NAME; its options are: ...``.
    """
    known = frozenset(known).union(*(_keywords(r) for r in readers))
    unknown = sorted(set(kwargs) - known)
    if not unknown:
        return
    name = getattr(strategy, "strategy_name", "") or type(strategy).__name__
    spec = _SPECS.get(name)
    options = (", ".join(spec.options) or "(none)") if spec is not None else "see its docstring"
    raise ValueError(f"strategy.{unknown[0]} is not an option of {name}; its options are: {options}")


def register_strategies(registry: Any) -> None:
    """Add every registered strategy to Lightning's ``registry`` (names already there, such
    as Lightning's own ``ddp``, are left alone)."""
    for spec in strategy_specs().values():
        spec.cls.register_strategies(registry)
