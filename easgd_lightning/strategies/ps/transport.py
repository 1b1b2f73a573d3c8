"""The one interface through which a worker exchanges with the center.

Two implementations:

* :class:`~easgd_lightning.strategies.ps.client.ServerTransport`: point-to-point messages
  (gloo) to the parameter server, which applies every update (``async_*`` and
  ``hogwild_*`` with ``server=dedicated``);
* :class:`~easgd_lightning.strategies.ps.shared.SharedMemoryTransport`: a center mapped
  into every worker process of one node, which each worker updates itself without a lock
  (``hogwild_*`` with ``server=null``).

The strategies of :mod:`easgd_lightning.strategies.ps` hold one ``CenterTransport`` and
call only what it declares here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

__all__ = ["CenterTransport"]


class CenterTransport(ABC):
    """A worker's side of the center: elastic exchanges, SGD pushes, pulls, the end of fit.

    The SGD rule has two forms, chosen by :attr:`steps_locally`: the center steps the
    user's optimizer for a pushed gradient (:meth:`push_gradient`), or the worker steps and
    its displacement is added to the center (:meth:`push_displacement`). A transport
    implements the one its ``steps_locally`` names.
    """

    #: True: the worker's optimizer steps and pushes its displacement; False: the center
    #: steps the user's optimizer for a pushed gradient
    steps_locally: bool = False
    #: the ranks this worker found dead while it waited for the others in :meth:`finish`
    #: (``summary.json``: ``dead_workers``); None when the transport does not watch them
    #: (the parameter server does)
    dead: list[int] | None = None

    @property
    @abstractmethod
    def stop(self) -> bool:
        """Whether the center asked this worker to stop (``stop_policy=first``)."""

    @abstractmethod
    def begin_elastic(self, x: torch.Tensor, step: int, lr: float) -> Any:
        """Start the elastic exchange of ``x`` (the worker's variable at local ``step``);
        returns a handle for :meth:`end_elastic`. The center applies ``c <- c + alpha (x - c)``."""

    @abstractmethod
    def end_elastic(self, handle: Any) -> torch.Tensor:
        """The elastic difference ``d = alpha (x - c)`` of the exchange ``handle`` started."""

    def push_gradient(self, g: torch.Tensor, step: int, extras: list[float]) -> torch.Tensor:
        """(``steps_locally`` False) Push the flat gradient (then the float buffers) and the
        request extras; the center steps the user's optimizer; returns the new weights."""
        raise NotImplementedError(f"{type(self).__name__} steps on the worker: use push_displacement")

    def push_displacement(self, moves: list[torch.Tensor | None], sizes: list[int],
                          buffers: list[torch.Tensor], step: int) -> torch.Tensor:
        """(``steps_locally`` True) Add each parameter's optimizer displacement (None: not
        moved) to the center, overwrite its buffers; returns the new weights."""
        raise NotImplementedError(f"{type(self).__name__} steps at the center: use push_gradient")

    @abstractmethod
    def pull(self, step: int) -> torch.Tensor:
        """The current center (flat)."""

    @abstractmethod
    def pull_state(self, step: int) -> dict:
        """The center (``"center"``, on the CPU) and the center's state for a checkpoint
        (``updates``, ``served``, ``worker_steps``, ``momentum``, ``optimizer``; None where unknown)."""

    @abstractmethod
    def finish(self, step: int) -> torch.Tensor:
        """Say this worker is done; wait (bounded by liveness) for the others; the final center."""

    def close(self) -> None:  # noqa: B027 (optional: most transports hold nothing)
        """Release what the transport holds (nothing by default)."""
