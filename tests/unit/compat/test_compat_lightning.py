"""The private Lightning / torch.distributed / DeepSpeed names in ``easgd_lightning.compat.lightning``
still exist with the signature and behaviour the adapter relies on.

A failure here names what an upgrade changed; fix the adapter (one module), not its callers.
"""

from __future__ import annotations

import inspect
import os
import signal
from datetime import timedelta
from pathlib import Path

import pytorch_lightning as pl
import pytorch_lightning.strategies.ddp as pl_ddp
import torch
import torch.distributed as dist
from pytorch_lightning.loops.training_epoch_loop import _TrainingEpochLoop
from pytorch_lightning.strategies import DDPStrategy

from easgd_lightning.compat import lightning as compat
from tests.helpers import launch_ranks


def _trainer() -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)


def test_sigterm_broadcast_is_a_per_trainer_replaceable_loop_step() -> None:
    method = _TrainingEpochLoop._broadcast_sigterm_tensor
    assert list(inspect.signature(method).parameters) == ["self"]
    # the loop calls it before every training batch (what the replacement stands in for)
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)
    trainer, other = _trainer(), _trainer()
    assert compat.sigterm_broadcast_replacement(trainer) is None
    calls: list[int] = []
    assert compat.replace_sigterm_broadcast(trainer, lambda: calls.append(1))
    assert compat.sigterm_broadcast_replacement(trainer) is not None
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()  # what advance() calls
    assert calls == [1]
    assert compat.sigterm_broadcast_replacement(other) is None  # only that trainer's loop


def test_sigterm_notifier_replaces_lightnings_handler_and_received_flag() -> None:
    trainer = _trainer()
    connector = trainer._signal_connector
    assert isinstance(connector, compat.SignalConnector)
    assert list(inspect.signature(compat.SignalConnector.__init__).parameters) == ["self", "trainer"]
    assert list(inspect.signature(connector._sigterm_notifier_fn).parameters) == ["signum", "_"]
    heard: list[int] = []
    assert compat.set_sigterm_notifier(trainer, lambda signum, frame: heard.append(signum))
    before = signal.getsignal(signal.SIGTERM)
    connector.register_signal_handlers()  # reads the notifier, as fit does after setup
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        connector.teardown()
        signal.signal(signal.SIGTERM, before)
    assert heard == [signal.SIGTERM]
    assert connector.received_sigterm is False  # our notifier, not Lightning's, ran
    compat.mark_sigterm_received(trainer)
    assert trainer.received_sigterm is True
    replacement = compat.SignalConnector(trainer)
    compat.set_signal_connector(trainer, replacement)
    assert trainer._signal_connector is replacement


def test_ddp_setup_outside_fitting_syncs_module_states_through_the_patched_name() -> None:
    assert callable(pl_ddp._sync_module_states)
    assert "_sync_module_states(self.model)" in inspect.getsource(DDPStrategy.setup)
    original = pl_ddp._sync_module_states
    with compat.module_state_sync_skipped():
        assert pl_ddp._sync_module_states is not original
        assert pl_ddp._sync_module_states(torch.nn.Linear(2, 2)) is None  # no broadcast
    assert pl_ddp._sync_module_states is original


def test_process_group_timeout_and_attached_trainer() -> None:
    assert compat.process_group_timeout(DDPStrategy(timeout=timedelta(seconds=17))) == 17.0
    assert compat.process_group_timeout(object(), default_s=5.0) == 5.0
    module = pl.LightningModule()
    assert compat.attached_trainer(module) is None
    assert compat.attached_trainer(None) is None
    trainer = _trainer()
    module.trainer = trainer
    assert compat.attached_trainer(module) is trainer


def test_default_store_is_the_process_groups_store(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    store.set_timeout(timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        default = compat.default_store()
        assert isinstance(default, dist.Store)
        # what Liveness does with it: add (heartbeat counters), set and check (done flags)
        default.set("compat/key", "7")
        assert compat.default_store().get("compat/key") == b"7"
        assert compat.default_store().check(["compat/key"]) and not default.check(["compat/none"])
        assert int(default.add("compat/count", 2)) == 2 and int(default.add("compat/count", 0)) == 2
        assert store.num_keys() >= 2  # written through to the store the group was built on
    finally:
        dist.destroy_process_group()


SOURCE_RANK = """
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
from easgd_lightning.compat import lightning as compat
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=3, timeout=timedelta(seconds=60))
if rank == 0:
    got = []
    for _ in range(2):
        buf = torch.zeros(1)
        work = dist.irecv(buf, src=None)
        work.wait()
        got.append((compat.source_rank(work), int(buf.item())))
    assert sorted(got) == [(1, 10), (2, 20)], got
    print("OK", got)
else:
    dist.send(torch.tensor([10.0 * rank]), dst=0)
dist.barrier()
dist.destroy_process_group()
"""


def test_source_rank_names_the_sender_of_a_receive_from_any_source(tmp_path: Path) -> None:
    assert hasattr(dist.Work, "_source_rank")
    script = tmp_path / "source_rank.py"
    script.write_text(SOURCE_RANK)
    outs = [r.stdout for r in launch_ranks(script, 3, [], timeout=120)]  # every rank exits 0
    assert "OK [" in outs[0], outs


def test_deepspeed_pipeline_module_gives_its_grid_through_mpu() -> None:
    from deepspeed.runtime.pipe.module import PipelineModule
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    assert list(inspect.signature(PipelineModule.mpu).parameters) == ["self"]
    assert list(inspect.signature(PipelineParallelGrid.get_slice_parallel_group).parameters) == ["self"]

    class _Grid:
        def get_slice_parallel_group(self):
            return "tp-group"

    class _Module:
        def mpu(self):
            return _Grid()

    assert compat.pipeline_slice_group(_Module()) == "tp-group"


def test_configured_optimizers_reads_every_form_lightning_accepts() -> None:
    from pytorch_lightning.core.optimizer import _configure_optimizers

    assert list(inspect.signature(_configure_optimizers).parameters) == ["optim_conf"]
    a = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    b = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(a, 1)
    assert compat.configured_optimizers(a) == [a]
    assert compat.configured_optimizers([a, b]) == [a, b]
    assert compat.configured_optimizers(([a], [sched])) == [a]
    assert compat.configured_optimizers({"optimizer": a, "lr_scheduler": sched}) == [a]


def test_path_is_lightnings_checkpoint_path_type() -> None:
    from lightning_fabric.utilities.types import _PATH

    assert compat.PATH is _PATH
    assert inspect.signature(DDPStrategy.save_checkpoint).parameters["filepath"].annotation in (_PATH, "_PATH")


def test_dropped_backward_sync_control_makes_fabric_no_backward_sync_a_warned_no_op() -> None:
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import DDPStrategy as FabricDDPStrategy

    strategy = FabricDDPStrategy()
    assert strategy._backward_sync_control is not None  # Fabric's DDP: DDP's no_sync
    compat.drop_backward_sync_control(strategy)
    assert strategy._backward_sync_control is None
    source = inspect.getsource(Fabric.no_backward_sync)
    none_case = source.index("_backward_sync_control is None")
    assert "rank_zero_warn" in source[none_case:] and "return nullcontext()" in source[none_case:]


def test_ddp_hooks_step_is_called_by_configure_ddp_after_wrapping() -> None:
    method = getattr(DDPStrategy, compat.DDP_HOOKS_STEP)
    assert list(inspect.signature(method).parameters) == ["self"]
    source = inspect.getsource(DDPStrategy.configure_ddp)
    assert f"self.{compat.DDP_HOOKS_STEP}()" in source
    assert source.index("self._setup_model(") < source.index(f"self.{compat.DDP_HOOKS_STEP}()")


def _package_classes():
    import importlib
    import pkgutil

    import easgd_lightning

    for info in pkgutil.walk_packages(easgd_lightning.__path__, "easgd_lightning."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # optional dependencies (DeepSpeed, ...) missing
            continue
        for obj in vars(module).values():
            if inspect.isclass(obj) and obj.__module__ == module.__name__:
                yield obj


def test_every_override_of_a_private_lightning_method_is_listed() -> None:
    for base, name in compat.PRIVATE_OVERRIDES:
        assert callable(getattr(base, name, None)), f"{base.__name__}.{name} is gone"
    listed = {name for _, name in compat.PRIVATE_OVERRIDES}
    found = set()
    for cls in _package_classes():
        for base in cls.__mro__[1:]:
            if not base.__module__.startswith(("pytorch_lightning", "lightning_fabric")):
                continue
            for name, value in vars(cls).items():
                private = name.startswith("_") and not name.startswith("__")
                method = inspect.isfunction(value) or isinstance(value, (property, staticmethod, classmethod))
                if private and method and name in vars(base):
                    found.add(f"{cls.__module__}.{cls.__qualname__}.{name}")
                    assert name in listed, f"{cls.__qualname__}.{name} overrides a private Lightning method"
    assert "easgd_lightning.strategies.ddp.CompressedDDPStrategy._register_ddp_hooks" in found
    assert "easgd_lightning.callbacks.LastFirstCheckpoint._save_last_checkpoint" in found


def test_checkpoint_write_steps_run_topk_then_last() -> None:
    from pytorch_lightning.callbacks import ModelCheckpoint

    for name in (compat.CHECKPOINT_TOPK_STEP, compat.CHECKPOINT_LAST_STEP):
        params = list(inspect.signature(getattr(ModelCheckpoint, name)).parameters)
        assert params == ["self", "trainer", "monitor_candidates"], (name, params)
    # wherever Lightning saves both, the epoch file comes first (what LastFirstCheckpoint reverses)
    for hook in ("on_train_batch_end", "on_train_epoch_end", "on_validation_end"):
        source = inspect.getsource(getattr(ModelCheckpoint, hook))
        topk = source.find(f"self.{compat.CHECKPOINT_TOPK_STEP}(")
        last = source.find(f"self.{compat.CHECKPOINT_LAST_STEP}(")
        assert topk != -1 and last != -1 and topk < last, hook
