"""Strategies: one module per family, each a Lightning ``Strategy`` subclass.

Every class registers itself in :mod:`easgd_lightning.strategies.registry` (name, options,
fewest processes) when its module is imported, which this package does.
``register_strategies(registry)`` adds every name to Lightning's ``StrategyRegistry``;
this package calls it when it loads (idempotently), and ``import easgd_lightning`` loads
it as soon as Lightning is imported. Lightning's own ``"ddp"`` stays Lightning's; our
metered, compression-capable DDP is ``"ddp_compressed"``.
"""

from __future__ import annotations

from pytorch_lightning.strategies import StrategyRegistry

from easgd_lightning.strategies.ddp import CompressedDDPStrategy
from easgd_lightning.strategies.diloco import DiLoCoStrategy
from easgd_lightning.strategies.local_sgd import LocalSGDStrategy
from easgd_lightning.strategies.pipeline import Pipeline3DStrategy
from easgd_lightning.strategies.ps import (
    AsyncEASGDStrategy,
    AsyncMEASGDStrategy,
    AsyncMSGDStrategy,
    AsyncSGDStrategy,
    HogwildEASGDStrategy,
    HogwildSGDStrategy,
)
from easgd_lightning.strategies.registry import (
    StrategyProtocol,
    StrategySpec,
    register_strategies,
    strategy_spec,
    strategy_specs,
)
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
    "DiLoCoStrategy",
    "Pipeline3DStrategy",
    "STRATEGY_CLASSES",
    "StrategyProtocol",
    "StrategySpec",
    "register_strategies",
    "strategy_spec",
    "strategy_specs",
]

#: registry name -> class (a view of the registry, for scripts that pick a class by name).
STRATEGY_CLASSES: dict[str, type] = {name: spec.cls for name, spec in strategy_specs().items()}

register_strategies(StrategyRegistry)  # pl.Trainer(strategy="sync_easgd") finds the names
