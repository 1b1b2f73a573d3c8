"""``local_sgd``, ``sync_easgd``, ``diloco`` and ``ddp`` under ``ft=torchft``: the exchange is a
torchft quorum step (``ddp`` and ``diloco``: the classes' own docstrings).

The arithmetic is the strategies' own (strategies/local_sgd.py, strategies/sync_easgd.py;
Lin et al. / Stich for local SGD, Zhang, Choromanska, LeCun NeurIPS 2015 for EASGD); only
who takes part changes, at each exchange, to the quorum of workers present
(:meth:`easgd_lightning.ft.worker.FTSession.exchange`):

* local SGD, every H steps:  x_i <- c <- sum_{i in Q} (x_i / |Q|)       (Q: the quorum)
* Sync EASGD, every tau steps:  d_i = alpha (x_i - c);  x_i <- x_i - d_i;
  c <- c + sum_{i in Q} d_i   -- alpha stays the configured one (beta = p alpha with the
  configured p), so the centre moves with the workers present: a missing worker's pull is
  simply absent.

Nothing is applied before the quorum commits (``should_commit``): a failed exchange leaves
x and c as they were, and is tried again with the next quorum. A worker that joins receives
its peer's state in that exchange and then applies the exchange to it (local SGD: x = c
= the new average; EASGD: c = c_peer + sum d, x = c, a fresh explorer starting at the
centre). The exchange is blocking (Sync EASGD's overlap is off under ft=torchft); with no
fault and a fixed quorum it is the same sums in the same order as ``ft=none`` (one gloo
all-reduce per fusion bucket, contributions in worker-rank order), hence bitwise the same
trajectory.

Each worker trains on its own shard: the sampler is Lightning's ``DistributedSampler``
with ``num_replicas`` = the configured number of workers and ``rank`` = the worker's rank,
whatever the quorum. A lost worker's shard is not trained on while it is away; the
restarted worker goes through its own shard again from the start of its epoch 0 order
(Lightning's loop restarts in the new process) until the run's last step.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from easgd_lightning.comm.fusion import fusion_buckets
from easgd_lightning.ft.worker import FTContext, FTSession
from easgd_lightning.strategies import elastic
from easgd_lightning.strategies.base import _then
from easgd_lightning.strategies.ddp import CompressedDDPStrategy
from easgd_lightning.strategies.diloco import (
    DiLoCoStrategy,
    fragment_to_sync,
    merge_fragment,
    outer_sgd_step,
)
from easgd_lightning.strategies.local_sgd import LocalSGDStrategy
from easgd_lightning.strategies.sync_easgd import SyncEASGDStrategy

log = logging.getLogger(__name__)

__all__ = ["FTLocalSGDStrategy", "FTSyncEASGDStrategy", "attach"]


class _FTMixin:
    """What both strategies share under ft=torchft (mixed in before the strategy class)."""

    _ft_ctx: FTContext
    _ft: FTSession | None
    #: why ``easgd_lightning.fabric`` refuses it
    fabric_refusal = (
        "torchft's live recovery loads the Trainer's state (module, optimizer, schedulers, "
        "steps) into a joining replica and stops the Trainer's fit loop"
    )

    def _ft_init(self, ctx: FTContext) -> None:
        self._ft_ctx = ctx
        self._ft = None
        self._ft_total: int | None = None
        self._ft_n = ctx.world

    # ------------------------------------------------------------ identity and data
    @property
    def global_rank(self) -> int:  # the worker's rank among the workers (Lightning's world is 1)
        return self._ft_ctx.rank

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Training: the worker's shard of the configured workers. Validation: the whole set on
        every worker (there is no reduction across workers outside an exchange)."""
        from pytorch_lightning.trainer.states import RunningStage

        stage = self.lightning_module.trainer.state.stage
        if stage == RunningStage.TRAINING:
            return {"num_replicas": self._ft_ctx.world, "rank": self._ft_ctx.rank}
        return {"num_replicas": 1, "rank": 0}

    def _ft_world(self) -> int:
        return self._ft_ctx.world

    # ------------------------------------------------------------ the session
    def _ft_session(self) -> FTSession:
        if self._ft is None:
            self._ft = FTSession(self._ft_ctx, self._ft_state, self._ft_load)
        return self._ft

    def _ft_buckets(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` as the fusion buckets ``ft=none`` all-reduces (comm.fusion_mb)."""
        sizes = [t.numel() for t in self._elastic_tensors()]
        item = flat.element_size()
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        return [flat[offsets[a]:offsets[b]] for a, b in fusion_buckets([n * item for n in sizes], self._comm.fusion_bytes)]

    def _ft_exchange(self, payload: Callable[[int, bool], torch.Tensor],
                     apply: Callable[[torch.Tensor, bool], None], kind: str | None = None) -> None:
        """One committed quorum exchange of a flat buffer (its fusion buckets summed)."""
        holder: dict = {}

        def bufs(n: int, healing: bool) -> list[torch.Tensor]:
            self._ft_n = n  # the contributing workers of this exchange
            holder["flat"] = payload(n, healing)
            return self._ft_buckets(holder["flat"])

        self._ft_session().exchange(bufs, lambda _b, healed: apply(holder["flat"], healed),
                                    step=self._local_steps, kind=kind or self.comm_kind)

    # ------------------------------------------------------------ live state
    def _ft_state(self) -> dict:
        """What a joiner receives (copies: the transport serves CPU tensors by reference)."""
        trainer = self.lightning_module.trainer
        schedulers = [c.scheduler.state_dict() for c in getattr(trainer, "lr_scheduler_configs", [])]
        return copy.deepcopy({
            "center": self._center.detach().clone(),
            "worker": self._worker_flat().detach().clone(),
            "optimizer": self.optimizers[0].state_dict() if self.optimizers else None,
            "local_steps": int(self._local_steps),
            "extra": self._worker_extra_state(),
            "schedulers": schedulers,
        })

    def _ft_load(self, state: dict) -> None:
        device, dtype = self.root_device, self._center.dtype
        self._center = state["center"].to(device=device, dtype=dtype)
        self._load_elastic(state["worker"].to(device=device, dtype=dtype))
        if state.get("optimizer") is not None and self.optimizers:
            self.optimizers[0].load_state_dict(state["optimizer"])
        self._local_steps = int(state["local_steps"])
        self._load_worker_extra_state(state.get("extra") or {})
        trainer = self.lightning_module.trainer
        for config, sd in zip(getattr(trainer, "lr_scheduler_configs", []), state.get("schedulers") or []):
            config.scheduler.load_state_dict(sd)

    # ------------------------------------------------------------ set-up and stop
    def _init_center(self) -> None:
        """Workers and centre start equal: the first exchange of a fresh run is the set-up
        broadcast; a restarted worker's first exchange is its rejoin (module doc)."""
        self._make_elastic_resident()
        x = self._elastic_flat()
        self._center = x.clone()

        def payload(n: int, healing: bool) -> torch.Tensor:
            # a fresh run: replica rank 0 sends its variable, the others zeros (x + 0 = x)
            if healing or self._ft_session().manager.participating_rank() == 0:
                return self._elastic_flat().clone()
            return torch.zeros_like(x)

        def apply(total: torch.Tensor, healed: bool) -> None:
            if healed:  # the survivors ran an ordinary exchange: apply it to the peer's state
                self._ft_apply_exchange(total, healed=True)
                return
            self._load_elastic(total)
            self._center = total.clone()

        self._ft_exchange(payload, apply, kind="setup")

    def _ft_total_steps(self) -> int | None:
        if self._ft_total is None:
            try:
                self._ft_total = int(self.lightning_module.trainer.estimated_stepping_batches)
            except Exception:  # no trainer / unknown length: Lightning's own end only
                self._ft_total = -1
        return self._ft_total if self._ft_total > 0 else None

    def _ft_stop_when_done(self) -> None:
        """A joiner's counters came from its peer: end where the others end."""
        total = self._ft_total_steps()
        if total is not None and self._local_steps >= total:
            self.lightning_module.trainer.should_stop = True

    def on_train_start(self) -> None:
        """A joiner healed at the run's last exchange (in set-up) trains no step beyond it:
        the stop is checked before the first step as well as after each."""
        super().on_train_start()
        self._ft_stop_when_done()

    def _ft_apply_exchange(self, total: torch.Tensor, healed: bool) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------ reporting, teardown
    def _ft_extras(self, extras: dict) -> dict:
        return {**extras, "ft": self._ft.report() if self._ft is not None else None}

    def teardown(self) -> None:
        super().teardown()
        if self._ft is not None:
            self._ft.shutdown()


class FTLocalSGDStrategy(_FTMixin, LocalSGDStrategy):
    """``local_sgd`` with each average a quorum step (module doc)."""

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._ft_stop_when_done()
        return out

    @torch.no_grad()
    def _average(self, tensors: list[torch.Tensor]) -> None:
        def payload(n: int, healing: bool) -> torch.Tensor:
            return self._elastic_flat().clone().div_(n)  # x_i / |Q|, as ft=none's x_i / p

        self._ft_exchange(payload, self._ft_apply_exchange)

    def _ft_apply_exchange(self, total: torch.Tensor, healed: bool) -> None:
        self._center = total.clone()
        self._load_elastic(total)
        if healed:  # the peer's state was taken inside its _end_round: finish that round here
            self._rounds += 1
            self._round_steps = 0
            self._current_period = None

    def summary_extras(self) -> dict:
        return self._ft_extras(super().summary_extras())


class FTSyncEASGDStrategy(_FTMixin, SyncEASGDStrategy):
    """``sync_easgd`` with each exchange a quorum step (module doc); blocking."""

    def _ft_init(self, ctx: FTContext) -> None:
        super()._ft_init(ctx)
        self.overlap = False

    def _validate_world(self, world_size: int) -> None:
        self._resolve_moving_rate(self._ft_world())  # alpha for the configured workers

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._ft_stop_when_done()
        return out

    def _exchange_step(self, take_step: Callable[..., Any], optimizer: Optimizer) -> Any:
        if not elastic.is_exchange_step(self._local_steps, self.tau):
            return take_step()
        out = self._step_forming_difference(take_step)
        diff = self._diff

        def payload(n: int, healing: bool) -> torch.Tensor:
            return diff.clone()

        self._ft_exchange(payload, self._ft_apply_exchange)
        return out

    @torch.no_grad()
    def _ft_apply_exchange(self, total: torch.Tensor, healed: bool) -> None:
        if healed:  # the peer's centre plus the exchange; a fresh explorer starts at the centre
            elastic.apply_center_update(self._center, total)
            self._load_elastic(self._center)
            return
        x = self._elastic_flat()
        elastic.apply_elastic_pull(x, self._diff)
        self._store_elastic(x)
        elastic.apply_center_update(self._center, total)

    def summary_extras(self) -> dict:
        extras = super().summary_extras()
        extras["beta"] = (self._alpha or 0) * self._ft_world()
        return self._ft_extras(extras)


class FTDDPStrategy(_FTMixin, CompressedDDPStrategy):
    """``ddp`` with every step a quorum step, torchft's own model.

    Dense gradients: start_quorum at the step's start (it completes during the forward and
    backward); each DDP bucket ``g <- sum_{i in Q} g_i / |Q|`` through the Manager (a
    joiner's bucket is zeroed); ``should_commit`` after the backward, before the update:
    not committed, the gradients are dropped (the optimizer skips parameters without a
    gradient) and the batch is lost, as in torchft's DDP. A joiner loads its peer's module,
    optimizer and counters inside ``should_commit`` of its first step and applies that
    step's averaged gradient, so it leaves the step equal to its peers.

    Compressed gradients (any compressor): the hook of ``ft=none``, its every collective
    on the step's quorum (:class:`~easgd_lightning.comm.managed.ManagedGroup`: the means
    are over ``|Q|``). The quorum is synchronous: a joiner receives its peer's module,
    optimizer, counters and hook state (``CompressionHookState.snapshot(shared_only=True)``:
    codec state such as PowerSGD's Q, step counters, all-gather capacities; not the peer's
    own error feedback, so the joiner's starts from zero) before its first step and takes
    part in that step like every member. The hook's state is copied
    before each step; a step that is not committed drops its gradients and returns the hook
    to that copy (residuals, codec state and counters as before the step).

    DDP is built with ``find_unused_parameters=True``, which keeps the reducer from
    rebuilding its buckets after the first step (a joiner's buckets would differ from its
    peers': torchft's DDP does the same).
    """

    def _ft_init(self, ctx: FTContext) -> None:
        super()._ft_init(ctx)
        self._ddp_kwargs["find_unused_parameters"] = True

    def _compressed(self) -> bool:
        return getattr(self._compression, "name", "none") != "none"

    def _ft_session(self) -> FTSession:
        if self._ft is None:
            self._ft = FTSession(self._ft_ctx, self._ft_state, self._ft_load, async_quorum=not self._compressed())
        return self._ft

    def _hook_group(self):
        return self._ft_session().group()

    def _register_ddp_hooks(self) -> None:
        if self._compressed():
            super()._register_ddp_hooks()
            return
        session = self._ft_session()

        def hook(_state, bucket):  # no annotations: DDP checks them against the real types
            fut = torch.futures.Future()
            fut.set_result(session.allreduce_mean(bucket.buffer(), "data_parallel"))
            return fut

        self.model.register_comm_hook(None, hook)

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        session = self._ft_session()
        session.start_step(self._local_steps + 1)
        hook = self.hook_state if self._compressed() else None
        before = hook.snapshot() if hook is not None else None

        def after_backward() -> None:
            if not session.commit_step():
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        p.grad = None
                if hook is not None:
                    hook.restore(before, self.root_device)

        out = super().optimizer_step(optimizer, _then(closure, after_backward), model, **kwargs)
        self._ft_stop_when_done()
        return out

    def _ft_state(self) -> dict:
        trainer = self.lightning_module.trainer
        return copy.deepcopy({
            "module": {k: v.detach().clone() for k, v in self.lightning_module.state_dict().items()},
            "optimizer": self.optimizers[0].state_dict() if self.optimizers else None,
            "local_steps": int(self._local_steps),
            "schedulers": [c.scheduler.state_dict() for c in getattr(trainer, "lr_scheduler_configs", [])],
            "hook": self.hook_state.snapshot(shared_only=True) if self._compressed() else None,
        })

    @torch.no_grad()
    def _ft_load(self, state: dict) -> None:
        if state.get("hook") is not None:
            self.hook_state.restore(state["hook"], self.root_device)
        self.lightning_module.load_state_dict(state["module"])
        if state.get("optimizer") is not None and self.optimizers:
            self.optimizers[0].load_state_dict(state["optimizer"])
        self._local_steps = int(state["local_steps"])
        trainer = self.lightning_module.trainer
        for config, sd in zip(getattr(trainer, "lr_scheduler_configs", []), state.get("schedulers") or []):
            config.scheduler.load_state_dict(sd)

    def summary_extras(self) -> dict:
        base = super().summary_extras() if hasattr(super(), "summary_extras") else {}
        return self._ft_extras(base)


class FTDiLoCoStrategy(_FTMixin, DiLoCoStrategy):
    """``diloco`` (one fragment, no delay, outer ``nesterov`` or ``average``) with each outer
    step a quorum step: ``u_i = x_i - theta`` (or ``x_i / |Q|`` when the outer step is the
    average) summed over the quorum; ``theta <- OuterOpt(theta, -sum u / |Q|)``, ``x_i <-
    theta`` -- the mean pseudo-gradient of the workers present. A joiner receives theta, the
    outer momentum, its peer's worker state and counters, and applies the outer step to
    them."""

    def _ft_init(self, ctx: FTContext) -> None:
        super()._ft_init(ctx)
        self._ft_deferred: tuple[torch.Tensor, int] | None = None

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._ft_stop_when_done()
        return out

    def _on_center_ready(self) -> None:
        super()._on_center_ready()
        if self._ft_deferred is not None:  # a joiner: its peer's outer step, now that theta's buffers exist
            total, n = self._ft_deferred
            self._ft_deferred = None
            self._ft_outer(total, n)
            self._synced_at[0] = self._local_steps
            self._syncs[0] += 1

    def _after_inner_step(self, step: int) -> None:
        if fragment_to_sync(step, self.tau, 1) is not None:
            self._ft_sync(step)

    def _ft_payload(self, n: int, healing: bool) -> torch.Tensor:
        x = self._elastic_flat()
        if self._averages:
            return x.clone().div_(n)
        return torch.sub(x, self._center)

    @torch.no_grad()
    def _ft_sync(self, step: int) -> None:
        def apply(total: torch.Tensor, healed: bool) -> None:
            self._ft_outer(total, self._ft_n)
            self._synced_at[0] = step
            self._syncs[0] += 1

        self._ft_exchange(self._ft_payload, apply)

    def _ft_apply_exchange(self, total: torch.Tensor, healed: bool) -> None:
        # only a joiner's set-up exchange comes here, before theta's buffers exist
        self._ft_deferred = (total.clone(), self._ft_n)

    @torch.no_grad()
    def _ft_outer(self, total: torch.Tensor, n: int) -> None:
        o = self.options
        theta = self._center
        if self._averages:
            theta.copy_(total)
        else:
            momentum = self._momentum
            outer_sgd_step(theta, momentum, total / -n, o["outer_lr"], o["outer_momentum"], o["outer_nesterov"])
        x = self._elastic_flat()
        merge_fragment(theta, x, o["fragment_update_alpha"])
        self._store_elastic(x)

    @torch.no_grad()
    def _finish(self) -> None:
        if self._synced_at[0] < self._local_steps:
            self._ft_sync(self._local_steps)

    def _ft_state(self) -> dict:
        state = super()._ft_state()
        state["momentum"] = None if self._momentum is None else self._momentum.detach().clone()
        return state

    def _ft_load(self, state: dict) -> None:
        super()._ft_load(state)  # theta into _center; synced_at / syncs into _restored
        self._restored = {**(self._restored or {}), "momentum": state.get("momentum")}
        if self._outer_buf is not None:  # (not in the set-up exchange) refresh the outer buffers
            self._outer_buf[0].copy_(self._center)
            self._center = self._outer_buf[0]
            if self._momentum is not None and state.get("momentum") is not None:
                self._momentum.copy_(state["momentum"])
            self._synced_at = list(self._restored.get("synced_at") or self._synced_at)
            self._syncs = list(self._restored.get("syncs") or self._syncs)

    def summary_extras(self) -> dict:
        return self._ft_extras(super().summary_extras())


_FT_CLASSES = {DiLoCoStrategy: FTDiLoCoStrategy, LocalSGDStrategy: FTLocalSGDStrategy, SyncEASGDStrategy: FTSyncEASGDStrategy,
               CompressedDDPStrategy: FTDDPStrategy}


def attach(strategy: Any, ctx: FTContext) -> Any:
    """Make the strategy built from the config its ``ft=torchft`` form (same options).

    Raises:
        ValueError: a strategy without one (the CLI refuses those before launch).
    """
    cls = _FT_CLASSES.get(type(strategy))
    if cls is None:
        raise ValueError(f"ft=torchft: strategy {type(strategy).__name__} has no fault-tolerant form")
    ft_strategy = cls.__new__(cls)  # the same object state, the ft=torchft methods
    ft_strategy.__dict__.update(strategy.__dict__)
    ft_strategy._ft_init(ctx)
    return ft_strategy
