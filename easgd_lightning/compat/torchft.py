"""Every private name of torchft (0.2) the project reads, in one place.

``ft/worker.py`` records, per quorum, its id and the workers in it; torchft's ``Manager``
keeps the id in ``_quorum_id`` and hands the quorum's ranks to its reconfigurable process
group, which keeps them in ``_global_ranks`` (ranks from the replica ids' trailing digits:
our replica ids are ``r%05d`` of the worker rank). The lighthouse server class lives in the
compiled ``torchft._torchft`` (what the ``torchft_lighthouse`` command runs).
``tests/unit/test_compat_torchft.py`` checks these against the installed torchft.
"""

from __future__ import annotations

from typing import Any

__all__ = ["quorum_id", "quorum_ranks", "lighthouse_server_class"]


def quorum_id(manager: Any) -> int | None:
    """The id of the manager's current quorum (None before the first)."""
    return getattr(manager, "_quorum_id", None)


def quorum_ranks(manager: Any) -> list[int]:
    """The global ranks of the manager's current quorum (sorted; [] when unknown)."""
    ranks = getattr(getattr(manager, "_pg", None), "_global_ranks", None)
    return sorted(int(r) for r in ranks) if ranks else []


def lighthouse_server_class() -> type:
    """torchft's ``LighthouseServer`` (bind, min_replicas, join_timeout_ms, quorum_tick_ms,
    heartbeat_timeout_ms)."""
    from torchft._torchft import LighthouseServer

    return LighthouseServer
