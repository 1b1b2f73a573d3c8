"""Strategies: one module per family, each a Lightning ``Strategy`` subclass.

``register_strategies(registry)`` adds every name to Lightning's ``StrategyRegistry``;
``import easgd_lightning`` calls it (idempotently).
"""

from __future__ import annotations

from easgd_lightning.strategies.ddp import CompressedDDPStrategy
from easgd_lightning.strategies.round_robin import RoundRobinEASGDStrategy
from easgd_lightning.strategies.sync_easgd import SyncEASGDStrategy

__all__ = [
    "CompressedDDPStrategy",
    "SyncEASGDStrategy",
    "RoundRobinEASGDStrategy",
    "STRATEGY_CLASSES",
    "register_strategies",
]

#: registry name -> class. Lightning's own "ddp" stays Lightning's; ours is "ddp_compressed".
STRATEGY_CLASSES: dict[str, type] = {
    "ddp_compressed": CompressedDDPStrategy,
    "sync_easgd": SyncEASGDStrategy,
    "easgd_round_robin": RoundRobinEASGDStrategy,
}

_DESCRIPTIONS = {
    "ddp_compressed": "DDP with metered (optionally compressed) gradient all-reduce",
    "sync_easgd": "Synchronous elastic averaging SGD, one all-reduce per exchange",
    "easgd_round_robin": "Original EASGD: the master serves workers in rank order",
}


def _optional_strategies() -> None:
    """Strategies from other modules register themselves here when present."""
    import importlib

    for module, names in (
        ("easgd_lightning.strategies.async_easgd", None),
        ("easgd_lightning.strategies.hogwild", None),
        ("easgd_lightning.strategies.local_sgd", None),
        ("easgd_lightning.strategies.pipeline", None),
    ):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
            continue
        for name, cls in getattr(mod, "STRATEGIES", {}).items():
            STRATEGY_CLASSES.setdefault(name, cls)
            _DESCRIPTIONS.setdefault(name, (cls.__doc__ or name).strip().splitlines()[0])


def register_strategies(registry) -> None:
    """Register every strategy name with ``registry`` (skips names already present)."""
    _optional_strategies()
    for name, cls in STRATEGY_CLASSES.items():
        if name not in registry:
            registry.register(name, cls, description=_DESCRIPTIONS.get(name, name))
