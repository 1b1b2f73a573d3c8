"""Lightning Fabric: our strategies in a hand-written training loop.

``import easgd_lightning.fabric`` adds every strategy name to Fabric's ``STRATEGY_REGISTRY``,
so ``Fabric(strategy="sync_easgd")`` builds it with its defaults, as
``pl.Trainer(strategy="sync_easgd")`` does; :func:`strategy` builds one with options, the
same keyword arguments as the Trainer's strategy class (``compression`` may also be a
compressor's config name or a mapping of its ``compression.*`` keys)::

    import easgd_lightning.fabric as ef
    fabric = Fabric(accelerator="cpu", devices=2, strategy=ef.strategy("sync_easgd", tau=4))
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    for x, y in batches:
        optimizer.zero_grad()
        fabric.backward(loss_fn(model(x), y))
        optimizer.step()             # the exchange runs here, as in the Trainer
    fabric.strategy.finish()         # every rank: the module holds the center

What runs is the Trainer path's own code, not a copy:

* ``ddp_compressed`` (:class:`CompressedDDPFabricStrategy`): Fabric's DDP wrapper with the
  compression hook of :mod:`easgd_lightning.hooks.ddp`, registered, bound and counted by
  :class:`~easgd_lightning.strategies.ddp.CompressedDDPMixin` as ``CompressedDDPStrategy``
  does.
* the center strategies, ``sync_easgd``, ``local_sgd``, ``diloco`` and
  ``easgd_round_robin`` (:class:`CenterFabricStrategy`): the Trainer strategy object itself
  is the exchange (``fabric.strategy.exchange``). Fabric gives it the process group, the
  ranks and devices (:meth:`~easgd_lightning.strategies.base.CenterStrategy.attach_host`),
  the module and its optimizer, and ``optimizer.step()``; its
  :meth:`~easgd_lightning.strategies.base.CenterStrategy.exchange_step` runs the exchange
  around that step at the Trainer's points. In a Fabric loop the gradient is already
  computed when ``optimizer.step()`` is called, so what the Trainer runs right after the
  closure's backward (Sync EASGD's difference at the gradient's point) runs first; the
  arithmetic and its order are the Trainer's, so the parameters are bitwise the same.
  ``finish()`` is the Trainer's end of fit (local SGD's and DiLoCo's last partial round,
  the center loaded into the module); ``holding_center()`` swaps the center in for an
  evaluation, as the Trainer's validation does.
* refused, with one line naming why: the parameter-server family, the Hogwild strategies,
  ``pipeline_3d`` and the ``ft=torchft`` variants (each class's ``fabric_refusal``).

Not under Fabric: the center strategies' checkpoint state (``fabric.save`` saves this
worker's parameters; save inside ``holding_center()`` or after ``finish()`` for the
center) and ``local_sgd``'s QSR cap by the remaining steps (Fabric does not know the run's
length; the period is not capped).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

from lightning_fabric.strategies import STRATEGY_REGISTRY
from lightning_fabric.strategies import DDPStrategy as FabricDDPStrategy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from easgd_lightning.compat.lightning import drop_backward_sync_control
from easgd_lightning.hooks.compressors import build_compressor
from easgd_lightning.strategies.base import CenterStrategy, check_one_optimizer, open_comm
from easgd_lightning.strategies.ddp import CompressedDDPMixin, CompressedDDPStrategy
from easgd_lightning.strategies.registry import strategy_spec, strategy_specs

__all__ = [
    "CenterFabricStrategy",
    "CompressedDDPFabricStrategy",
    "FABRIC_OPTIONS",
    "fabric_refusal",
    "register_fabric_strategies",
    "strategy",
]

#: keyword arguments :func:`strategy` gives Fabric's ``DDPStrategy`` (the process group),
#: not the exchange
FABRIC_OPTIONS = ("process_group_backend", "timeout", "start_method")


def fabric_refusal(cls: type) -> str | None:
    """Why the strategy class ``cls`` does not run under Fabric, in one clause (None: it does):
    its ``fabric_refusal``; else, a class neither ``ddp_compressed`` nor a center strategy
    has no Fabric form."""
    why = getattr(cls, "fabric_refusal", None)
    if why is not None or issubclass(cls, (CompressedDDPStrategy, CenterStrategy)):
        return why
    return "it has no Fabric form (ddp_compressed and the center strategies have)"


def _refuse(name: str, why: str) -> ValueError:
    return ValueError(
        f"strategy={name} does not run under Lightning Fabric: {why}; "
        f"use pl.Trainer(strategy={name!r}) or easgd-train"
    )


def _compressor(compression: Any) -> Any:
    """A compressor object as it is; a config name or a mapping of ``compression.*`` keys
    (``name`` and its parameters) built by ``build_compressor``; None and ``none``: None
    (the dense exchange, as easgd-train builds ``compression=none``)."""
    if isinstance(compression, str):
        compression = {"name": compression}
    if isinstance(compression, Mapping):
        params = dict(compression)
        name = params.pop("name", "none")
        return None if name in (None, "none") else build_compressor(name, **params)
    return compression


class CompressedDDPFabricStrategy(CompressedDDPMixin, FabricDDPStrategy):
    """``ddp_compressed`` under Lightning Fabric: DDP whose gradient buckets go through our
    (optionally compressing) comm hook, on every device.

    Args:
        compression: a compressor from ``easgd_lightning.hooks.build_compressor`` or None.
        hook_options: extra keyword options for the hook (e.g. ``min_numel``, ``memory``).
        comm: the ``comm`` layout (``CommLayout`` or its options); None: the defaults.
        **kwargs: passed to Fabric's ``DDPStrategy`` and ``DistributedDataParallel``.
    """

    strategy_name = "ddp_compressed"

    def __init__(
        self, compression: Any = None, hook_options: dict | None = None, comm: Any = None, **kwargs: Any
    ) -> None:
        self._take_options(compression, hook_options, comm, kwargs, FabricDDPStrategy)
        super().__init__(**kwargs)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        open_comm(self._comm)

    @override
    def setup_module(self, module: Module) -> Module:
        """Wrap in DDP and register the hook (the SeCoPa plan under the working directory,
        the Trainer's default root)."""
        ddp = super().setup_module(module)
        self._register_hook(ddp, os.getcwd())
        return ddp

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        self._bind_compressor([optimizer], None)  # DGC: no epochs under Fabric
        return optimizer

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self._local_steps += 1
        return super().optimizer_step(optimizer, **kwargs)

    def finish(self) -> None:
        """End of training: nothing to finish (every step left the ranks equal)."""

    @override
    def teardown(self) -> None:
        self._comm.close()
        super().teardown()


class CenterFabricStrategy(FabricDDPStrategy):
    """A center strategy under Lightning Fabric: the Trainer strategy ``exchange`` runs its
    exchange around the loop's ``optimizer.step()``; no DDP wrapper (each rank trains its
    own copy).

    Args:
        exchange: the strategy object (``SyncEASGDStrategy(tau=4)``, ...), with its options.
        **kwargs: Fabric's ``DDPStrategy`` options (:data:`FABRIC_OPTIONS`).

    Raises:
        ValueError: the strategy does not run under Fabric (one line naming why).
    """

    def __init__(self, exchange: CenterStrategy, **kwargs: Any) -> None:
        if not isinstance(exchange, CenterStrategy):
            raise TypeError(
                f"CenterFabricStrategy runs a center strategy (sync_easgd, local_sgd, diloco, easgd_round_robin), "
                f"got {type(exchange).__name__}; ddp_compressed is CompressedDDPFabricStrategy"
            )
        why = fabric_refusal(type(exchange))
        if why is not None:
            raise _refuse(exchange.strategy_name, why)
        unknown = sorted(set(kwargs) - set(FABRIC_OPTIONS))
        if unknown:
            raise ValueError(
                f"CenterFabricStrategy: {unknown[0]} is not an option here; the exchange takes its "
                f"options, Fabric's DDPStrategy takes {', '.join(FABRIC_OPTIONS)}"
            )
        super().__init__(**kwargs)
        self.exchange = exchange
        drop_backward_sync_control(self)  # no gradient all-reduce to skip

    @property
    def strategy_name(self) -> str:
        return self.exchange.strategy_name

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.exchange.validate_world_size(self.world_size)
        self.exchange.attach_host(self.cluster_environment, self.parallel_devices)

    @override
    def setup_module(self, module: Module) -> Module:
        """No wrapper: the module's parameters are this rank's worker variable."""
        self.exchange.connect(module)
        return module

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], scheduler: Any = None):
        check_one_optimizer(self.exchange, len(optimizers))
        return super().setup_module_and_optimizers(module, optimizers, scheduler)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Start the exchange: workers and center made equal (broadcast from rank 0)."""
        if self.exchange.lightning_module is None:
            raise RuntimeError(
                f"{self.strategy_name}: set the module up first (fabric.setup(model, optimizer), or "
                "fabric.setup_module(model) before fabric.setup_optimizers(optimizer))"
            )
        check_one_optimizer(self.exchange, len(self.exchange.optimizers) + 1)
        self.exchange.optimizers = [optimizer]
        self.exchange.start_exchange()
        self.exchange.bind_compressor(None)  # no epochs under Fabric
        return optimizer

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        closure = kwargs.pop("closure", None)
        fabric_step = super().optimizer_step

        def step(c: Any) -> Any:
            return fabric_step(optimizer, **kwargs) if c is None else fabric_step(optimizer, closure=c, **kwargs)

        return self.exchange.exchange_step(optimizer, step, closure)

    def finish(self) -> None:
        """End of training, on every rank (the Trainer's end of fit): finish the exchange in
        flight, take the last partial round (local SGD, DiLoCo) and load the center into
        the module."""
        self.exchange.finish_exchange()

    def holding_center(self) -> AbstractContextManager[None]:
        """Inside, the module holds the center (every rank enters it): evaluate or save the
        consensus model mid-training."""
        return self.exchange.holding_center()

    @override
    def teardown(self) -> None:
        self.exchange.release_exchange()
        super().teardown()


def strategy(name: str, *, compression: Any = None, **options: Any) -> FabricDDPStrategy:
    """The Fabric strategy registered as ``name`` with ``options``.

    Args:
        name: a registry name (``pl.Trainer(strategy=name)``'s): ``ddp_compressed``,
            ``sync_easgd``, ``local_sgd``, ``diloco``, ``easgd_round_robin``.
        compression: a compressor, its config name (``"topk"``) or a mapping of its
            ``compression.*`` keys (``{"name": "topk", "ratio": 0.01}``); None: dense.
        **options: the strategy class's keyword arguments (``tau=4, alpha=0.1``, ...), and
            Fabric's :data:`FABRIC_OPTIONS`.

    Raises:
        ValueError: an unknown name (listing the names), a strategy Fabric cannot run
            (naming why), or a bad option (naming the key), each in one line.
    """
    cls = strategy_spec(name).cls
    why = fabric_refusal(cls)
    if why is not None:
        raise _refuse(name, why)
    compressor = _compressor(compression)
    if issubclass(cls, CompressedDDPStrategy):
        return CompressedDDPFabricStrategy(compression=compressor, **options)
    fabric_kw = {key: options.pop(key) for key in FABRIC_OPTIONS if key in options}
    return CenterFabricStrategy(cls(compression=compressor, **options), **fabric_kw)


def _refused(name: str, why: str) -> None:
    raise _refuse(name, why)


def register_fabric_strategies(registry: Any = STRATEGY_REGISTRY) -> None:
    """Add every registered strategy name to Fabric's ``registry`` (idempotent; names taken,
    e.g. Fabric's own ``ddp``, are left alone): those Fabric runs build :func:`strategy`
    with their defaults, the others raise their one-line refusal."""
    for name, spec in strategy_specs().items():
        if name in registry:
            continue
        why = fabric_refusal(spec.cls)
        factory = partial(strategy, name) if why is None else partial(_refused, name, why)
        registry.register(name, factory, description=spec.description)


register_fabric_strategies()
