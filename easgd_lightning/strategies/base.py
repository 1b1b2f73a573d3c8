"""Shared machinery for strategies that keep a center (consensus) variable.

:class:`CenterStrategy` is a Lightning ``DDPStrategy`` that does *not* wrap the module in
``DistributedDataParallel`` (no gradient all-reduce): each worker trains its own copy and a
subclass decides how workers and the center exchange information in ``optimizer_step``.

What the base provides:

* the elastic variable: every parameter plus floating-point buffers, as one flat vector
  ("single-layer communication", SC17). The vector is resident: at set-up the tensors
  become views of one contiguous buffer ("weights resident", SC17), so exchanges read and
  write the parameters in place, with no per-step flatten / unflatten copies
  (:meth:`CenterStrategy._elastic_flat`); when the tensors differ in dtype or device they
  stay separate and the flat vector is a copy;
* workers and center start equal (broadcast from rank 0);
* validation runs on the center (swapped in and out: the worker's flat buffer is stashed
  and the center copied into it), and after ``fit`` the user's module holds the center on
  every rank; an exchange still in flight (``strategy.overlap``) is finished first
  (:meth:`CenterStrategy._complete_exchange`) wherever the center is read;
* checkpoints: the module weights saved are the center; ``checkpoint["easgd"]`` holds the
  center, the step counter and every worker's parameters and optimizer state, so resuming
  restores each rank exactly;
* per-rank step counting for ``summary.json``;
* the exchange without the Trainer (Lightning Fabric, :mod:`easgd_lightning.fabric`), the
  seams the Trainer's hooks call too: :meth:`CenterStrategy.attach_host` (ranks, devices,
  ``comm`` sub-groups), :meth:`CenterStrategy.start_exchange` (its ``setup``),
  :meth:`CenterStrategy.exchange_step` (its ``optimizer_step``),
  :meth:`CenterStrategy.finish_exchange` (its ``on_train_end``),
  :meth:`CenterStrategy.holding_center` and :meth:`CenterStrategy.release_exchange`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from easgd_lightning.comm import ops
from easgd_lightning.comm.layout import CommLayout, build_comm_layout
from easgd_lightning.compat.lightning import PATH
from easgd_lightning.hooks.elastic import bind_exchange_compressor, check_exchange_compressor
from easgd_lightning.strategies import elastic
from easgd_lightning.strategies.registry import reject_unknown_kwargs
from easgd_lightning.utils.checkpoint import check_saved_world_size, from_plain, to_plain
from easgd_lightning.utils.checks import check_float, check_positive

log = logging.getLogger(__name__)

__all__ = [
    "CenterStrategy",
    "optimizer_steps_per_epoch",
    "flatten",
    "unflatten_into",
    "check_moving_rate",
    "check_one_optimizer",
    "comm_layout_for",
    "open_comm",
]


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors into one new flat vector."""
    return torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


@torch.no_grad()
def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (in place)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def _then(closure: Callable[[], Any], after: Callable[[], None]) -> Callable[[], Any]:
    """``closure`` followed, on its first call only, by ``after()``."""
    done = False

    def wrapped() -> Any:
        nonlocal done
        out = closure()
        if not done:
            done = True
            after()
        return out

    return wrapped


def check_moving_rate(alpha: Any, beta: Any, rho: Any) -> None:
    """``strategy.alpha`` and ``strategy.beta`` in (0, 1), ``strategy.rho`` > 0, each where
    given (None: not given; :func:`elastic.resolve_alpha` says which one counts)."""
    for key, value in (("strategy.alpha", alpha), ("strategy.beta", beta)):
        if value is not None:
            check_float(key, value, 0.0, 1.0, lo_open=True, hi_open=True)
    if rho is not None:
        check_positive("strategy.rho", rho)


def comm_layout_for(strategy: Any, comm: Any, compression: Any) -> CommLayout:
    """The strategy's ``comm`` layout (:class:`CommLayout`, its keyword dict, or None for
    the defaults). ``comm.hierarchy=node`` applies where the strategy's exchange is a dense
    all-reduce (``hierarchical`` class attribute) and nothing compresses it; elsewhere the
    run goes on flat, with a warning (so a recipe that asks for it still composes with any
    strategy and compression in a sweep).

    Raises:
        ValueError: a bad value, naming the ``comm.`` key.
    """
    layout = build_comm_layout(comm)
    if layout.hierarchy == "flat":
        return layout
    name = getattr(strategy, "strategy_name", "") or type(strategy).__name__
    why = None
    if not getattr(strategy, "hierarchical", False):
        why = f"strategy={name} has no dense all-reduce to reduce per node (ddp, sync_easgd, local_sgd have)"
    elif compression is not None and getattr(compression, "name", None) != "none":
        why = f"compression={getattr(compression, 'name', compression)} sends payloads, not the dense all-reduce"
    if why is None:
        return layout
    rank_zero_warn(f"comm.hierarchy={layout.hierarchy} does not apply here ({why}): reducing flat")
    return CommLayout(fusion_mb=layout.fusion_mb, hierarchy="flat", procs_per_node=layout.procs_per_node,
                      allreduce=layout.allreduce, aggregator=layout.aggregator)


def open_comm(layout: CommLayout) -> None:
    """Once the process group is up: close it at exit, make the ``comm`` sub-groups."""
    ops.close_process_group_at_exit()
    layout.setup()


def check_one_optimizer(strategy: Any, count: int) -> None:
    """Refuse anything but one optimizer, in one line saying what is allowed."""
    if count != 1:
        name = getattr(strategy, "strategy_name", "") or type(strategy).__name__
        raise ValueError(
            f"strategy={name} drives exactly one optimizer, but configure_optimizers returned "
            f"{count}: return one optimizer (parameter groups may differ in lr and weight decay), "
            "or use strategy=ddp"
        )


def optimizer_steps_per_epoch(trainer) -> int | None:
    """ceil(training batches / accumulate_grad_batches), None when the epoch length is unknown."""
    batches = getattr(trainer, "num_training_batches", None)
    if batches is None or not math.isfinite(batches) or batches <= 0:
        return None
    return math.ceil(int(batches) / max(1, int(getattr(trainer, "accumulate_grad_batches", 1))))


class CenterStrategy(DDPStrategy):
    """Base of the strategies whose deliverable is a center variable.

    Subclasses implement :meth:`_exchange_step` (called around every optimizer step).
    """

    strategy_name = ""
    #: traffic class for the meter
    comm_kind = "elastic"
    #: the exchange is a dense all-reduce that ``comm.hierarchy=node`` may reduce per node
    hierarchical = False
    #: fewest processes the strategy needs (elastic averaging needs two workers)
    min_world_size = 2
    #: optimizers ``configure_optimizers`` may return: the exchange is tied to one optimizer
    #: step (checked in ``setup`` and, for the CLI, before launch)
    max_optimizers = 1
    #: manual optimization (``automatic_optimization = False``) is honoured: the exchange
    #: runs inside ``optimizer.step()``, which the user's ``training_step`` calls
    supports_manual_optimization = True
    #: why ``easgd_lightning.fabric`` refuses the strategy, in one clause (None: it runs
    #: under Lightning Fabric, its exchange driven by a hand-written loop's optimizer step)
    fabric_refusal: str | None = None
    #: alpha = lr * rho from the optimizer's lr: checked with optim.lr before launch
    #: (:meth:`check_optimizer_lr`)
    alpha_from_lr = False

    @classmethod
    def check_optimizer_lr(cls, options: Any, world_size: int, lr: float) -> None:
        """Raise ValueError (one line naming the key) when the strategy options ``options``
        (``alpha``, ``beta``, ``rho``) give no valid alpha with the optimizer's ``lr`` on
        ``world_size`` workers; nothing to check unless ``alpha_from_lr``."""
        if cls.alpha_from_lr:
            elastic.resolve_alpha(world_size=world_size, alpha=options.get("alpha"), beta=options.get("beta"),
                                  rho=options.get("rho"), lr=lr)

    def __init__(self, *, compression: Any = None, comm: Any = None, **kwargs: Any) -> None:
        reject_unknown_kwargs(self, kwargs, DDPStrategy)  # no DDP wrapper would read them
        kwargs.setdefault("process_group_backend", None)
        super().__init__(**kwargs)
        check_exchange_compressor(compression, self.strategy_name)  # e.g. sgc: gradients only
        self._compression = compression
        #: the ``comm`` group: lazy all-reduce buckets, hierarchical reduction
        self._comm = comm_layout_for(self, comm, compression)
        self._center: torch.Tensor | None = None
        self._stash: torch.Tensor | None = None
        self._local_steps = 0
        self._resume_state: dict | None = None
        #: the resident elastic buffer the tensors are views of (None: not resident)
        self._flat: torch.Tensor | None = None
        self._flat_ptrs: list[int] = []

    # ------------------------------------------------------------------ set-up
    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        open_comm(self._comm)

    @override
    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: workers train independent copies (and the
        DDP hook registration Lightning calls from here never runs)."""

    @override
    def setup(self, trainer) -> None:
        super().setup(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        self.start_exchange()

    def start_exchange(self) -> None:
        """Start the exchange once the module and its one optimizer are set (the Trainer's
        ``setup`` when fitting; :mod:`easgd_lightning.fabric` at ``fabric.setup``): the
        options that depend on the world size, then workers and center made equal.

        Raises:
            ValueError: anything but one optimizer, or options the world size rules out.
        """
        check_one_optimizer(self, len(self.optimizers))
        self._validate_world(self.world_size)
        self._init_center()
        self._on_center_ready()

    def attach_host(self, cluster_environment: Any, parallel_devices: list[torch.device]) -> None:
        """Run this strategy's exchange in a loop the Trainer does not drive (Lightning
        Fabric's, :mod:`easgd_lightning.fabric`) whose process group is up: take the host's
        ranks and devices, then make what ``setup_environment`` makes after the process
        group. Next the host gives the module (``connect(module)``) and its optimizer
        (``optimizers = [opt]``), then calls :meth:`start_exchange`."""
        self.cluster_environment = cluster_environment
        self.parallel_devices = parallel_devices
        open_comm(self._comm)

    def _init_center(self) -> None:
        """Start workers and center equal: the resident elastic variable broadcast from rank 0,
        or every rank's own state restored from the checkpoint being resumed."""
        self._make_elastic_resident()
        tensors = self._elastic_tensors()
        if self._resume_state is None:
            flat = self._elastic_flat()
            ops.broadcast(flat, src=0, kind="setup")
            self._store_elastic(flat)
            self._center = flat.clone()
        else:
            state = self._resume_state
            self._center = state["center"].to(device=self.root_device, dtype=tensors[0].dtype)
            worker = state["workers"][self.global_rank]
            unflatten_into(worker["flat"].to(self.root_device), tensors)
            self._local_steps = int(state["steps"][self.global_rank])
            self._load_extra_state(state.get("extra", {}))
            self._load_worker_extra_state(worker.get("extra", {}))

    def _validate_world(self, world_size: int) -> None:
        """Check options that depend on the world size (e.g. beta = p * alpha < 1)."""

    def validate_world_size(self, world_size: int) -> None:
        """Before launch: at least ``min_world_size`` processes (subclasses check more)."""
        if world_size < self.min_world_size:
            raise ValueError(
                f"trainer.devices: {self.strategy_name} needs at least {self.min_world_size} processes, got {world_size}"
            )

    @override
    def on_train_start(self) -> None:
        """The compressor learns it serves an elastic exchange (DGC: no gradient rules, its
        warm-up in this rank's optimizer steps and the Trainer's epochs)."""
        super().on_train_start()
        self.bind_compressor(optimizer_steps_per_epoch(self.lightning_module.trainer))

    def bind_compressor(self, steps_per_epoch: int | None) -> None:
        """Tell the compressor it serves an elastic exchange of ``steps_per_epoch`` optimizer
        steps an epoch (None: unknown), counting its steps in this rank's; warns what it says."""
        for note in bind_exchange_compressor(self._compression, steps_per_epoch, lambda: self._local_steps - 1):
            rank_zero_warn(note)

    def _set_moving_rate_options(self, alpha: float | None, beta: float | None, rho: float | None) -> None:
        """Store and range-check the moving-rate options (exactly one may be given)."""
        check_moving_rate(alpha, beta, rho)
        self._alpha_opt, self._beta_opt, self._rho_opt = alpha, beta, rho
        self._alpha: float | None = None

    def _resolve_moving_rate(self, world_size: int) -> float:
        """alpha for ``world_size`` workers (see :func:`elastic.resolve_alpha`)."""
        self._alpha = elastic.resolve_alpha(
            world_size=world_size,
            alpha=self._alpha_opt,
            beta=self._beta_opt,
            rho=self._rho_opt,
            lr=self._optimizer_lr(self.optimizers[0]) if self.optimizers else None,
        )
        return self._alpha

    def _on_center_ready(self) -> None:
        """Hook for subclasses: called once the center and workers are initialised."""

    def _elastic_tensors(self) -> list[torch.Tensor]:
        module = self.lightning_module
        params = [p for p in module.parameters()]
        buffers = [b for b in module.buffers() if b.is_floating_point()]
        return params + buffers

    # ------------------------------------------------------------------ resident buffer
    @torch.no_grad()
    def _make_elastic_resident(self) -> None:
        """Turn the elastic tensors into views of one new contiguous buffer (their values
        copied in). Parameters keep their identity (the optimizer's references stay
        valid); only their storage moves. Skipped when dtypes or devices differ or a
        tensor is not contiguous (channels-last weights keep their layout)."""
        tensors = self._elastic_tensors()
        if not tensors or any(
            t.dtype != tensors[0].dtype or t.device != tensors[0].device or not t.is_contiguous()
            for t in tensors
        ):
            self._flat, self._flat_ptrs = None, []
            return
        flat = torch.empty(
            sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device
        )
        offset = 0
        for t in tensors:
            n = t.numel()
            view = flat[offset : offset + n].view(t.shape)
            view.copy_(t)
            t.data = view
            offset += n
        self._flat = flat
        self._flat_ptrs = [t.data_ptr() for t in tensors]

    def _resident(self) -> bool:
        """True while every elastic tensor is still a view of the resident buffer (code that
        re-assigns a parameter's ``.data`` ends residency; the copying path takes over)."""
        if self._flat is None:
            return False
        if [t.data_ptr() for t in self._elastic_tensors()] != self._flat_ptrs:
            log.warning("elastic tensors are no longer views of the resident buffer; copying")
            self._flat, self._flat_ptrs = None, []
            return False
        return True

    def _elastic_flat(self) -> torch.Tensor:
        """This worker's elastic variable as one flat vector: the resident buffer itself
        (writes go to the parameters) or, when not resident, a new copy."""
        if self._resident():
            return self._flat
        return flatten(self._elastic_tensors())

    def _store_elastic(self, x: torch.Tensor) -> None:
        """Make ``x`` (from :meth:`_elastic_flat`, changed in place) the elastic variable;
        nothing to do when it is the resident buffer."""
        if x is not self._flat or not self._resident():
            unflatten_into(x, self._elastic_tensors())

    @torch.no_grad()
    def _load_elastic(self, src: torch.Tensor) -> None:
        """Copy the flat vector ``src`` into the elastic variable."""
        if self._resident():
            self._flat.copy_(src)
        else:
            unflatten_into(src, self._elastic_tensors())

    @torch.no_grad()
    def _copy_elastic(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the elastic variable into the flat buffer ``out``; returns ``out``."""
        if self._resident():
            return out.copy_(self._flat)
        offset = 0
        for t in self._elastic_tensors():
            n = t.numel()
            out[offset : offset + n].copy_(t.detach().reshape(-1))
            offset += n
        return out

    def _worker_flat(self) -> torch.Tensor:
        """This worker's own variable (even while the center is swapped in)."""
        if self._stash is not None:
            return self._stash.clone()
        x = self._elastic_flat()
        return x.clone() if x is self._flat else x

    @property
    def center(self) -> torch.Tensor | None:
        """The flat center vector as this rank knows it."""
        return self._center

    @property
    def local_steps(self) -> int:
        """Optimizer steps this rank has taken."""
        return self._local_steps

    def _fetch_center(self) -> None:
        """Make ``self._center`` current on this rank (no-op when it is replicated)."""

    def _complete_exchange(self) -> None:
        """Finish an exchange still in flight, so that the center (and the worker state)
        is current; no-op when nothing is pending (the default: blocking exchanges)."""

    def _drop_exchange(self) -> None:
        """Forget an exchange still in flight without waiting (teardown after a failure)."""

    # ------------------------------------------------------------------ training
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model=None,
        **kwargs: Any,
    ) -> Any:
        step = super().optimizer_step
        return self.exchange_step(optimizer, lambda c: step(optimizer, c, model, **kwargs), closure)

    def exchange_step(
        self, optimizer: Optimizer, step: Callable[[Callable[[], Any] | None], Any], closure: Callable[[], Any] | None
    ) -> Any:
        """One optimizer step with the strategy's exchange around it (:meth:`_exchange_step`).

        Args:
            optimizer: the optimizer stepping.
            step: ``step(closure)`` runs the optimizer's own step with ``closure`` (the
                Trainer's: through its precision plugin; Fabric's: ``optimizer.step``).
            closure: the forward and backward (the Trainer's), or None where the gradient is
                already computed when the step is called (a Fabric loop's
                ``fabric.backward(loss)``; then what must follow the backward runs first).
        """
        self._local_steps += 1

        def take_step(after_closure: Callable[[], None] | None = None) -> Any:
            if after_closure is None:
                return step(closure)
            if closure is None:  # the backward has run: the parameters are at the gradient's point
                after_closure()
                return step(None)
            return step(_then(closure, after_closure))

        return self._exchange_step(take_step, optimizer)

    def _exchange_step(self, take_step: Callable[..., Any], optimizer: Optimizer) -> Any:
        """Run ``take_step()`` (the optimizer's own step) and the strategy's exchange.

        ``take_step(after_closure=fn)`` runs ``fn()`` once, right after the closure's
        forward and backward and before the optimizer updates the parameters (they are
        still the point at which the gradient was computed).
        """
        raise NotImplementedError

    def _optimizer_lr(self, optimizer: Optimizer) -> float:
        return float(optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ center swaps
    def _swap_in(self) -> None:
        """Stash the worker's variable and copy the center into it."""
        if self._center is None or self._stash is not None:
            return
        self._complete_exchange()
        self._fetch_center()
        self._stash = self._worker_flat()
        self._load_elastic(self._center)

    def _swap_out(self) -> None:
        if self._stash is None:
            return
        self._load_elastic(self._stash)
        self._stash = None

    @contextmanager
    def holding_center(self) -> Iterator[None]:
        """Inside, the module holds the center (the worker's own variable is stashed and put
        back after): evaluate or save the consensus model mid-training. Every rank enters
        it together (a strategy may fetch the center with a collective)."""
        swapped = self._stash is not None
        if not swapped:
            self._swap_in()
        try:
            yield
        finally:
            if not swapped:
                self._swap_out()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self._swap_in()

    @override
    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            self._swap_out()

    @override
    def on_train_end(self) -> None:
        """The deliverable: the user's module holds the center on every rank."""
        super().on_train_end()
        self.finish_exchange()

    def finish_exchange(self) -> None:
        """End of training (every rank): finish what is in flight and load the center into
        the module (subclasses first take their last partial round)."""
        if self._center is not None:
            self._complete_exchange()
            self._swap_out()
            self._fetch_center()
            self._load_elastic(self._center)

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module weights in a checkpoint are the center's."""
        if self._center is None:
            return super().lightning_module_state_dict()
        self._complete_exchange()
        self._fetch_center()
        swapped = self._stash is not None
        if not swapped:
            self._swap_in()
        try:
            return {k: v.detach().clone() for k, v in self.lightning_module.state_dict().items()}
        finally:
            if not swapped:
                self._swap_out()

    def _extra_state(self) -> dict:
        """Global subclass state to checkpoint, taken from rank 0 (e.g. a server's state)."""
        return {}

    def _load_extra_state(self, state: dict) -> None:
        """Restore what :meth:`_extra_state` saved."""

    def _worker_extra_state(self) -> dict:
        """Per-rank subclass state to checkpoint (e.g. error-feedback residuals)."""
        return {}

    def _load_worker_extra_state(self, state: dict) -> None:
        """Restore what :meth:`_worker_extra_state` saved on this rank."""

    def _compression_state(self) -> dict:
        """The compressed exchange's per-rank state (error-feedback memory, the codec's state
        across steps, the compressor's own), for the strategies that compress their exchange
        (they keep ``self._memory`` and ``self._compress_state``)."""
        mem = self._memory.state_dict() if hasattr(self._memory, "state_dict") else None
        comp = None if self._compression is None else self._compression.state_dict()
        return {"memory": mem, "compress_state": self._compress_state, "compressor": comp}

    def _load_compression_state(self, state: dict) -> None:
        """Restore what :meth:`_compression_state` saved on this rank."""
        self._compress_state = from_plain(state.get("compress_state") or {}, self.root_device)
        if self._compression is not None:
            self._compression.load_state_dict(from_plain(state.get("compressor") or {}))
        mem = state.get("memory")
        if mem is not None and hasattr(self._memory, "load_state_dict"):
            self._memory.load_state_dict(from_plain(mem, self.root_device))

    def _gather_worker_states(self) -> list[dict]:
        """Every rank's parameters, optimizer state and extra state (tensors and plain data)."""
        mine = to_plain(
            {
                "flat": self._worker_flat(),
                "optimizer": self.optimizers[0].state_dict() if self.optimizers else None,
                "extra": self._worker_extra_state(),
            },
            f"{self.strategy_name} worker state",
        )
        if not dist.is_available() or not dist.is_initialized():
            return [mine]
        return ops.all_gather_object(mine)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: PATH, storage_options: Any | None = None
    ) -> None:
        """Add :meth:`_checkpoint_state` as ``checkpoint["easgd"]``, then write atomically on rank 0."""
        state = self._checkpoint_state() if self._center is not None else None
        if state is not None:
            checkpoint["easgd"] = state
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _checkpoint_state(self) -> dict | None:
        """``checkpoint["easgd"]``: the center, every worker's state and step count (gathered
        from every rank: all ranks call this), the subclass's extra state."""
        self._complete_exchange()
        workers = self._gather_worker_states()
        steps = ops.all_gather_object(self._local_steps) if dist.is_initialized() else [self._local_steps]
        return {
            "strategy": self.strategy_name,
            "center": self._center.detach().cpu().clone(),
            "workers": workers,
            "steps": steps,
            "world_size": self.world_size,
            "extra": to_plain(self._extra_state(), f"{self.strategy_name} state"),
        }

    @override
    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        easgd = checkpoint.get("easgd")
        if easgd is None:
            return
        check_saved_world_size(easgd, self.world_size)
        self._resume_state = easgd

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        easgd = checkpoint.get("easgd")
        if easgd is None:
            return super().load_optimizer_state_dict(checkpoint)
        own = easgd["workers"][self.global_rank]["optimizer"]
        if own is not None:
            self.optimizers[0].load_state_dict(own)

    # ------------------------------------------------------------------ reporting
    def summary_extras(self) -> dict:
        """Strategy-specific fields for summary.json."""
        return {}

    @override
    def teardown(self) -> None:
        self.release_exchange()
        super().teardown()

    def release_exchange(self) -> None:
        """Drop the exchange's state and sub-groups (after a failure too: on success
        :meth:`finish_exchange` has finished what was in flight)."""
        self._drop_exchange()
        self._stash = None
        self._flat, self._flat_ptrs = None, []
        self._comm.close()
