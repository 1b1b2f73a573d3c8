"""The ``trainer`` config group is the Trainer's own arguments, built with ``_target_``.

Rule (the one of every built group, :mod:`easgd_lightning.cli.targets`): every key of
``trainer`` is an argument of the class named by ``trainer._target_``
(``pytorch_lightning.Trainer`` or a subclass of it; the default when a config has no
``_target_``) and reaches it unchanged through ``hydra.utils.instantiate``. Any other key is
refused before launch with one line naming it and the valid keys. The arguments
easgd-train builds from other config groups (:data:`SET_ELSEWHERE`) are refused too, naming
where they are set.
"""

from __future__ import annotations

from typing import Any

from easgd_lightning.cli.targets import GroupRule, check_group, instantiate_group

__all__ = ["SET_ELSEWHERE", "DEFAULT_TARGET", "check_trainer_keys", "build_trainer", "trainer_rule"]

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


def trainer_rule() -> GroupRule:
    """The ``trainer`` group: a Lightning Trainer (or subclass), no framework keys."""
    import pytorch_lightning as pl

    return GroupRule("trainer", DEFAULT_TARGET, base=pl.Trainer, base_name=DEFAULT_TARGET, elsewhere=SET_ELSEWHERE)


def check_trainer_keys(cfg: Any) -> type:
    """Every key of ``cfg.trainer`` is an argument of its Trainer class.

    Returns:
        The Trainer class (``trainer._target_``).

    Raises:
        ConfigError: ``trainer.KEY: unknown key; did you mean ...? valid keys: ...`` (one line),
            or ``trainer.KEY: easgd-train sets it from ...`` for an argument it builds itself.
    """
    return check_group(cfg, trainer_rule())


def build_trainer(cfg: Any, **built: Any):
    """The Trainer of ``cfg.trainer`` (``hydra.utils.instantiate``), with the arguments
    easgd-train builds itself (``built``: strategy, logger, callbacks, ...) added."""
    return instantiate_group(cfg, trainer_rule(), runtime=_DEFAULTS, **built)
