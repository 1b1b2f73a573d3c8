"""The parameter-server family: a center that workers reach apart from each other.

Layout (imports point down this list, never up):

* ``strategies`` of this family: :mod:`.async_easgd` (Async EASGD / MEASGD / SGD / MSGD)
  and :mod:`.hogwild` (Hogwild EASGD / SGD), on :mod:`.strategy` (``AsyncCenterStrategy``:
  roles, set-up, exchanges, validation and checkpoints on the center, signals);
* :mod:`.transport`: ``CenterTransport``, the one interface a worker reaches the center
  through, implemented by :mod:`.client` (point-to-point to the parameter server) and
  :mod:`.shared` (Hogwild's shared-memory center);
* :mod:`.server`: the parameter server loop (first come, first served);
* :mod:`.protocol`: operation codes, tags and message layouts;
* :mod:`.rules`: the update rules as pure tensor functions.

Heartbeats and the cancellable wait are :mod:`easgd_lightning.comm.liveness`.
"""

from __future__ import annotations

from easgd_lightning.strategies.ps.async_easgd import (
    AsyncEASGDStrategy,
    AsyncMEASGDStrategy,
    AsyncMSGDStrategy,
    AsyncSGDStrategy,
)
from easgd_lightning.strategies.ps.hogwild import HogwildEASGDStrategy, HogwildSGDStrategy
from easgd_lightning.strategies.ps.strategy import AsyncCenterStrategy

__all__ = [
    "AsyncCenterStrategy",
    "AsyncEASGDStrategy",
    "AsyncMEASGDStrategy",
    "AsyncSGDStrategy",
    "AsyncMSGDStrategy",
    "HogwildEASGDStrategy",
    "HogwildSGDStrategy",
]
