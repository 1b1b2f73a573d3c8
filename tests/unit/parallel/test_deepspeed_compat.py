"""The DeepSpeed private pipeline-engine API the adapter (parallel/deepspeed_compat.py)
overrides: one case per overridden method -- it exists on the installed DeepSpeed with the
parameters DeepSpeed calls it with, DeepSpeed still runs it (instruction table, caller) --
and the behaviour relied on, run through DeepSpeed's own ``_exec_schedule`` on a probe
engine (an nn.Module without DeepSpeed's heavy constructor). The expected signatures are
written out here, not read from the adapter, so an edit to either side is caught."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed")  # a hard dependency; skipped only without it

from deepspeed.runtime.pipe import schedule  # noqa: E402
from deepspeed.runtime.pipe.engine import PipelineEngine  # noqa: E402

from easgd_lightning.parallel import deepspeed_compat as compat  # noqa: E402
from easgd_lightning.parallel.deepspeed_compat import PipelineEngineHooks  # noqa: E402

#: method -> (its parameters after self, the instruction DeepSpeed runs it for, or the
#: DeepSpeed methods that call it)
OVERRIDDEN = {
    "_exec_schedule": (("pipe_schedule",), None, ("train_batch", "eval_batch")),
    "_exec_send_activations": (("buffer_id",), "SendActivation", ()),
    "_exec_recv_activations": (("buffer_id",), "RecvActivation", ()),
    "_exec_send_grads": (("buffer_id",), "SendGrad", ()),
    "_exec_recv_grads": (("buffer_id",), "RecvGrad", ()),
    "_exec_reduce_tied_grads": ((), "ReduceTiedGrads", ()),
    "_exec_reduce_grads": ((), "ReduceGrads", ()),
    "_aggregate_total_loss": ((), None, ("train_batch",)),
}


class Probe(PipelineEngineHooks):
    """The adapter class with its hooks recording calls (DeepSpeed's constructor skipped)."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)
        self.calls: list[tuple] = []

    def _reserve_pipe_buffers(self, num_buffers: int) -> None:
        self.calls.append(("reserve", num_buffers))

    def start_schedule(self) -> None:
        self.calls.append(("start",))

    def send_activations(self, buffer_id: int) -> None:
        self.calls.append(("send_activations", buffer_id))

    def recv_activations(self, buffer_id: int) -> None:
        self.calls.append(("recv_activations", buffer_id))

    def send_grads(self, buffer_id: int) -> None:
        self.calls.append(("send_grads", buffer_id))

    def recv_grads(self, buffer_id: int) -> None:
        self.calls.append(("recv_grads", buffer_id))

    def reduce_tied_grads(self) -> None:
        self.calls.append(("reduce_tied_grads",))

    def reduce_grads(self) -> None:
        self.calls.append(("reduce_grads", self.is_gradient_accumulation_boundary()))

    def aggregate_total_loss(self) -> torch.Tensor:
        self.calls.append(("aggregate_total_loss",))
        return torch.tensor(1.25)


class FakeSchedule:
    """What ``_exec_schedule`` reads of a schedule: its steps and its buffer count."""

    def __init__(self, steps: list[list]) -> None:
        self.steps = steps

    def num_pipe_buffers(self) -> int:
        return 3

    def __iter__(self):
        return iter(self.steps)


def _params(name: str) -> tuple[str, ...]:
    return tuple(list(inspect.signature(getattr(PipelineEngine, name)).parameters)[1:])


@pytest.mark.parametrize("name", list(OVERRIDDEN))
def test_overridden_private_method_is_there_and_still_run_by_deepspeed(name: str) -> None:
    params, instruction, callers = OVERRIDDEN[name]
    assert _params(name) == params, f"PipelineEngine.{name}{inspect.signature(getattr(PipelineEngine, name))}"
    if instruction is not None:  # DeepSpeed dispatches it through its instruction table
        assert PipelineEngine._INSTRUCTION_MAP[getattr(schedule, instruction)] is getattr(PipelineEngine, name)
        assert Probe._INSTRUCTION_MAP[getattr(schedule, instruction)] is getattr(PipelineEngineHooks, name)
    for caller in callers:
        assert name in getattr(PipelineEngine, caller).__code__.co_names, f"{caller} no longer calls {name}"
    assert name in compat.PRIVATE_METHODS and compat.PRIVATE_METHODS[name] == params


def test_exec_schedule_runs_each_instruction_through_the_hooks_with_its_kwargs() -> None:
    probe = Probe()
    steps = [
        [schedule.RecvActivation(buffer_id=1), schedule.SendActivation(buffer_id=2)],
        [schedule.RecvGrad(buffer_id=0)],
        [schedule.SendGrad(buffer_id=1), schedule.ReduceTiedGrads(), schedule.ReduceGrads()],
    ]
    probe._exec_schedule(FakeSchedule(steps))
    assert probe.calls == [
        ("start",),  # before DeepSpeed reserves the buffers and runs anything
        ("reserve", 3),
        ("recv_activations", 1),
        ("send_activations", 2),
        ("recv_grads", 0),
        ("send_grads", 1),
        ("reduce_tied_grads",),
        ("reduce_grads", True),  # inside the gradient boundary
    ]


def test_reduce_grads_runs_inside_the_gradient_boundary_and_leaves_it_on_error() -> None:
    # DeepSpeed's optimizer step and loss scaling ask is_gradient_accumulation_boundary(),
    # which reads _force_grad_boundary: true while reducing, false after (also on error)
    assert "_force_grad_boundary" in PipelineEngine.is_gradient_accumulation_boundary.__code__.co_names
    probe = Probe()
    probe._force_grad_boundary = False
    probe._exec_reduce_grads()
    assert probe.calls == [("reduce_grads", True)] and probe.is_gradient_accumulation_boundary() is False

    def boom() -> None:
        raise RuntimeError("peer gone")

    probe.reduce_grads = boom
    with pytest.raises(RuntimeError, match="peer gone"):
        probe._exec_reduce_grads()
    assert probe.is_gradient_accumulation_boundary() is False


def test_aggregate_total_loss_returns_the_hooks_loss() -> None:
    probe = Probe()
    assert probe._aggregate_total_loss().item() == 1.25
    assert probe.calls == [("aggregate_total_loss",)]


def test_loss_scaling_divides_by_the_micro_batches() -> None:
    params = list(inspect.signature(PipelineEngine._scale_loss_by_gas).parameters.values())[1:]
    assert params[0].name == "prescaled_loss"
    assert all(p.default is not inspect.Parameter.empty for p in params[1:])
    probe = Probe()
    probe.gradient_accumulation_steps = lambda: 4
    assert probe.scale_loss_by_micro_batches(torch.tensor(10.0)).item() == 2.5


def test_installed_deepspeed_is_in_the_checked_range() -> None:
    # pinned: a DeepSpeed upgrade must re-run these checks and move CHECKED_RANGE
    assert compat.in_checked_range(compat.installed_version()), compat.installed_version()
    assert compat.in_checked_range(compat.CHECKED_AGAINST)
    assert not compat.in_checked_range("0.20.1") and not compat.in_checked_range("0.18.9")
    compat.check_deepspeed()  # passes on the installed version


def test_a_changed_signature_is_refused_naming_the_method_and_version(monkeypatch) -> None:
    def changed(self, buffer_id, stream):  # a parameter DeepSpeed's schedule would not pass
        return None

    monkeypatch.setattr(PipelineEngine, "_exec_send_grads", changed)
    with pytest.raises(compat.DeepSpeedCompatError) as err:
        compat.check_deepspeed()
    msg = str(err.value)
    assert "PipelineEngine._exec_send_grads takes (buffer_id, stream)" in msg
    assert f"DeepSpeed {deepspeed.__version__}" in msg and compat.CHECKED_AGAINST in msg


def test_a_missing_method_or_table_entry_is_refused(monkeypatch) -> None:
    monkeypatch.delattr(PipelineEngine, "_aggregate_total_loss")
    with pytest.raises(compat.DeepSpeedCompatError, match="PipelineEngine._aggregate_total_loss is missing"):
        compat.check_deepspeed()
    monkeypatch.undo()
    table = {k: v for k, v in PipelineEngine._INSTRUCTION_MAP.items() if k is not schedule.RecvGrad}
    monkeypatch.setattr(PipelineEngine, "_INSTRUCTION_MAP", table)
    with pytest.raises(compat.DeepSpeedCompatError, match="no longer runs RecvGrad with _exec_recv_grads"):
        compat.check_deepspeed()


def test_engine_state_check_names_what_is_missing() -> None:
    state = {name: None for name in compat.ENGINE_STATE}
    compat.check_engine_state(SimpleNamespace(**state))
    del state["grad_layer"]
    with pytest.raises(compat.DeepSpeedCompatError, match="PipelineEngine instances have no grad_layer"):
        compat.check_engine_state(SimpleNamespace(**state))


def test_skipping_the_shm_op_build_makes_deepspeed_fall_back(monkeypatch) -> None:
    """On gloo the engine asks DeepSpeed not to JIT-build its shared-memory op: the
    backend's builder must exist where the adapter patches it, be what TorchBackend calls,
    and answer None afterwards (DeepSpeed's own result when the op cannot be built)."""
    import importlib

    module = importlib.import_module("deepspeed.comm.torch")
    assert "build_shm_op" in module.TorchBackend.__init__.__code__.co_names
    monkeypatch.setattr(module, "build_shm_op", module.build_shm_op)  # restored after
    compat.skip_shm_op_build()
    assert module.build_shm_op() is None
    monkeypatch.delattr(module, "build_shm_op")
    with pytest.raises(compat.DeepSpeedCompatError, match="build_shm_op"):
        compat.check_deepspeed()
