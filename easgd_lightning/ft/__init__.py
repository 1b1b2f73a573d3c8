"""Fault tolerance over torchft (``ft=torchft``; README "Fault tolerance").

The engine is torchft (github.com/pytorch/torchft, ALGORITHMS.md section 9): a lighthouse
decides, at every exchange, the quorum of replica groups present; a ``Manager`` per replica
group reconfigures the process group to that quorum; a step whose collective failed is not
committed (``Manager.should_commit``); a replica that joins late receives the live state of
a healthy peer (torchft's checkpoint transport), not a checkpoint from disk. Nothing here is
a membership protocol of our own: this package is the glue between torchft and our
launcher and strategies.

* :mod:`.config` -- the ``ft`` group's keys, checked before launch, and what is refused.
* :mod:`.lighthouse` -- the lighthouse process the launcher starts (``ft.lighthouse=null``), and
  the command a user starts before a torchrun launch.
* :mod:`.launch` -- the launcher under ``ft=torchft``: starts the lighthouse and the workers,
  restarts a dead worker (up to ``ft.max_restarts``), writes the ``ft`` part of summary.json;
  for the parameter-server family without a lighthouse (its server re-admits restarted
  workers: ``strategies/ps/rejoin.py``).
* :mod:`.external` -- the same under torchrun (one torchrun per worker, ``ft.replica_id``)
  and SLURM (one task per worker; task 0 serves the lighthouse, each task restarts its worker).
* :mod:`.worker` -- one worker as its own replica group (a one-process Lightning world plus a
  torchft ``Manager``) and the quorum exchange.
* :mod:`.strategies` -- ``local_sgd``, ``sync_easgd``, ``ddp`` and ``diloco`` with their exchange as a quorum step.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FT_NAMES", "ft_name", "enabled"]

#: values of ``ft.name`` (the ``ft`` config group)
FT_NAMES = ("none", "torchft")


def ft_name(cfg: Any) -> str:
    """``cfg.ft.name`` (``none`` when the config has no ``ft`` group)."""
    ft = cfg.get("ft") if hasattr(cfg, "get") else None
    return str((ft or {}).get("name", "none"))


def enabled(cfg: Any) -> bool:
    """Whether ``cfg`` runs under ``ft=torchft``."""
    return ft_name(cfg) == "torchft"
