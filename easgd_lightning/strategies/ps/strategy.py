"""The machinery every parameter-server strategy shares (:class:`AsyncCenterStrategy`).

The rules of each strategy are in :mod:`easgd_lightning.strategies.ps.rules`; the strategy
classes in :mod:`~easgd_lightning.strategies.ps.async_easgd` and
:mod:`~easgd_lightning.strategies.ps.hogwild`. A worker reaches the center through one
:class:`~easgd_lightning.strategies.ps.transport.CenterTransport` (a parameter server, or
Hogwild's shared memory).

Design decisions (and their trade-offs):

* **Dedicated server rank.** The last global rank (``world_size - 1``) is the parameter
  server and does not train; ranks ``0 .. world_size - 2`` are the workers. So
  ``trainer.devices`` (x ``num_nodes``) is workers + 1, at least 3; ``summary.json``
  shows ``roles`` (``"server"`` for that rank) and ``trained_ranks``. The alternative, a
  thread beside rank 0's worker, would save a process but gloo point-to-point calls from two
  threads of one process on one process group are not safe, and a worker that also serves
  stalls every other worker whenever it computes. The last rank, not rank 0, serves so that
  rank 0 (Lightning's global zero: logger, checkpoint files, ``val_history``) is a worker.
* **Engine: point-to-point on gloo** through :mod:`easgd_lightning.comm.ops` (every byte
  metered, ``kind="parameter_server"``), each worker on a process group of its own with the
  server (:func:`~easgd_lightning.strategies.ps.server.worker_channels`, made at set-up): gloo
  closes every connection of a group when one operation in it times out or fails on a dead
  peer, so one worker's death must not share a group with the others' traffic. The server
  receives each worker's requests on a thread of its own and serves whole requests in the
  order they arrived (FCFS), never in rank order, and never waits for all workers. A request
  is a float64 header ``[op, local_step, lr, weight_decay]`` plus one flat payload (the SC17
  single-layer message); the reply is a header ``[op, server_updates, stop, extra]`` plus one
  flat payload.
* **Losing a worker** (:mod:`easgd_lightning.strategies.ps.server`). The server drops a
  worker whose channel fails (its process died) or whose heartbeat, posted to the rendezvous
  store every ``heartbeat_s``, has stopped for ``worker_timeout_s`` (default
  ``min(30, timeout_s / 2)``: frozen, e.g. SIGSTOP); it goes on with the rest, records the
  loss (``summary.json`` ``ft.lost_ranks``, ``extras[server].lost_workers``) and declares it
  in the store, so the local launcher ends the run ``ok`` when every other rank finished.
  A dropped worker that answers again (it was only slow) is served again. Under
  ``ft=torchft`` (:meth:`AsyncCenterStrategy.enable_rejoin`) the launcher restarts it and the
  server re-admits the new process on a pair group of its own (it cannot join the fixed
  groups made at set-up; :mod:`~easgd_lightning.strategies.ps.rejoin`): Lightning sees that
  process as a world of one, it pulls the center and the server's state, and trains on
  from its last served step with a fresh optimizer state. Waits never let gloo time out (that
  would close the channel): they run on a helper thread with a very long timeout while
  liveness is checked. Workers wait for the final center the same way (checking the
  server's heartbeat); if the server dies, a worker's pending receive fails (connection
  closed) or times out after ``timeout_s``, and it stops with an error naming the server
  rank: the server is not replaceable. Heartbeats need the store: ``easgd-train`` hosts it
  in the launcher; where rank 0 hosts it (Lightning's own launcher), rank 0's death stops
  the run with an error.
* **No collectives after set-up.** Workers run at different speeds, so every Lightning
  collective would re-synchronise them (or hang on a dead worker): after set-up this strategy
  answers Lightning's own ``barrier``/``broadcast``/``reduce`` calls (file-write barriers, a
  checkpoint path's broadcast, ``sync_dist``'s reduce) locally, and refuses at the call, in
  one line, every collective the user's code asks for (``self.all_gather``; ``barrier``,
  ``broadcast``, ``reduce`` called from outside Lightning, torchmetrics and this package): a
  local answer there would be silently wrong (issue 31). It skips Lightning's per-step SIGTERM
  broadcast (a local check replaces it) and the module-state broadcast of
  ``trainer.validate``. Validation loaders are not sharded: each rank evaluates the whole
  validation set on the center, so ``val/*`` needs no all-reduce. The training set is
  sharded over the workers only; ``trainer.test()``/``predict()`` after set-up run once, on
  rank 0 (the other ranks get no batches).
* **Refusals** at set-up (an optimizer the rule would not run as given) name the Python
  API's terms, or the CLI's keys when the CLI built the strategy (it refuses before launch),
  and are raised on rank 0; the other ranks exit 2 quietly (:class:`RefusedOnRankZero`).
* **Stopping.** ``stop_policy="first"`` (default): ``trainer.max_epochs``/``max_steps`` count
  for the fastest worker; when the first worker finishes, the server tells every other
  worker to stop at its next exchange. ``"all"``: every worker runs its own epochs.
  ``max_time_s``: a wall-clock budget per worker (from the start of its training).
  Workers send ``done`` at the end of fit; once every worker is done (or dead) the server
  sends each the final center, which the user's module then holds on every rank. A server
  whose workers were all lost, none done, fails naming the losses
  (:func:`~easgd_lightning.strategies.ps.server.check_served_a_worker`).
* **Metrics and signals.** ``torchmetrics`` metrics compute from their own rank's state (see
  :func:`local_metrics`); a user's own collective fails at ``timeout_s`` with an error that
  says why. Lightning's SIGTERM handler broadcasts (a collective): it is replaced by a local
  flag the server and the waits check; a rank blocked in a C++ wait is ended
  ``SIGNAL_GRACE_S`` after SIGTERM/SIGINT by :class:`~easgd_lightning.comm.liveness.SignalWatch`.
* **Validation, checkpoints, final ``train_loss``** use the center: workers pull it from the
  server for each validation and checkpoint (rank 0 with the server's state: a checkpoint
  written after a validation holds the center that validation scored). Rank 0's Lightning checkpoints
  (``last.ckpt``, per epoch) hold the center as the module weights and, in
  ``checkpoint["easgd"]["server"]``, the server's state (update count, per-worker counts
  and, for the SGD rule, the user's optimizer's state; ``momentum``: SGD's buffers, flat). The server also writes its own
  ``center.ckpt`` (with its checksum, atomically: temporary file + rename) every ``checkpoint_every_s`` seconds
  and at the end, so a crash of any worker leaves an intact, loadable center. Either file
  resumes a run (``checkpoint.resume=...``): the center and the server state are restored;
  workers restart from the center with fresh optimizer (and velocity) state.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning.trainer.states import RunningStage, TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from easgd_lightning.comm import ops
from easgd_lightning.comm.liveness import Liveness, SignalWatch
from easgd_lightning.compat import lightning as compat
from easgd_lightning.hooks.compressors.dgc import release_optimizer_momentum
from easgd_lightning.strategies import elastic
from easgd_lightning.strategies.base import (
    CenterStrategy,
    flatten,
    optimizer_steps_per_epoch,
    unflatten_into,
)
from easgd_lightning.strategies.ps import compressed, rejoin, rules
from easgd_lightning.strategies.ps.client import ServerClient, ServerTransport, ShardedTransport
from easgd_lightning.strategies.ps.protocol import request_extras, request_header_size
from easgd_lightning.strategies.ps.server import ParameterServer, worker_channels
from easgd_lightning.strategies.ps.shards import shard_bounds
from easgd_lightning.strategies.ps.transport import CenterTransport
from easgd_lightning.strategies.registry import reject_unknown_kwargs
from easgd_lightning.utils.checks import (
    check_bool,
    check_choice,
    check_int,
    check_momentum,
    check_positive,
)

log = logging.getLogger(__name__)

__all__ = ["AsyncCenterStrategy", "local_metrics", "STOP_POLICIES"]

#: what a parameter-server strategy takes besides its ``strategy.*`` options: Lightning's
#: ``DDPStrategy`` keywords it passes on (not the DDP wrapper's comm-hook and
#: model-averaging ones: there is no wrapper), and what the CLI adds (``cli_kwargs``, the
#: ``compression`` group)
_PASSED_ON = (
    "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
    "precision_plugin", "process_group_backend", "timeout", "start_method",
    "num_nodes_hint", "optim_hint", "ft_hint", "compression",
)
STOP_POLICIES = ("first", "all")


class RefusedOnRankZero(SystemExit):
    """Raised on every rank but 0 when set-up refuses the run: rank 0 raises the refusal
    itself (one message, one traceback), the others end with exit status 2 and print nothing."""


#: top-level packages whose calls of barrier/broadcast/reduce are bookkeeping answered locally
_LIBRARY_PACKAGES = frozenset({"pytorch_lightning", "lightning", "lightning_fabric", "torchmetrics", "easgd_lightning"})


def _never_distributed() -> bool:
    return False


def local_metrics(module: torch.nn.Module) -> int:
    """Make every ``torchmetrics.Metric`` in ``module`` compute from this rank's own state.

    A metric's epoch-end sync gathers over every rank of the default process group: the
    parameter server never joins it, and workers that run apart would each wait there for
    the others. It is also not needed: evaluation data are not sharded (each rank evaluates
    the whole set on the center), so a rank's own value is the full value; a training
    metric is that worker's own. Returns how many metrics were switched.
    """
    try:
        from torchmetrics import Metric
    except ImportError:  # torchmetrics is optional
        return 0
    count = 0
    for sub in module.modules():
        if isinstance(sub, Metric):
            sub.distributed_available_fn = _never_distributed
            count += 1
    return count


class _GradOnlyOptimizer:
    """Forwards to the wrapped optimizer, except that ``step(closure)`` only runs the closure.

    Lightning's closure (forward, backward, gradient clipping, hooks) runs as usual; the
    update itself is done by the parameter server / the shared model.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        object.__setattr__(self, "_optimizer", optimizer)

    def step(self, closure: Callable[[], Any] | None = None, **_: Any) -> Any:
        return closure() if closure is not None else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def _optimizer_from_hint(hint: dict | None) -> Optimizer | None:
    """A stand-in of the optimizer the CLI's module will build (``optim.*``), to check it
    before launch; None when the hint names none this knows (the config check reports it)."""
    if not hint:
        return None
    probe = [torch.zeros(1, requires_grad=True)]
    try:
        lr = float(hint.get("lr") or 0.0)
        wd = float(hint.get("weight_decay") or 0.0)
        if hint.get("optimizer") == "sgd":
            return torch.optim.SGD(probe, lr=lr, momentum=float(hint.get("momentum") or 0.0), weight_decay=wd)
        if hint.get("optimizer") == "adamw":
            return torch.optim.AdamW(probe, lr=lr, weight_decay=wd)
    except (TypeError, ValueError):  # a bad optim.* value: the config check names it
        return None
    return None


class AsyncCenterStrategy(CenterStrategy):
    """Shared machinery of the asynchronous strategies (see the module docstring)."""

    strategy_name = ""
    comm_kind = "parameter_server"
    min_world_size = 3
    #: "elastic" (EASGD family) or "sgd" (gradients pushed, weights pulled)
    rule = "elastic"
    #: EAMSGD velocity on the worker
    worker_momentum = False
    #: heavy-ball momentum at the server (Async MSGD)
    server_momentum = False
    #: lock-free application of updates (Hogwild)
    lockfree = False
    supports_final_validate = True
    #: why ``easgd_lightning.fabric`` refuses it (None: it runs under Lightning Fabric)
    fabric_refusal = (
        "its last rank is a parameter server that serves the workers instead of running the "
        "training loop, and the workers stop on its word (stop_policy), inside the Trainer's fit loop"
    )

    def __init__(
        self,
        *,
        tau: int = 1,
        alpha: float | None = None,
        beta: float | None = None,
        rho: float | None = None,
        momentum: float | None = None,
        lr: float | None = None,
        server: str | None = "dedicated",
        servers: int = 1,
        stop_policy: str = "first",
        max_time_s: float | None = None,
        worker_timeout_s: float | None = None,
        heartbeat_s: float = 0.5,
        checkpoint_every_s: float | None = 30.0,
        checkpoint_path: str | None = None,
        overlap: bool = True,
        num_nodes_hint: int | None = None,
        optim_hint: dict | None = None,
        ft_hint: str | None = None,
        compression: Any = None,
        **kwargs: Any,
    ) -> None:
        name = self.strategy_name
        self.servers = _check_servers(name, servers, compression, ft_hint)
        self._push_compression: tuple | None = None
        if compression is not None:
            if self.lockfree:
                raise ValueError(
                    f"compression: {name} applies its updates lock-free in place (Hogwild), with no "
                    "message to compress; use compression=none (compressed pushes: async_sgd, async_msgd; "
                    "compressed elastic differences: async_easgd, async_measgd, sync_easgd)"
                )
            self._push_compression = compressed.unwrap(compression, name)
            if self.rule == "elastic" and self._push_compression[1]:
                raise ValueError(
                    f"compression.two_way: {name} compresses the workers' elastic differences and replies "
                    "with the dense d; set compression.two_way=false"
                )
        super().__init__(**kwargs)
        self.tau = check_int("strategy.tau", tau)
        self._set_moving_rate_options(alpha, beta, rho)
        self.momentum = check_momentum("strategy.momentum", 0.0 if momentum is None else momentum)
        self.lr = check_positive("strategy.lr", lr, nullable=True)
        if server not in (None, "dedicated"):
            raise ValueError(
                f"strategy.server={server!r} is not supported; choose 'dedicated' (the last rank serves)"
                + (" or null (shared memory on one node)" if self.lockfree else "")
            )
        self.server = server
        self.stop_policy = check_choice("strategy.stop_policy", stop_policy, STOP_POLICIES)
        self.max_time_s = check_positive("strategy.max_time_s", max_time_s, nullable=True, unit="seconds")
        self._worker_timeout_opt = check_positive(
            "strategy.worker_timeout_s", worker_timeout_s, nullable=True, unit="seconds"
        )
        self.heartbeat_s = check_positive("strategy.heartbeat_s", heartbeat_s, unit="seconds")
        self.checkpoint_every_s = check_positive(
            "strategy.checkpoint_every_s", checkpoint_every_s, nullable=True, unit="seconds"
        )
        self.checkpoint_path = checkpoint_path
        self.overlap = check_bool("strategy.overlap", overlap)
        self.num_nodes_hint = num_nodes_hint
        self._check_nodes(num_nodes_hint)
        self._from_cli = optim_hint is not None  # refusals name the CLI's keys, else the API's
        hinted = _optimizer_from_hint(optim_hint)
        if hinted is not None:  # the CLI: refuse before any process starts
            self._check_optimizer(hinted)
        # run state
        self._detached = False
        self._finished = False
        self._server: ParameterServer | None = None
        self._channels: dict = {}  # worker rank -> its process group with the server
        self._shard_channels: list[dict] = []  # strategy.servers > 1: per server, as _channels
        self._servers_group = None  # strategy.servers > 1: the servers' group (the final gather)
        self._transport: CenterTransport | None = None
        self._liveness: Liveness | None = None
        self._velocity: torch.Tensor | None = None
        self._n_params = 0
        self._fit_start: float | None = None
        self._stop_reason: str | None = None
        self._exchanges = 0
        self._ckpt_state: dict | None = None
        self._resumed: dict | None = None
        self._center_ckpt_file: Path | None = None
        self._last_center_ckpt = 0.0
        self._error: str | None = None
        self._shard: tuple[int, int] = (0, 0)  # a server: its [lo, hi) of the flat center
        self._scored: dict | None = None  # the center (and server state) of the last validation
        self._signals = SignalWatch(f"{name} rank ?", on_signal=self._pass_signal_on)
        self._interrupted: int | None = None
        self._passed_on = threading.Event()
        self._fit_ending = False  # on_train_end: fetching the center waits for the final one
        self._rejoin = False  # ft=torchft: the server re-admits restarted workers (enable_rejoin)
        self._late: rejoin.LateStart | None = None  # this process is a restarted worker
        self._recovery: dict | None = None  # a restarted worker's rejoin: step, bytes, times
        self._total_steps = -1  # a restarted worker: the run's last step (-1: unknown)

    def _reject_unknown(self, kwargs: dict) -> None:
        """The registry's one-line refusal of a keyword that is neither an option of this
        strategy (``_OPTIONS``) nor one it passes on; subclasses call it first."""
        reject_unknown_kwargs(self, kwargs, known=(*self._OPTIONS, *_PASSED_ON))

    def enable_rejoin(self, late: rejoin.LateStart | None = None) -> None:
        """``ft=torchft`` (``easgd-train`` calls this before fit): the server re-admits
        restarted workers (:mod:`~easgd_lightning.strategies.ps.rejoin`); ``late``: this
        process is one, which joins the running server instead of the world.

        Raises:
            ValueError: shared-memory Hogwild (no server to re-admit anyone).
        """
        if not self.uses_server:
            raise ValueError(f"{self.strategy_name} with strategy.server=null has no server to re-admit a "
                             "restarted worker; use strategy.server=dedicated")
        _check_servers(self.strategy_name, self.servers, None, "torchft")
        self._rejoin, self._late = True, late

    @property
    @override
    def global_rank(self) -> int:
        """A restarted worker's rank in the run (Lightning's own world is that one process)."""
        late = getattr(self, "_late", None)  # (read by Lightning's __init__ already)
        return late.rank if late is not None else super().global_rank

    @property
    @override
    def world_size(self) -> int:
        """A restarted worker: the run's processes (Lightning's own world is that one process)."""
        late = getattr(self, "_late", None)
        return late.world if late is not None else super().world_size

    @classmethod
    def cli_kwargs(cls, cfg: Any) -> dict:
        """Extra constructor arguments from the full config (the CLI calls this)."""
        optim = cfg.get("optim") or {}
        hint = {k: optim.get(k) for k in ("optimizer", "lr", "momentum", "weight_decay")}
        ft = str((cfg.get("ft") or {}).get("name", "none"))
        return {"num_nodes_hint": int(cfg.trainer.get("num_nodes", 1) or 1), "optim_hint": hint, "ft_hint": ft}

    def _check_optimizer(self, optimizer: Optimizer, *, cli: bool = True, warn: bool = False) -> None:
        """Refuse (one line, before training) an optimizer this strategy would not run as given.

        * ``async_measgd`` runs EAMSGD: its Nesterov momentum replaces SGD's momentum. On top
          of another optimizer (Adam's first moment, RMSprop's momentum) it would compound two
          momenta, a rule neither the paper nor the user asked for, so it is refused rather
          than warned about (``async_easgd`` runs any optimizer on the workers).
        * ``async_msgd`` and ``hogwild_sgd`` with ``strategy.momentum`` > 0 apply that
          heavy-ball momentum as SGD's: torch.optim.SGD only, and no other momentum.
        * ``strategy.lr`` replaces every group's learning rate: refused over groups that differ.

        ``cli``: name the CLI's keys (``optim.optimizer=sgd``: the check before launch),
        else the Python API's (the class and its arguments, ``configure_optimizers``).
        ``warn``: say (once per process) when the strategy's momentum replaces an SGD
        momentum of 0 (``async_msgd``'s default 0.9 over a user's plain SGD).
        """
        who = self.strategy_name
        cls = type(self).__name__
        terms = rules.CLI_TERMS if cli else rules.api_terms(cls)
        if self.worker_momentum and not isinstance(optimizer, torch.optim.SGD):
            other = type(optimizer).__name__
            if cli:
                raise ValueError(
                    f"optim.optimizer: {who} adds EAMSGD Nesterov momentum (strategy.momentum) to SGD steps; "
                    f"{other} has momentum of its own and the two would compound: use "
                    f"optim.optimizer=sgd, or strategy=async_easgd to run {other} on the workers"
                )
            raise ValueError(
                f"{cls} adds EAMSGD Nesterov momentum to SGD steps, but configure_optimizers returned {other}, "
                f"whose own momentum would compound with it: return torch.optim.SGD, or use AsyncEASGDStrategy "
                f"to run {other} on the workers"
            )
        if self.rule != "sgd":
            return
        problem = None
        if self.server_momentum and self.momentum > 0:
            had_none = isinstance(optimizer, torch.optim.SGD) and any(
                not float(g.get("momentum", 0.0) or 0.0) for g in optimizer.param_groups)
            problem = rules.check_sgd_momentum(optimizer, self.momentum, who, terms)
            if problem is None and had_none and warn:
                where = "server" if self.uses_server else "workers"
                rank_zero_warn(
                    f"{who} applies heavy-ball momentum {self.momentum} at the {where} ({terms['momentum']}); "
                    f"the optimizer's momentum 0 was set to {self.momentum}. For plain SGD set {terms['no_momentum']}"
                )
        problem = problem or rules.check_fixed_lr(optimizer, self.lr, who, terms)
        if problem:
            raise ValueError(problem)

    def _check_nodes(self, num_nodes: int | None) -> None:
        """Hook: Hogwild refuses several nodes without a server."""

    # ------------------------------------------------------------------ roles
    @property
    def uses_server(self) -> bool:
        return self.server is not None

    @property
    def server_rank(self) -> int | None:
        """The last rank: the server (with ``strategy.servers`` > 1, the last shard's)."""
        return self.world_size - 1 if self.uses_server else None

    @property
    def server_ranks(self) -> list[int]:
        """The last ``strategy.servers`` ranks, server j holding shard j (:mod:`.shards`)."""
        return list(range(self.world_size - self.servers, self.world_size)) if self.uses_server else []

    @property
    def _n_servers(self) -> int:
        """How many ranks serve (0: Hogwild on shared memory)."""
        return self.servers if self.uses_server else 0

    @property
    def is_server(self) -> bool:
        return self.uses_server and self.global_rank >= self.world_size - self.servers

    @property
    def num_workers(self) -> int:
        return self.world_size - self._n_servers

    @property
    def alpha(self) -> float | None:
        return self._alpha

    def validate_world_size(self, world: int) -> None:
        """Called by the CLI before launch: at least 2 workers beside the servers, and no
        more servers than workers (``strategy.servers``)."""
        servers = self._n_servers
        need = servers + 2
        if world < need:
            role = f"2 workers + {servers} parameter server{'s' if servers > 1 else ''}" if servers else "2 workers"
            raise ValueError(
                f"trainer.devices: {self.strategy_name} needs at least {need} processes ({role}), got {world}"
            )
        if servers > world - servers:
            raise ValueError(
                f"strategy.servers={servers}: {self.strategy_name} needs at most as many servers as workers; "
                f"{world} processes give {world - servers} workers (choose strategy.servers <= {world // 2}, "
                "or more trainer.devices / trainer.num_nodes)"
            )
        if self.rule == "elastic" and self._rho_opt is None:
            elastic.resolve_alpha(
                world_size=world - servers,
                alpha=self._alpha_opt, beta=self._beta_opt,
            )

    @override
    def _validate_world(self, world_size: int) -> None:
        super()._validate_world(world_size)
        try:
            if self.optimizers:  # set-up: refuse an optimizer this strategy would not run as given
                self._check_optimizer(self.optimizers[0], cli=self._from_cli, warn=self.global_rank == 0)
            self.validate_world_size(world_size)
        except ValueError as err:
            if self.global_rank != 0:  # rank 0 says it; the others end quietly
                raise RefusedOnRankZero(2) from None
            text = str(err)
            if not self._from_cli and text.startswith("trainer.devices: "):
                raise ValueError("Trainer(devices=..., num_nodes=...): " + text[len("trainer.devices: "):]) from None
            raise
        if self.rule == "elastic":
            self._resolve_moving_rate(self.num_workers)

    @property
    def _worker_timeout_s(self) -> float:
        if self._worker_timeout_opt is not None:
            return float(self._worker_timeout_opt)
        return max(2.0, min(30.0, compat.process_group_timeout(self) / 2))

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Training data sharded over the workers; evaluation data not sharded (no all-reduce)."""
        trainer = compat.attached_trainer(self.lightning_module)
        stage = trainer.state.stage if trainer is not None else None
        if stage is not None and stage != RunningStage.TRAINING:
            return {"num_replicas": 1, "rank": 0}
        if self.uses_server:
            workers = self.num_workers
            return {"num_replicas": workers, "rank": min(self.global_rank, workers - 1)}
        return super().distributed_sampler_kwargs

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """``trainer.test()`` / ``predict()`` after set-up run once, on rank 0: every rank holds
        the same center, the ranks cannot combine shards (no collective), and the server and
        the other workers would only repeat rank 0's work. The other ranks get no batches."""
        trainer = compat.attached_trainer(self.lightning_module)
        stage = trainer.state.stage if trainer is not None else None
        if self._detached and stage in (RunningStage.TESTING, RunningStage.PREDICTING) and not self.is_global_zero:
            return []
        return super().process_dataloader(dataloader)

    # ------------------------------------------------------------------ collectives after set-up
    def _refuse_collective(self, what: str) -> RuntimeError:
        """The one-line error of a collective the module asked for after set-up."""
        server = f"the parameter server (rank {self.server_rank}) never joins one and " if self.uses_server else ""
        return RuntimeError(
            f"{what} under {self.strategy_name}: after set-up the ranks run apart ({server}workers train at "
            "their own pace), so a collective would wait for ranks that never come, and a local answer would "
            "be wrong. Compute the value on each rank (validation runs the whole set on the center on every "
            "rank; self.log(sync_dist=True) and torchmetrics are per rank here) or use a synchronous strategy "
            "(sync_easgd, ddp, local_sgd)"
        )

    def _from_user_code(self) -> bool:
        """Whether the caller of the collective (two frames up) is code of the user's, not
        Lightning's, torchmetrics' or this package's own bookkeeping (a checkpoint path
        broadcast, a barrier around file writes, ``self.log(sync_dist=True)``'s reduce),
        which this strategy answers locally on purpose."""
        frame = sys._getframe(2)
        name = frame.f_globals.get("__name__", "") or ""
        return name.split(".")[0] not in _LIBRARY_PACKAGES

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._detached:
            if self._from_user_code():
                raise self._refuse_collective("barrier()")
            return
        super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._detached:
            if self._from_user_code():
                raise self._refuse_collective(f"broadcast(src={src})")
            return obj
        return super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if self._detached:
            if self._from_user_code():
                raise self._refuse_collective("reduce()")
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self._detached:
            if self._from_user_code():
                raise self._refuse_collective("reduce_boolean_decision()")
            return bool(decision)
        return super().reduce_boolean_decision(decision, all=all)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        """After set-up: refused at the call (Lightning never gathers for itself; a module's
        ``self.all_gather`` would otherwise get a one-rank answer while ``world_size`` says more)."""
        if self._detached:
            raise self._refuse_collective("all_gather (self.all_gather)")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def _check_sigterm_locally(self, trainer) -> None:
        """Lightning broadcasts a SIGTERM flag from rank 0 before every batch: a per-step
        synchronisation that would make the workers wait for each other. Check locally."""
        from pytorch_lightning.utilities.exceptions import SIGTERMException

        def local_check() -> None:
            if getattr(trainer, "received_sigterm", False):
                raise SIGTERMException()

        compat.replace_sigterm_broadcast(trainer, local_check)

    # ------------------------------------------------------------------ set-up
    def _on_sigterm(self, signum: int, _frame: Any) -> None:
        """Lightning's SIGTERM notifier without its ``dist.broadcast`` (ranks that run apart
        never join one, so it would hang in the handler): record it, forward it to the
        processes Lightning's launcher started, and let the loops stop on it."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._interrupted = self._interrupted or signum
        self._pass_signal_on(signum)
        if trainer is not None:
            compat.mark_sigterm_received(trainer)

    def _pass_signal_on(self, signum: int) -> None:
        """Once: send the signal to the processes Lightning's launcher started from this one
        (also from the signal watch, when this rank is blocked and its handler cannot run)."""
        if self._passed_on.is_set():
            return
        self._passed_on.set()
        if self.launcher is not None and signum == signal.SIGTERM:
            self.launcher.kill(signum)

    def _interrupted_by(self) -> int | None:
        return self._interrupted

    def _install_signal_handling(self, trainer) -> None:
        """Every rank ends promptly on SIGTERM / SIGINT, even one blocked in a wait."""
        compat.set_sigterm_notifier(trainer, self._on_sigterm)  # read by register_signal_handlers(), after setup
        self._signals.who = f"{self.strategy_name} rank {self.global_rank}"
        self._signals.start()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Say why a collective timed out: after set-up, ranks of this strategy never meet."""
        super().on_exception(exception)
        text = str(exception)
        gloo = isinstance(exception, getattr(dist, "DistBackendError", ())) or any(
            mark in text for mark in ("imed out", "gloo", "Connection closed")
        )
        if self._fit_start is not None and gloo and not text.startswith("the parameter server"):
            server = f"the parameter server (rank {self.server_rank}) never joins one and " if self.uses_server else ""
            exception.args = (
                f"rank {self.global_rank}: a torch.distributed collective over every rank cannot complete "
                f"(it ends at timeout_s, or when a peer that timed out leaves): {self.strategy_name} ranks run "
                f"apart after set-up ({server}workers train at their own pace), so the module and callbacks "
                "must not call one (self.log(sync_dist=True) and torchmetrics metrics are computed per rank "
                f"by this strategy). Cause: {text}",
            )

    @override
    def setup(self, trainer) -> None:
        """Fitting: CenterStrategy's set-up (one optimizer, :meth:`_validate_world`,
        :meth:`_init_center`). After fit (``validate``/``test`` on the same strategy) the
        ranks run apart: Lightning's set-up without its module-state broadcast."""
        if trainer.state.fn == TrainerFn.FITTING or not self._detached:
            return super().setup(trainer)
        with compat.module_state_sync_skipped():  # a dead worker would hang the broadcast
            super().setup(trainer)
        local_metrics(self.lightning_module)
        self._install_signal_handling(trainer)

    @override
    def _init_center(self) -> None:
        """Every rank starts from rank 0's weights (or the resumed center); then the heartbeat,
        the center file, the transport (or, on the server, the server loop), and from here on
        no collective: Lightning's per-batch SIGTERM broadcast becomes a local check."""
        trainer = self.lightning_module.trainer
        module = self.lightning_module
        local_metrics(module)
        tensors = self._elastic_tensors()
        self._n_params = sum(p.numel() for p in module.parameters())
        if self._late is not None:
            return self._init_late_worker(trainer, tensors)
        flat = flatten(tensors)
        ops.broadcast(flat, src=0, kind="setup")
        token = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        ops.broadcast(token, src=0, kind="setup")
        state = self._resume_state
        if state is not None:
            flat = state["center"].to(device=flat.device, dtype=flat.dtype).clone()
            steps = state.get("steps") or []
            if self.global_rank < len(steps) and steps[self.global_rank] is not None:
                self._local_steps = int(steps[self.global_rank])
        unflatten_into(flat, tensors)
        self._center = flat.clone()
        self._liveness = Liveness(
            f"easgd_async/{int(token)}", self.global_rank,
            interval_s=self.heartbeat_s, dead_after_s=self._worker_timeout_s,
        ).start()
        self._setup_checkpoint_file(trainer)
        if self.uses_server:  # every rank, in the same order (a collective)
            timeout = timedelta(seconds=compat.process_group_timeout(self))
            workers = list(range(self.num_workers))
            self._shard_channels = [worker_channels(s, workers, timeout) for s in self.server_ranks]
            self._channels = self._shard_channels[-1]
            if self.servers > 1:
                self._servers_group = ops.new_group(self.server_ranks, timeout=timeout)
        if self._rejoin and self.is_server:  # where restarted workers find the run
            rejoin.publish_session(self._liveness.store_client(), self._liveness.prefix, self.global_rank,
                                   self.world_size)
        self._make_transport(trainer, int(token))
        self._detach(trainer)

    def _detach(self, trainer) -> None:
        """The end of set-up: the worker's own momentum, then no collective from here on."""
        if self.worker_momentum and not self.is_server:
            self._own_momentum(self.optimizers[0])
            self._velocity = torch.zeros_like(self._center)
        self._check_sigterm_locally(trainer)
        self._install_signal_handling(trainer)
        self._detached = True

    def _init_late_worker(self, trainer, tensors: list[torch.Tensor]) -> None:
        """A restarted worker (:mod:`~easgd_lightning.strategies.ps.rejoin`): no world-wide
        group. The session from the run's store, its heartbeat, admission on a pair group of
        its own, then the center and the server's state (``OP_STATE``). It starts at the
        center with a fresh optimizer state (and, EAMSGD, zero velocity), its step count at
        the step of its last request the server served, Lightning's loop at the epoch of that
        step (its shard's order for that epoch, from the epoch's first batch), its
        step-interval learning-rate schedules advanced to that step."""
        late = self._late
        timeout_s = compat.process_group_timeout(self)
        store = rejoin.run_store(timeout_s)
        session = rejoin.read_session(store, timeout_s)
        self._liveness = Liveness(session["prefix"], late.rank, interval_s=self.heartbeat_s,
                                  dead_after_s=self._worker_timeout_s).start()
        group = rejoin.request_admission(store, late.rank, late.attempt, timedelta(seconds=timeout_s))
        self._channels = {late.rank: group}
        client = self._server_client(flatten(tensors), peer=1)
        state = client.pull_state(0)
        self._center = state["center"].to(device=tensors[0].device, dtype=tensors[0].dtype)
        unflatten_into(self._center, tensors)
        steps = state.get("worker_steps") or []
        self._local_steps = int(steps[late.rank]) if late.rank < len(steps) else 0
        self._recovery = {"step": self._local_steps, "bytes": client.last_state_bytes,
                          "started_at": late.started, "pulled_at": time.time()}
        self._setup_checkpoint_file(trainer)
        client.like = self._center
        self._transport = ServerTransport(client, push=self._compressed_side(compressed.WorkerPush))
        _advance_step_schedulers(self.lr_scheduler_configs, self._local_steps)
        self._total_steps = _estimated_steps(trainer)  # (sets the training data up: the epoch length)
        per_epoch = optimizer_steps_per_epoch(trainer)
        if per_epoch:
            _start_at_epoch(trainer, restart_epoch(self._local_steps, per_epoch, trainer.max_epochs))
        self._detach(trainer)

    def _setup_checkpoint_file(self, trainer) -> None:
        if self.checkpoint_path:
            self._center_ckpt_file = Path(self.checkpoint_path)
            return
        callback = getattr(trainer, "checkpoint_callback", None)
        dirpath = getattr(callback, "dirpath", None)
        self._center_ckpt_file = Path(dirpath) / "center.ckpt" if dirpath else None

    def _shards(self) -> list[tuple[int, int]]:
        """Each server's ``[lo, hi)`` of the flat center (:func:`~.shards.shard_bounds`)."""
        sizes = [p.numel() for p in self.lightning_module.parameters()]
        return shard_bounds(self.rule, sizes, self._center.numel(), max(1, self.servers))

    def _shard_params(self, lo: int, hi: int) -> tuple[int, int]:
        """The parameter tensors ``[a, b)`` that start in ``[lo, hi)`` (parameter-aligned
        shards: they end in it too)."""
        starts = [0]
        for p in self.lightning_module.parameters():
            starts.append(starts[-1] + p.numel())
        last = hi >= self._center.numel()  # the last shard also takes empty tensors at the very end
        inside = [i for i in range(len(starts) - 1) if lo <= starts[i] and (starts[i] < hi or last)]
        return (inside[0], inside[-1] + 1) if inside else (0, 0)

    def _make_transport(self, trainer, token: int) -> None:
        """Server: build the server loop (of its shard); workers: a client of the server(s)."""
        sharded = self.servers > 1
        if self.is_server:
            j = self.global_rank - (self.world_size - self.servers)
            lo, hi = self._shards()[j]
            params = list(self.lightning_module.parameters()) if self.rule == "sgd" else None
            if sharded and params is not None:
                a, b = self._shard_params(lo, hi)
                params = params[a:b]
            self._shard = (lo, hi)
            self._server = ParameterServer(
                rank=self.global_rank,
                workers=list(range(self.num_workers)),
                center=self._center[lo:hi].clone() if sharded else self._center,
                n_params=max(0, min(hi, self._n_params) - lo),
                rule=self.rule,
                alpha=self._alpha or 0.0,
                lr=self.lr,
                optimizer=self.optimizers[0] if self.rule == "sgd" else None,
                params=params,
                lockfree=self.lockfree,
                liveness=self._liveness,
                stop_policy=self.stop_policy,
                kind=self.comm_kind,
                on_checkpoint=self._write_center_checkpoint if self._center_ckpt_file and not sharded else None,
                checkpoint_every_s=self.checkpoint_every_s,
                interrupted=self._interrupted_by,
                replies=self._compressed_side(compressed.ServerReplies, list(range(self.num_workers))),
                channels=self._shard_channels[j],
                rejoin_store=self._liveness.store_client if self._rejoin else None,
                rejoin_timeout=timedelta(seconds=compat.process_group_timeout(self)),
                rejoin_wait_s=compat.process_group_timeout(self),
            )
            if self._resume_state is not None:
                srv = self._resume_state.get("server") or {}
                self._server.load_state_dict(srv)
                self._resumed = _describe_resume(self._center, srv)
        elif sharded:
            self._transport = self._sharded_transport()
        else:
            self._transport = ServerTransport(self._server_client(self._center),
                                              push=self._compressed_side(compressed.WorkerPush))

    def _sharded_transport(self) -> ShardedTransport:
        """A worker's clients of the S servers, client j on its channel to server j, its
        payload shard j (:class:`~.client.ShardedTransport`)."""
        bounds = self._shards()
        params = list(self.lightning_module.parameters())
        ranges = [self._shard_params(lo, hi) for lo, hi in bounds] if self.rule == "sgd" else None
        clients = []
        for j, (server, (lo, hi)) in enumerate(zip(self.server_ranks, bounds)):
            mine = params[ranges[j][0] : ranges[j][1]] if ranges else params
            clients.append(self._server_client(self._center[lo:hi], server=server, params=mine,
                                               n_params=max(0, min(hi, self._n_params) - lo),
                                               group=self._shard_channels[j].get(self.global_rank)))
        groups = len(self.optimizers[0].param_groups) if self.rule == "sgd" else 0
        return ShardedTransport(clients, bounds, ranges, groups)

    def _server_client(self, like: torch.Tensor, peer: int | None = None, *, server: int | None = None,
                       params: list[torch.Tensor] | None = None, n_params: int | None = None,
                       group: Any = None) -> ServerClient:
        """This worker's client of the server (or, sharded, of ``server`` for the shard
        ``like`` of ``params``), on its channel (``peer``: the server's rank in it when it is
        a pair group)."""
        sgd = self.rule == "sgd"
        params = list(self.lightning_module.parameters()) if params is None else params
        header = request_header_size(self.optimizers[0] if sgd else None, params)
        return ServerClient(self.world_size - 1 if server is None else server, like, self.world_size,
                            n_params=self._n_params if n_params is None else n_params,
                            kind=self.comm_kind, liveness=self._liveness, header_size=header,
                            interrupted=self._interrupted_by,
                            group=self._channels.get(self.global_rank) if group is None else group, peer=peer)

    def _compressed_side(self, cls, *workers):
        """This rank's half of compressed pushes (None without compression): the worker's
        :class:`~.compressed.WorkerPush` or the server's :class:`~.compressed.ServerReplies`."""
        if self._push_compression is None:
            return None
        compressor, two_way = self._push_compression
        sizes = [p.numel() for p in self.lightning_module.parameters()]
        if self.rule == "elastic":  # compressed elastic differences, dense replies
            if cls is compressed.ServerReplies:
                return compressed.ElasticReplies(compressor, sizes, self._center, workers[0], self._alpha)
            return compressed.ElasticPush(compressor, sizes, self._center, self._alpha)
        if cls is compressed.ServerReplies:
            return cls(compressor, sizes, self._center, workers[0], two_way)
        return cls(compressor, sizes, self._center, two_way)

    def _own_momentum(self, optimizer: Optimizer) -> None:
        """EAMSGD applies its own momentum: switch the optimizer's off."""
        if release_optimizer_momentum([optimizer]) and self.global_rank == 0:
            rank_zero_warn(
                f"{self.strategy_name} applies its own Nesterov momentum (strategy.momentum="
                f"{self.momentum}); the optimizer's momentum was set to 0 so it is not applied twice"
            )

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # one real barrier so that start-up skew does not count as speed (everyone is alive
        # here; a restarted worker's world is its own)
        if self._late is None:
            ops.barrier(kind="setup")
        elif 0 < self._total_steps <= self._local_steps:  # restarted after its last step
            self._mark_rejoined()  # back, with nothing left to train: it reports its end
            self._stop_reason = _LAST_STEP
            self.lightning_module.trainer.should_stop = True
        self._fit_start = time.monotonic()
        if self.is_server:
            try:
                self._server.serve()
            except BaseException:  # interrupted or failed: no wait for the other servers
                self._center = self._server_center(gather=False)
                raise
            self._center = self._server_center(gather=True)
            self.lightning_module.trainer.should_stop = True

    def _server_center(self, gather: bool) -> torch.Tensor:
        """A server's center after serving: its own, with one server. With a sharded center
        (``gather``) the whole final center, gathered from the S servers over their own group
        (padded to the longest shard): it waits, bounded by ``timeout_s``, for the other
        servers to end serving. Without ``gather`` (serving was interrupted), or when the
        gather fails (a server died), the set-up center with this server's own shard in it."""
        if self.servers == 1:
            return self._server.center
        own = self._center.clone()
        own[self._shard[0] : self._shard[1]] = self._server.center
        if not gather:
            return own
        bounds = self._shards()
        mine = torch.zeros(max(hi - lo for lo, hi in bounds), dtype=self._center.dtype)
        mine[: self._server.center.numel()] = self._server.center.detach().cpu()
        try:
            parts = ops.all_gather(mine, kind=self.comm_kind, group=self._servers_group)
        except RuntimeError as err:
            log.warning("server rank %d: could not gather the other shards of the center (%s); its module holds "
                        "its own shard only", self.global_rank, err)
            return own
        return torch.cat([part[: hi - lo] for part, (lo, hi) in zip(parts, bounds)]).to(own.device)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        if self.is_server:  # the server never trains
            self.lightning_module.trainer.should_stop = True
            return None
        self._scored = None  # the center moves on: a checkpoint from now on pulls a fresh one
        if self.rule == "sgd" and not self._transport.steps_locally:
            optimizer = _GradOnlyOptimizer(optimizer)  # the server steps the user's optimizer
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._after_step()
        return out

    @override
    def _exchange_step(self, take_step: Callable[..., Any], optimizer: Optimizer) -> Any:
        if self.rule == "sgd":
            return self._sgd_exchange(take_step, optimizer)
        return self._elastic_exchange(take_step, optimizer)

    def _elastic_exchange(self, take_step: Callable[[], Any], optimizer: Optimizer) -> Any:
        tensors = self._elastic_tensors()
        pending, diff = None, None
        if elastic.is_exchange_step(self._local_steps, self.tau):
            pending = self._transport.begin_elastic(flatten(tensors), self._local_steps, self._optimizer_lr(optimizer))
            self._exchanges += 1
            if not self.overlap:
                diff, pending = self._transport.end_elastic(pending), None
        x_look = None
        if self._velocity is not None:
            x_look = rules.nesterov_lookahead(flatten(tensors), self._velocity, self.momentum)
            unflatten_into(x_look, tensors)
        out = take_step()
        with torch.no_grad():
            x = flatten(tensors)
            if x_look is not None:
                rules.nesterov_velocity_update(self._velocity, x_look, x)
            if pending is not None:
                diff = self._transport.end_elastic(pending)
            if diff is not None:
                elastic.apply_elastic_pull(x, diff)
            unflatten_into(x, tensors)
        return out

    def _grad_vector(self) -> torch.Tensor:
        """Gradients (zeros where none: the request's mask says which) then float buffers."""
        module = self.lightning_module
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
            for p in module.parameters()
        ]
        parts += [b.detach().reshape(-1) for b in module.buffers() if b.is_floating_point()]
        return torch.cat(parts)

    def _sgd_exchange(self, compute: Callable[[], Any], optimizer: Optimizer) -> Any:
        """Async SGD / MSGD: push the gradient, the server steps the user's optimizer and
        returns w. Hogwild SGD on shared memory: the worker's optimizer steps here and its
        displacement is added to the shared w without a lock."""
        params = list(self.lightning_module.parameters())
        if self.lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = self.lr
        if self._transport.steps_locally:
            before = flatten(params)
            out = compute()
            moves = rules.optimizer_displacement(before, params)
            buffers = [b.detach().reshape(-1) for b in self.lightning_module.buffers() if b.is_floating_point()]
            sizes = [p.numel() for p in params]
            weights = self._transport.push_displacement(moves, sizes, buffers, self._local_steps)
        else:
            out = compute()
            extras = request_extras(optimizer, params)
            weights = self._transport.push_gradient(self._grad_vector(), self._local_steps, extras)
        self._exchanges += 1
        unflatten_into(weights, self._elastic_tensors())
        return out

    def _after_step(self) -> None:
        trainer = self.lightning_module.trainer
        if self._late is not None:
            self._late_worker_step(trainer)
        if self._transport is not None and self._transport.stop and self.stop_policy == "first":
            self._stop_reason = self._stop_reason or "another worker finished (stop_policy=first)"
            trainer.should_stop = True
        if self.max_time_s is not None and self._fit_start is not None:
            if time.monotonic() - self._fit_start >= self.max_time_s:
                self._stop_reason = self._stop_reason or f"max_time_s={self.max_time_s} reached"
                trainer.should_stop = True

    def _late_worker_step(self, trainer) -> None:
        """A restarted worker: its first served exchange completes its rejoin (the launcher is
        told); it ends at the run's last step (``trainer.estimated_stepping_batches``, which its
        step count, continued from its first start, reaches before its own epochs end)."""
        if self._exchanges:
            self._mark_rejoined()
        if 0 < self._total_steps <= self._local_steps:
            self._stop_reason = self._stop_reason or _LAST_STEP
            trainer.should_stop = True

    def _mark_rejoined(self) -> None:
        """Tell the launcher this restarted worker is back (once)."""
        rec = self._recovery
        if rec is not None and "joined_at" not in rec:
            rec["joined_at"] = time.time()
            self._late.mark_joined({"joined_at": rec["joined_at"], "step": rec["step"],
                                    "recovery_bytes": rec["bytes"]})

    @override
    def _fetch_center(self) -> None:
        """Pull the center to validate. Rank 0, which writes the checkpoints, pulls it with the
        server's state and keeps both: a checkpoint saved after this validation holds the
        center that was scored (ModelCheckpoint(monitor=...) selects by that score)."""
        if self._fit_ending:  # the final center, once every worker is done (or dead)
            if self._transport is not None and not self._finished:
                self._center = self._transport.finish(self._local_steps)
            return
        # before training starts (sanity check) every rank already holds the set-up center
        if self._finished or self.is_server or self._transport is None or self._fit_start is None:
            return
        trainer = self.lightning_module.trainer
        if self.is_global_zero and trainer.checkpoint_callbacks:
            self._scored = self._transport.pull_state(self._local_steps)
            self._center = self._scored["center"].to(self._center.device, self._center.dtype)
        else:
            self._center = self._transport.pull(self._local_steps)

    @override
    def on_train_end(self) -> None:
        """CenterStrategy's end of fit, where fetching the center waits for the final one."""
        self._scored = None  # from here on the module holds the final center: checkpoints save it
        if self._center is None:
            return super().on_train_end()
        self._fit_ending = True
        try:
            super().on_train_end()
        finally:
            self._finished = True
            if self._liveness is not None:
                self._liveness.stop()
            if self._transport is not None:
                self._transport.close()

    # ------------------------------------------------------------------ checkpoints
    def _center_state_dict(self, center: torch.Tensor) -> dict:
        tensors = self._elastic_tensors()
        stash = self._stash if self._stash is not None else flatten(tensors)
        unflatten_into(center, tensors)
        try:
            return {k: v.detach().cpu().clone() for k, v in self.lightning_module.state_dict().items()}
        finally:
            unflatten_into(stash, tensors)

    def _server_state_now(self) -> dict:
        """The center and the server's state, as this rank can best know them now."""
        if self._server is not None:
            state = self._server.state_dict()
            state["center"] = self._server.center.detach().cpu().clone()
            return state
        if self._transport is not None and not self._finished:
            return self._transport.pull_state(self._local_steps)
        return {"center": self._center.detach().cpu().clone(), "updates": None, "momentum": None}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The center's weights: on rank 0, the center of the last validation when this rank has
        not trained since (what a monitored metric scored), else one pulled now with the
        server's state."""
        if self._center is None:
            return super().lightning_module_state_dict()
        if self.is_global_zero:
            self._ckpt_state = self._scored if self._scored is not None else self._server_state_now()
            self._center = self._ckpt_state["center"].to(self._center.device, self._center.dtype)
        return self._center_state_dict(self._center)

    def _easgd_payload(self, state: dict) -> dict:
        server = {k: state.get(k) for k in ("updates", "served", "worker_steps", "momentum", "optimizer")}
        steps = state.get("worker_steps")
        return {
            "strategy": self.strategy_name,
            "center": state["center"].detach().cpu().clone(),
            "server": server,
            "steps": steps,
            "workers": [],
            "world_size": self.world_size,
            "server_rank": self.server_rank,
            "server_ranks": self.server_ranks,
        }

    @override
    def _checkpoint_state(self) -> dict | None:
        """Rank 0's center and server state; no collective (workers run apart), and only rank
        0 writes, so the other ranks add nothing."""
        if not self.is_global_zero:
            return None
        state = self._ckpt_state or self._server_state_now()
        self._ckpt_state = None
        return self._easgd_payload(state)

    def _write_center_checkpoint(self, state: dict) -> None:
        """The center file written by whoever holds the center: tensors and plain data with
        their checksum, written atomically (temp file + rename), as every other checkpoint."""
        if self._center_ckpt_file is None:
            return
        import pytorch_lightning as pl

        from easgd_lightning.utils.checkpoint import save_checkpoint_file, to_plain

        center = state["center"].to(self._center.device, self._center.dtype)
        payload = {
            "epoch": 0,
            "global_step": 0,
            "pytorch-lightning_version": pl.__version__,
            "state_dict": self._center_state_dict(center),
            "optimizer_states": [],
            "lr_schedulers": [],
            "easgd": self._easgd_payload(state),
            "written_at": time.time(),
        }
        try:
            save_checkpoint_file(to_plain(payload, "center.ckpt"), self._center_ckpt_file)
        except OSError as err:  # never kill the server for a full disk; say so
            log.warning("could not write %s: %s", self._center_ckpt_file, err)

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Workers restart from the center with fresh optimizer state."""
        if checkpoint.get("easgd") is None:
            return super().load_optimizer_state_dict(checkpoint)

    # ------------------------------------------------------------------ reporting
    @override
    def summary_extras(self) -> dict:
        extras = super().summary_extras()
        extras.update({
            "role": "server" if self.is_server else "worker",
            "server_rank": self.server_rank,
            "server_ranks": self.server_ranks,
            "tau": self.tau if self.rule == "elastic" else None,
            "alpha": self._alpha,
            "momentum": self.momentum,
            "stop_policy": self.stop_policy,
        })
        if self._rejoin:
            extras["ft"] = self._ft_report()
        if self.is_server and self._server is not None:
            srv = self._server
            extras.update(
                updates=srv.updates,
                served_per_rank=srv.served,
                worker_steps=srv.worker_steps,
                done_workers=srv.done,
                dead_workers=srv.dead,
                lost_workers=srv.lost,
                service_order=list(srv.service_log)[-400:],
                lockfree=srv.lockfree,
                resumed=self._resumed,
                center_checkpoint=str(self._center_ckpt_file) if self._center_ckpt_file and self.servers == 1 else None,
                shard=list(self._shard),
            )
        else:
            extras.update(exchanges=self._exchanges, stop_reason=self._stop_reason or "own epochs/steps done")
            push = getattr(self._transport, "push", None)
            if push is not None:  # compressed pushes: what this worker's messages carried
                extras["compressed_pushes"] = dict(push.traffic, compressor=self._push_compression[0].name,
                                                   two_way=push.two_way)
        return extras

    def _ft_report(self) -> dict:
        """``extras["ft"]`` under ``ft=torchft``, in the form ``ft/launch.py`` merges: a
        restarted worker's recovery; the server's membership changes as ``quorum_changes``
        (``step``: the server's update count; members: the workers not lost)."""
        changes = []
        if self._server is not None:
            changes = [{"step": m["step"], "quorum_id": i, "members": m["members"],
                        "participants": len(m["members"]), "t": m["t"]}
                       for i, m in enumerate(self._server.membership)]
        rec = self._recovery
        return {"attempt": self._late.attempt if self._late is not None else 0,
                "quorum_changes": changes, "not_committed": [],
                "recoveries": [rec] if rec is not None and "joined_at" in rec else [],
                "rejoins": list(self._server.rejoins) if self._server is not None else []}

    @override
    def teardown(self) -> None:
        if self._liveness is not None:  # done serving or failed: either way, stop the heartbeat
            self._liveness.stop()
        self._signals.stop()
        super().teardown()


def _check_servers(name: str, servers: Any, compression: Any, ft: str | None) -> int:
    """``strategy.servers``: an integer >= 1 (at most the workers: :meth:`validate_world_size`);
    above 1, refused in one line with what does not shard yet (compressed pushes, the
    re-admission of restarted workers under ``ft=torchft``).

    Raises:
        ValueError: naming ``strategy.servers``.
    """
    servers = check_int("strategy.servers", servers)
    if servers > 1 and compression is not None:
        raise ValueError(f"strategy.servers={servers}: {name} does not shard compressed pushes yet; use "
                         "compression=none or strategy.servers=1")
    if servers > 1 and ft == "torchft":
        raise ValueError(f"strategy.servers={servers}: {name} re-admits restarted workers (ft=torchft) with one "
                         "server only; use strategy.servers=1 or ft=none")
    return servers


def _estimated_steps(trainer) -> int:
    """The run's optimizer steps per worker (``trainer.estimated_stepping_batches``; -1 when
    unknown: then its own epochs, or the server, end a restarted worker)."""
    try:
        total = trainer.estimated_stepping_batches
    except Exception:  # an iterable without a length, and no max_steps
        return -1
    return int(total) if math.isfinite(total) else -1


#: why a restarted worker stops: its step count, continued from its first start, reached the end
_LAST_STEP = "the run's last step (a restarted worker's steps continue)"


def restart_epoch(local_steps: int, per_epoch: int, max_epochs) -> int:
    """The epoch a restarted worker's fit loop begins at: the one its step count is in, but
    at most the last (``max_epochs - 1``): a worker restarted after its last step (it died
    before telling the server it was done) must still run the loop's start and end -- from
    ``max_epochs`` on Lightning skips the loop, and with it the end where the worker says
    it is done, and the server and the other workers would wait for it; its
    ``on_train_start`` stops it before any batch."""
    epoch = local_steps // per_epoch
    if isinstance(max_epochs, int) and max_epochs > 0:
        epoch = min(epoch, max_epochs - 1)
    return epoch


def _start_at_epoch(trainer, epoch: int) -> None:
    """Lightning's fit loop begins at ``epoch`` (``trainer.current_epoch``: the sampler's
    order, epoch checkpoint names and ``max_epochs`` count from there), as a resume does."""
    for tracker in (trainer.fit_loop.epoch_progress.total, trainer.fit_loop.epoch_progress.current):
        tracker.ready = tracker.started = tracker.processed = tracker.completed = epoch


def _advance_step_schedulers(configs: list, steps: int) -> None:
    """Step each step-interval learning-rate scheduler of ``configs`` (Lightning's
    ``lr_scheduler_configs``) ``steps // frequency`` times: a restarted worker's schedule
    continues at its step count. Epoch-interval schedulers restart with the loop's epochs;
    ``ReduceLROnPlateau`` (it needs metrics) is left as it is."""
    import warnings

    for config in configs:
        if config.interval != "step" or config.reduce_on_plateau:
            continue
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose
            warnings.simplefilter("ignore")
            for _ in range(steps // max(1, int(config.frequency))):
                config.scheduler.step()


def _describe_resume(center: torch.Tensor, server_state: dict) -> dict:
    mom = server_state.get("momentum")
    return {
        "center_sum": float(center.double().sum()),
        "updates": server_state.get("updates"),
        "momentum_sum": None if mom is None else float(mom.double().sum()),
    }

