"""easgd-lightning: communication-efficient distributed training for PyTorch Lightning.

Importing the package registers every strategy name with Lightning's StrategyRegistry, so
``pl.Trainer(strategy="sync_easgd")`` works; Lightning's own ``"ddp"`` is left untouched.
"""

from __future__ import annotations

from pytorch_lightning.strategies import StrategyRegistry

from easgd_lightning.strategies import register_strategies

__version__ = "0.1.0"
__all__ = ["__version__"]

register_strategies(StrategyRegistry)
