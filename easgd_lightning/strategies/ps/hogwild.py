"""Hogwild EASGD and Hogwild SGD: lock-free updates of one shared center / model.

Rules (You, Buluc, Demmel, SC17, after Zhang, Choromanska, LeCun, NeurIPS 2015 and Recht et
al.'s Hogwild!, NeurIPS 2011):

* ``hogwild_easgd``: Async EASGD without the lock around the master update. Every ``tau``
  local steps worker i reads the shared center c (while others may be writing it), forms
  ``d = alpha (x_i - c)``, adds d to c in place with no lock, and sets
  ``x_i <- opt_step(x_i, g_i) - d``. Concurrent elastic terms may race; that is the point.
  Default beta = p * alpha = 0.9 over the p workers, tau = 1.
* ``hogwild_sgd``: the lock-free SGD baseline. Every step worker i computes g at its copy w_i
  of the shared weights w, takes its own optimizer's step from w_i (the user's optimizer:
  its groups, learning rates, weight decay and state, kept per worker), adds that
  displacement to the shared w in place with no lock, and reads w back for its next
  gradient. With plain SGD that is ``w <- w - eta (g + wd w_i)``. Parameters without a
  gradient (frozen) are not touched. ``momentum`` > 0 sets SGD's heavy-ball momentum (per
  worker buffer; torch.optim.SGD only); ``lr`` replaces every group's learning rate.

Where the shared variable lives (``strategy.server``):

* ``null`` (default), one node: a ``torch`` tensor mapped from one file (``torch.from_file``
  with ``shared=True``, in ``/dev/shm`` unless ``shm_dir``), so every worker process of the
  node reads and writes the same memory (:mod:`easgd_lightning.strategies.ps.shared`):
  rank 0 creates the file, every rank maps it after a barrier, and rank 0 unlinks it after
  a second barrier (the mappings stay valid, nothing is left behind even after a crash).
  Every rank trains; there is no server. Traffic is metered as ``kind="shared_memory"``.
* ``"dedicated"``: required across nodes (shared memory does not span machines): the
  parameter server of :mod:`easgd_lightning.strategies.ps.server` (last rank, FCFS), but
  the server applies the updates on a thread pool without a lock, concurrently with each
  other and with the reads that build the replies. Asking for several nodes
  (``trainer.num_nodes > 1``) without it is refused with an error naming ``strategy.server``.

Everything else is the asynchronous machinery of ``async_easgd``: no collectives after set-up,
``stop_policy``/``max_time_s`` stopping, heartbeats through the rendezvous store so the end of
fit waits for every worker that is done *or dead* (never for a dead one), validation and
checkpoints on the shared center (rank 0 writes ``center.ckpt`` every
``checkpoint_every_s`` and at the end, atomically).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from easgd_lightning.comm import ops
from easgd_lightning.strategies.ps.shared import (
    SharedCenter,
    SharedMemoryTransport,
    default_shm_dir,
)
from easgd_lightning.strategies.ps.strategy import AsyncCenterStrategy
from easgd_lightning.strategies.registry import register_strategy

__all__ = ["HogwildEASGDStrategy", "HogwildSGDStrategy"]


class _HogwildMixin:
    """Shared-memory mode of the Hogwild strategies (server mode is the async machinery)."""

    lockfree = True
    min_world_size = 2
    fabric_refusal = (
        "its workers update a shared center without collectives and stop by stop_policy / "
        "max_time_s, the end of fit waiting for every worker done or dead: the Trainer's fit loop"
    )

    def _init_hogwild(self, shm_dir: str | None) -> None:
        self._shm_dir = shm_dir
        self._shared: SharedCenter | None = None
        if not self.uses_server:
            self.comm_kind = "shared_memory"

    def _check_nodes(self, num_nodes: int | None) -> None:
        if num_nodes is not None and num_nodes > 1 and not self.uses_server:
            raise ValueError(
                f"strategy.server: {self.strategy_name} across {num_nodes} nodes (trainer.num_nodes="
                f"{num_nodes}) needs a parameter server, because shared memory only spans one node; "
                "set strategy.server=dedicated"
            )

    def _spans_nodes(self) -> bool:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        return self.num_nodes > 1 or (local is not None and int(local) < self.world_size)

    def _make_transport(self, trainer, token: int) -> None:
        if self.uses_server:
            return super()._make_transport(trainer, token)
        if self._spans_nodes():
            self._check_nodes(max(self.num_nodes, 2))
        shm_dir = Path(self._shm_dir or default_shm_dir())
        path = shm_dir / f"easgd-{self.strategy_name}-{token}.bin"
        n = self._center.numel()
        if self.global_rank == 0:
            shm_dir.mkdir(parents=True, exist_ok=True)
            shared = SharedCenter(path, n, self._center.dtype)
            shared.center.copy_(self._center)
            shared.flag.zero_()
        ops.barrier(kind="setup")
        if self.global_rank != 0:
            shared = SharedCenter(path, n, self._center.dtype)
        ops.barrier(kind="setup")
        if self.global_rank == 0:
            shared.unlink()
        self._shared = shared
        self._transport = SharedMemoryTransport(
            shared,
            rank=self.global_rank,
            world=self.world_size,
            alpha=self._alpha or 0.0,
            n_params=self._n_params,
            liveness=self._liveness,
            stop_policy=self.stop_policy,
            interrupted=self._interrupted_by,
        )

    @property
    def _writes_center(self) -> bool:
        return not self.uses_server and self.global_rank == 0

    def _after_step(self) -> None:
        super()._after_step()
        every = self.checkpoint_every_s
        if self._writes_center and every is not None and self._center_ckpt_file is not None:
            now = time.monotonic()
            if now - self._last_center_ckpt >= every:
                self._last_center_ckpt = now
                self._write_center_checkpoint({"center": self._shared.center.clone()})

    def on_train_end(self) -> None:
        super().on_train_end()
        if self._writes_center and self._center_ckpt_file is not None and self._center is not None:
            self._write_center_checkpoint({"center": self._center.detach().cpu().clone()})

    def summary_extras(self) -> dict:
        extras = super().summary_extras()
        extras["shared_memory"] = not self.uses_server
        dead = self._transport.dead if self._transport is not None else None
        if dead is not None:
            extras["dead_workers"] = dead
        return extras


_COMMON = ("server", "shm_dir", "stop_policy", "max_time_s", "worker_timeout_s", "heartbeat_s",
           "checkpoint_every_s", "checkpoint_path")


@register_strategy("hogwild_easgd")
class HogwildEASGDStrategy(_HogwildMixin, AsyncCenterStrategy):
    """Hogwild EASGD: elastic exchanges with a lock-free shared center (``strategy="hogwild_easgd"``).

    Args:
        tau: communication period in local steps (>= 1).
        alpha: moving rate in (0, 1); or ``beta`` (= p * alpha) or ``rho``. Default beta = 0.9.
        server: null (shared memory, one node) or ``"dedicated"`` (lock-free parameter server).
        shm_dir: where the shared file is created (default ``/dev/shm``).
        stop_policy, max_time_s, worker_timeout_s, checkpoint_every_s: as ``async_easgd``.
    """

    strategy_name = "hogwild_easgd"
    _OPTIONS = ("tau", "alpha", "beta", "rho", "overlap", *_COMMON)

    def __init__(self, tau: int = 1, alpha: float | None = None, beta: float | None = None,
                 rho: float | None = None, server: str | None = None, shm_dir: str | None = None,
                 **kwargs: Any) -> None:
        self._reject_unknown(kwargs)
        self.server = server  # _check_nodes (called by the base) needs it
        super().__init__(tau=tau, alpha=alpha, beta=beta, rho=rho, server=server, **kwargs)
        self._init_hogwild(shm_dir)


@register_strategy("hogwild_sgd")
class HogwildSGDStrategy(_HogwildMixin, AsyncCenterStrategy):
    """Hogwild SGD: lock-free gradient steps on shared weights (``strategy="hogwild_sgd"``).

    Args:
        lr: learning rate of every param group (null: each group's own, schedules applied).
        momentum: heavy-ball momentum in [0, 1) set on the workers' SGD (per-worker buffers;
            default 0: the optimizer's own settings, as configured).
        server, shm_dir, stop_policy, ...: as :class:`HogwildEASGDStrategy`.
    """

    strategy_name = "hogwild_sgd"
    rule = "sgd"
    server_momentum = True
    _OPTIONS = ("lr", "momentum", *_COMMON)

    def __init__(self, lr: float | None = None, momentum: float = 0.0, server: str | None = None,
                 shm_dir: str | None = None, **kwargs: Any) -> None:
        self._reject_unknown(kwargs)
        self.server = server
        super().__init__(lr=lr, momentum=momentum, server=server, **kwargs)
        self._init_hogwild(shm_dir)
