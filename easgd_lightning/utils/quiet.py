"""Third-party messages a user cannot act on, filtered narrowly: each by its exact text.

* torch's pytree deprecation that Lightning's own ``_pytree`` helper triggers on every
  step's output (``isinstance(treespec, LeafSpec)`` is deprecated): Lightning's to fix;
* Lightning's advice at ``trainer.validate()`` with several devices (use one device to
  evaluate each sample once): the run's final validation repeats the validation of fit on
  the same shards, deliberately, so the advice does not apply;
* Lightning's tip to install ``litlogger`` (an INFO record on every Trainer).

Our own warnings are never filtered; everything else Lightning, torch and wandb say is
shown as before.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_third_party"]

_WARNINGS = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"Using `DistributedSampler` with the dataloaders\. During `trainer\.validate\(\)`",
)
_TIP = "💡 Tip: For seamless cloud logging and experiment tracking"


class _DropTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(_TIP)


def quiet_third_party() -> None:
    """Install the filters of the module docstring in this process (idempotent)."""
    for message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in ("pytorch_lightning.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, _DropTip) for f in lg.filters):
            lg.addFilter(_DropTip())
