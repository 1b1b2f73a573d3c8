"""One name per concept: the config keys renamed in 0.2, and their old spellings.

An old spelling still works for one release, with a one-line ``FutureWarning`` naming
``old -> new``: on the command line (``strategy.period=8``), in a config file of one's own
(a recipe or ``strategy/NAME.yaml`` setting ``period: 8``) and as a keyword of the strategy
or compressor class (``LocalSGDStrategy(period=8)``, ``build_compressor("lgc",
warmup_steps=8)``). The run is the same as with the new spelling. The README's "Renamed
config keys" table lists the same mapping.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

__all__ = ["Rename", "RENAMES", "renamed_key", "rename_override_line", "apply_renames", "renamed_kwargs", "accepts_renamed"]


@dataclass(frozen=True)
class Rename:
    """``old`` (a dotted key) is now ``new``; ``strategy`` / ``compression``: only under
    that ``strategy.name`` / ``compression.name``, else all."""

    old: str
    new: str
    strategy: str | None = None
    why: str = ""
    compression: str | None = None


RENAMES: tuple[Rename, ...] = (
    Rename("strategy.period", "strategy.tau", "local_sgd",
           "the communication period in local steps is tau in every strategy"),
    Rename("strategy.period_rule", "strategy.tau_rule", "local_sgd", "the rule that sets tau"),
    Rename("strategy.h_base", "strategy.tau_base", "local_sgd", "QSR's smallest tau"),
    Rename("strategy.gamma", "strategy.qsr_coefficient", "local_sgd",
           "optim.gamma is the learning-rate decay factor"),
    Rename("strategy.warmup_steps", "strategy.qsr_warmup_steps", "local_sgd",
           "optim.warmup_steps is the learning-rate warm-up"),
    Rename("strategy.overlap", "strategy.cocod", "local_sgd",
           "CoCoD-SGD changes the update; strategy.overlap only hides communication"),
    Rename("data.synthetic_train_size", "data.train_size", None,
           "the same count is data.train_size under data=synthetic"),
    Rename("data.synthetic_val_size", "data.val_size", None,
           "the same count is data.val_size under data=synthetic"),
    Rename("trainer.threads_per_process", "threads_per_process", None,
           "it is no argument of the Trainer"),
    Rename("trainer.allow_nonfinite_loss", "allow_nonfinite_loss", None,
           "it is no argument of the Trainer"),
    Rename("compression.warmup_steps", "compression.coder_warmup_steps", None,
           "optim.warmup_steps is the learning-rate warm-up; these are LGC's top-k steps "
           "before each training of its coder", compression="lgc"),
)


def _applies(rename: Rename, strategy: Any, compression: Any = None) -> bool:
    return (rename.strategy is None or rename.strategy == strategy) and (
        rename.compression is None or rename.compression == compression
    )


def renamed_key(key: str, strategy: Any, compression: Any = None) -> Rename | None:
    """The rename of the dotted ``key`` under ``strategy`` and ``compression`` (the
    ``name`` of each group; None when ``key`` is current)."""
    for rename in RENAMES:
        if rename.old == key and _applies(rename, strategy, compression):
            return rename
    return None


def _warn(old: str, new: str, why: str) -> None:
    warnings.warn(f"{old} is deprecated, use {new} ({why}); the old name goes in the next release",
                  FutureWarning, stacklevel=3)


def rename_override_line(line: str, key: str, strategy: Any, compression: Any = None) -> str:
    """The command-line override ``line`` (whose key is ``key``) under its new key, with a
    warning, or ``line`` itself when its key is current."""
    rename = renamed_key(key, strategy, compression)
    if rename is None:
        return line
    _warn(rename.old, rename.new, rename.why)
    at = line.index(rename.old)
    return line[:at] + rename.new + line[at + len(rename.old):]


def apply_renames(cfg: DictConfig) -> DictConfig:
    """Move every old key of the composed ``cfg`` to its new key, in place (a warning each);
    the old key's value wins over the new key's default."""
    strategy = OmegaConf.select(cfg, "strategy.name", default=None)
    compression = OmegaConf.select(cfg, "compression.name", default=None)
    for rename in RENAMES:
        if not _applies(rename, strategy, compression):
            continue
        parent, _, old_leaf = rename.old.rpartition(".")
        node = OmegaConf.select(cfg, parent, default=None) if parent else cfg
        if not isinstance(node, DictConfig) or old_leaf not in node:
            continue
        _warn(rename.old, rename.new, rename.why)
        new_parent, _, new_leaf = rename.new.rpartition(".")
        target = OmegaConf.select(cfg, new_parent, default=None) if new_parent else cfg
        with open_dict(cfg), open_dict(node), open_dict(target):
            target[new_leaf] = node[old_leaf]
            del node[old_leaf]
    return cfg


def renamed_kwargs(kwargs: dict[str, Any], name: str, group: str = "strategy") -> dict[str, Any]:
    """``kwargs`` of the class of ``group`` ``name`` (``strategy`` or ``compression``) with
    its old option names replaced by the new ones (a warning each). A new name given too
    wins nothing: both is an error.

    Raises:
        TypeError: an option given under both its old and its new name.
    """
    out = dict(kwargs)
    for rename in RENAMES:
        if getattr(rename, group) != name or not rename.old.startswith(f"{group}."):
            continue
        old, new = rename.old.split(".", 1)[1], rename.new.split(".", 1)[1]
        if old not in out:
            continue
        if new in out:
            raise TypeError(f"{group}.{old} and {group}.{new} are the same option; give only {new}")
        _warn(rename.old, rename.new, rename.why)
        out[new] = out.pop(old)
    return out


def accepts_renamed(name: str, group: str = "strategy"):
    """Decorate the ``__init__`` of the class of ``group`` ``name`` (a strategy or a
    compressor) so that its old option names still work (warned)."""

    def wrap(init):
        @functools.wraps(init)
        def init_renamed(self, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **renamed_kwargs(kwargs, name, group))

        return init_renamed

    return wrap
