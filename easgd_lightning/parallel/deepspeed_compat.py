"""Every use of DeepSpeed's private pipeline-engine API, in one place, checked.

:class:`~easgd_lightning.parallel.engine.OptimusPipelineEngine` replaces the pipeline
instructions that communicate. DeepSpeed offers no public hook for that: its
``PipelineEngine`` runs each schedule instruction through the private class table
``_INSTRUCTION_MAP`` (instruction type -> private ``_exec_*`` method) and aggregates the
training loss in the private ``_aggregate_total_loss``. :class:`PipelineEngineHooks`
overrides exactly those private names and forwards each to a public method of ours
(:data:`HOOKS`); nothing else in the package names a private DeepSpeed attribute.

The private API moves between DeepSpeed releases, so :func:`check_deepspeed` compares it
with what this module relies on -- every overridden method exists with the parameters
DeepSpeed calls it with, the instruction table still maps the instructions to them, and the
engine still calls them -- and raises :class:`DeepSpeedCompatError` naming the method and
the installed version. It runs when this module is imported (so before any engine is
built); :func:`check_engine_state` checks the engine's internal state after it is built.

Checked against DeepSpeed :data:`CHECKED_AGAINST` (range :data:`CHECKED_RANGE`); another
version passes if the checks pass, with a warning in the log.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

try:
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine as _DeepSpeedEngine
    from deepspeed.runtime.pipe import schedule as _schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine as _PipelineEngine
except Exception as exc:  # pragma: no cover - DeepSpeed is a hard dependency
    raise ImportError(f"easgd_lightning.parallel needs deepspeed for pipeline_3d: {exc}") from exc

__all__ = [
    "CHECKED_AGAINST",
    "CHECKED_RANGE",
    "PRIVATE_METHODS",
    "INSTRUCTIONS",
    "HOOKS",
    "ENGINE_STATE",
    "DeepSpeedCompatError",
    "PipelineEngineHooks",
    "check_deepspeed",
    "check_engine_state",
    "construct_engine",
    "installed_version",
    "skip_shm_op_build",
]

log = logging.getLogger(__name__)

#: the DeepSpeed release every check below was written against
CHECKED_AGAINST = "0.19.8"
#: releases this adapter is known to work with: ``low <= version < high`` (pyproject.toml pins the same)
CHECKED_RANGE = ("0.19.0", "0.20.0")

#: private ``PipelineEngine`` methods overridden, and their parameters after ``self``
#: (exactly: DeepSpeed calls them with these, e.g. ``**instruction.kwargs``)
PRIVATE_METHODS: dict[str, tuple[str, ...]] = {
    "_exec_schedule": ("pipe_schedule",),
    "_exec_send_activations": ("buffer_id",),
    "_exec_recv_activations": ("buffer_id",),
    "_exec_send_grads": ("buffer_id",),
    "_exec_recv_grads": ("buffer_id",),
    "_exec_reduce_tied_grads": (),
    "_exec_reduce_grads": (),
    "_aggregate_total_loss": (),
}

#: schedule instruction (``deepspeed.runtime.pipe.schedule``) -> the private method that
#: ``PipelineEngine._INSTRUCTION_MAP`` runs it with
INSTRUCTIONS: dict[str, str] = {
    "SendActivation": "_exec_send_activations",
    "RecvActivation": "_exec_recv_activations",
    "SendGrad": "_exec_send_grads",
    "RecvGrad": "_exec_recv_grads",
    "ReduceTiedGrads": "_exec_reduce_tied_grads",
    "ReduceGrads": "_exec_reduce_grads",
}

#: the public method of :class:`PipelineEngineHooks` each private method forwards to
HOOKS: dict[str, str] = {
    "_exec_schedule": "start_schedule",
    "_exec_send_activations": "send_activations",
    "_exec_recv_activations": "recv_activations",
    "_exec_send_grads": "send_grads",
    "_exec_recv_grads": "recv_grads",
    "_exec_reduce_tied_grads": "reduce_tied_grads",
    "_exec_reduce_grads": "reduce_grads",
    "_aggregate_total_loss": "aggregate_total_loss",
}

#: private methods DeepSpeed must still call from where (else an override is silently dead)
CALLERS: dict[str, tuple[str, ...]] = {
    "_exec_schedule": ("train_batch", "eval_batch"),
    "_aggregate_total_loss": ("train_batch",),
}

#: other private names used: the loss scaling called (parameters relied on, then optional
#: ones allowed), and the flag ``is_gradient_accumulation_boundary`` reads
CALLED_METHODS: dict[str, tuple[str, ...]] = {"_scale_loss_by_gas": ("prescaled_loss",)}
BOUNDARY_FLAG = "_force_grad_boundary"

#: ``DeepSpeedEngine.__init__`` keywords :func:`construct_engine` passes
ENGINE_INIT_KEYWORDS = (
    "args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
    "mpu", "dist_init_required", "collate_fn", "config", "config_class",
)

#: internal (undocumented) engine state the overrides read or write, set by its ``__init__``
ENGINE_STATE = (
    "pipe_buffers", "first_output_send", "pipe_recv_buf", "grad_layer", "total_loss",
    "dp_group_loss", "agg_additional_losses", BOUNDARY_FLAG,
)


class DeepSpeedCompatError(RuntimeError):
    """The installed DeepSpeed's private pipeline API differs from what this adapter uses."""


def installed_version() -> str:
    return str(getattr(deepspeed, "__version__", "unknown"))


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def in_checked_range(version: str) -> bool:
    low, high = (_version_tuple(v) for v in CHECKED_RANGE)
    return low <= _version_tuple(version) < high


def _fail(what: str) -> DeepSpeedCompatError:
    return DeepSpeedCompatError(
        f"DeepSpeed {installed_version()}: {what}; easgd_lightning's pipeline engine "
        f"(parallel/deepspeed_compat.py) was checked against DeepSpeed {CHECKED_AGAINST} "
        f"(>={CHECKED_RANGE[0]},<{CHECKED_RANGE[1]})"
    )


def _parameters(func: Any) -> list[inspect.Parameter]:
    return list(inspect.signature(func).parameters.values())[1:]  # after self


def check_private_method(name: str, expected: tuple[str, ...], *, exact: bool = True) -> None:
    """``PipelineEngine.<name>`` exists and takes ``expected`` (exactly, or as its leading
    parameters with every further one optional when ``exact`` is False)."""
    func = getattr(_PipelineEngine, name, None)
    if not callable(func):
        raise _fail(f"PipelineEngine.{name} is missing")
    params = _parameters(func)
    names = tuple(p.name for p in params)
    extra_required = [p.name for p in params[len(expected):] if p.default is inspect.Parameter.empty
                      and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if (names != expected) if exact else (names[: len(expected)] != expected or extra_required):
        raise _fail(f"PipelineEngine.{name} takes ({', '.join(names)}), expected ({', '.join(expected)})")


def check_deepspeed() -> None:
    """Compare the installed DeepSpeed's private pipeline API with what the adapter uses.

    Raises:
        DeepSpeedCompatError: naming the first method, instruction or caller that differs.
    """
    for name, params in PRIVATE_METHODS.items():
        check_private_method(name, params)
    for name, params in CALLED_METHODS.items():
        check_private_method(name, params, exact=False)
    table = getattr(_PipelineEngine, "_INSTRUCTION_MAP", None)
    if not isinstance(table, dict):
        raise _fail("PipelineEngine._INSTRUCTION_MAP (instruction -> method table) is missing")
    for instruction, method in INSTRUCTIONS.items():
        kind = getattr(_schedule, instruction, None)
        if kind is None:
            raise _fail(f"deepspeed.runtime.pipe.schedule.{instruction} is missing")
        if table.get(kind) is not getattr(_PipelineEngine, method):
            raise _fail(f"PipelineEngine._INSTRUCTION_MAP no longer runs {instruction} with {method}")
    for method, callers in CALLERS.items():
        for caller in callers:
            if method not in getattr(_PipelineEngine, caller).__code__.co_names:
                raise _fail(f"PipelineEngine.{caller} no longer calls {method}")
    if BOUNDARY_FLAG not in _PipelineEngine.is_gradient_accumulation_boundary.__code__.co_names:
        raise _fail(f"PipelineEngine.is_gradient_accumulation_boundary no longer reads {BOUNDARY_FLAG}")
    init = {p.name for p in _parameters(_DeepSpeedEngine.__init__)}
    missing = [k for k in ENGINE_INIT_KEYWORDS if k not in init]
    if missing:
        raise _fail(f"DeepSpeedEngine.__init__ takes no {', '.join(missing)}")
    for func in ("shutdown_init_context", "restore_init_context"):
        if not callable(getattr(deepspeed.zero.partition_parameters, func, None)):
            raise _fail(f"deepspeed.zero.partition_parameters.{func} is missing")
    if not callable(getattr(deepspeed, "set_optimizer_flags", None)):
        raise _fail("deepspeed.set_optimizer_flags is missing")
    _shm_module()  # raises if the shared-memory op's builder moved
    if not in_checked_range(installed_version()):
        log.warning(
            "DeepSpeed %s is outside the range the pipeline adapter was checked against "
            "(>=%s,<%s); its private-API checks passed", installed_version(), *CHECKED_RANGE,
        )


def _shm_module() -> Any:
    """``deepspeed.comm.torch`` (imported by name: as an attribute of ``deepspeed.comm`` it
    is the torch package), after checking that its ``TorchBackend`` builds the
    shared-memory op through the module-level ``build_shm_op()``."""
    module = importlib.import_module("deepspeed.comm.torch")
    build = getattr(module, "build_shm_op", None)
    if not callable(build) or _parameters(build):
        raise _fail("deepspeed.comm.torch.build_shm_op() is missing or takes arguments")
    backend = getattr(module, "TorchBackend", None)
    if backend is None or "build_shm_op" not in backend.__init__.__code__.co_names:
        raise _fail("deepspeed.comm.torch.TorchBackend.__init__ no longer calls build_shm_op")
    return module


def skip_shm_op_build() -> None:
    """On CPU, DeepSpeed's communication backend JIT-compiles a shared-memory all-reduce op
    (``deepspeed_shm_comm``, C++, ~20 s once per machine) used only by its
    ``inference_all_reduce``; nothing here calls that (every collective of the pipeline is
    torch.distributed's on gloo groups). Make ``build_shm_op`` return None, DeepSpeed's own
    answer when the op cannot be built, so the backend falls back to torch.distributed."""
    _shm_module().build_shm_op = lambda: None


def check_engine_state(engine: Any) -> None:
    """After ``PipelineEngine.__init__``: the internal state the overrides use exists."""
    missing = [name for name in ENGINE_STATE if not hasattr(engine, name)]
    if missing:
        raise _fail(f"PipelineEngine instances have no {', '.join(missing)}")


check_deepspeed()  # at import: before any engine is built


class PipelineEngineHooks(_PipelineEngine):
    """DeepSpeed's ``PipelineEngine`` with its private communication steps forwarded to
    public methods (:data:`HOOKS`); each defaults to DeepSpeed's own behaviour, so this
    class alone runs exactly like ``PipelineEngine``. Subclasses override the hooks."""

    # ------------------------------------------------------------------ hooks (public)

    def start_schedule(self) -> None:
        """Called before each schedule (one ``train_batch`` / ``eval_batch``) runs."""

    def send_activations(self, buffer_id: int) -> None:
        _PipelineEngine._exec_send_activations(self, buffer_id)

    def recv_activations(self, buffer_id: int) -> None:
        _PipelineEngine._exec_recv_activations(self, buffer_id)

    def send_grads(self, buffer_id: int) -> None:
        _PipelineEngine._exec_send_grads(self, buffer_id)

    def recv_grads(self, buffer_id: int) -> None:
        _PipelineEngine._exec_recv_grads(self, buffer_id)

    def reduce_tied_grads(self) -> None:
        _PipelineEngine._exec_reduce_tied_grads(self)

    def reduce_grads(self) -> None:
        """Reduce the gradients; runs inside :meth:`gradient_boundary`."""
        _PipelineEngine._exec_reduce_grads(self)

    def aggregate_total_loss(self) -> torch.Tensor:
        return _PipelineEngine._aggregate_total_loss(self)

    # ------------------------------------------------------------------ private state

    def scale_loss_by_micro_batches(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` divided by the micro-batches per step (DeepSpeed's ``_scale_loss_by_gas``)."""
        return self._scale_loss_by_gas(loss)

    @contextmanager
    def gradient_boundary(self) -> Iterator[None]:
        """Make ``is_gradient_accumulation_boundary()`` true inside (DeepSpeed's
        ``_force_grad_boundary``, as its own ``_exec_reduce_grads`` sets it)."""
        self._force_grad_boundary = True
        try:
            yield
        finally:
            self._force_grad_boundary = False

    # ------------------------------------------------------------------ DeepSpeed private names

    def _exec_schedule(self, pipe_schedule: Any) -> None:
        self.start_schedule()
        super()._exec_schedule(pipe_schedule)

    def _exec_send_activations(self, buffer_id: int) -> None:
        self.send_activations(buffer_id)

    def _exec_recv_activations(self, buffer_id: int) -> None:
        self.recv_activations(buffer_id)

    def _exec_send_grads(self, buffer_id: int) -> None:
        self.send_grads(buffer_id)

    def _exec_recv_grads(self, buffer_id: int) -> None:
        self.recv_grads(buffer_id)

    def _exec_reduce_tied_grads(self) -> None:
        self.reduce_tied_grads()

    def _exec_reduce_grads(self) -> None:
        with self.gradient_boundary():
            self.reduce_grads()

    def _aggregate_total_loss(self) -> torch.Tensor:
        return self.aggregate_total_loss()

    # DeepSpeed runs instructions through this table of functions, not by method name:
    # the overrides take effect only once they are in it (the keys are :data:`INSTRUCTIONS`)
    _INSTRUCTION_MAP = {
        **_PipelineEngine._INSTRUCTION_MAP,
        _schedule.SendActivation: _exec_send_activations,
        _schedule.RecvActivation: _exec_recv_activations,
        _schedule.SendGrad: _exec_send_grads,
        _schedule.RecvGrad: _exec_recv_grads,
        _schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        _schedule.ReduceGrads: _exec_reduce_grads,
    }


def construct_engine(engine_cls: type, module: Any, *, config: dict, **kwargs: Any) -> Any:
    """Build ``engine_cls`` (a :class:`PipelineEngineHooks`) for a ``PipelineModule`` the way
    ``deepspeed.initialize`` builds its ``PipelineEngine`` (which hard-codes the class):
    config object, optimizer flags, ZeRO init context suspended while constructing.
    ``kwargs``: the engine's own keywords plus ``optimizer`` / ``lr_scheduler``."""
    from deepspeed.runtime.config import DeepSpeedConfig

    mpu = module.mpu()
    config_class = DeepSpeedConfig(config, mpu)
    deepspeed.set_optimizer_flags(config_class, module)
    deepspeed.zero.partition_parameters.shutdown_init_context()
    try:
        engine = engine_cls(
            args=None,
            model=module,
            model_parameters=None,
            training_data=None,
            mpu=mpu,
            dist_init_required=False,
            collate_fn=None,
            config=config,
            config_class=config_class,
            **kwargs,
        )
    finally:
        deepspeed.zero.partition_parameters.restore_init_context()
    check_engine_state(engine)
    return engine
