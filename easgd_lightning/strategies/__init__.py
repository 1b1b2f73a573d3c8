"""Strategies: one module per family, each a Lightning ``Strategy`` subclass.

``register_strategies(registry)`` adds every name to Lightning's ``StrategyRegistry``;
``import easgd_lightning`` calls it (idempotently). Lightning's own ``"ddp"`` stays
Lightning's; our metered, compression-capable DDP is ``"ddp_compressed"``.
"""

from __future__ import annotations

from easgd_lightning.strategies.async_easgd import STRATEGIES as _ASYNC
from easgd_lightning.strategies.async_easgd import (
    AsyncEASGDStrategy,
    AsyncMEASGDStrategy,
    AsyncMSGDStrategy,
    AsyncSGDStrategy,
)
from easgd_lightning.strategies.ddp import CompressedDDPStrategy
from easgd_lightning.strategies.hogwild import STRATEGIES as _HOGWILD
from easgd_lightning.strategies.hogwild import HogwildEASGDStrategy, HogwildSGDStrategy
from easgd_lightning.strategies.local_sgd import STRATEGIES as _LOCAL
from easgd_lightning.strategies.local_sgd import LocalSGDStrategy
from easgd_lightning.strategies.pipeline import STRATEGIES as _PIPELINE
from easgd_lightning.strategies.pipeline import Pipeline3DStrategy
from easgd_lightning.strategies.round_robin import RoundRobinEASGDStrategy
from easgd_lightning.strategies.sync_easgd import SyncEASGDStrategy

__all__ = [
    "CompressedDDPStrategy",
    "SyncEASGDStrategy",
    "RoundRobinEASGDStrategy",
    "AsyncEASGDStrategy",
    "AsyncMEASGDStrategy",
    "AsyncSGDStrategy",
    "AsyncMSGDStrategy",
    "HogwildEASGDStrategy",
    "HogwildSGDStrategy",
    "LocalSGDStrategy",
    "Pipeline3DStrategy",
    "STRATEGY_CLASSES",
    "register_strategies",
]

#: registry name -> class.
STRATEGY_CLASSES: dict[str, type] = {
    "ddp_compressed": CompressedDDPStrategy,
    "sync_easgd": SyncEASGDStrategy,
    "easgd_round_robin": RoundRobinEASGDStrategy,
    **_ASYNC,
    **_HOGWILD,
    **_LOCAL,
    **_PIPELINE,
}


def _description(cls: type) -> str:
    doc = (cls.__doc__ or cls.__name__).strip().splitlines()
    return doc[0] if doc else cls.__name__


def register_strategies(registry) -> None:
    """Register every strategy name with ``registry`` (skips names already present)."""
    for name, cls in STRATEGY_CLASSES.items():
        if name not in registry:
            registry.register(name, cls, description=_description(cls))
