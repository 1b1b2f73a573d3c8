"""Bad input stops in the parent with one line naming the key and what is allowed.

Every case composes the config exactly as ``easgd-train`` does (``compose_checked``: the
command line checked against the config tree) and runs ``validate_config`` (the values),
in this process: no worker, no subprocess. A handful go through the real CLI in
tests/e2e/test_bad_input_cli.py.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

import easgd_lightning.cli.train  # noqa: F401  (registers the recipe resolvers)
from easgd_lightning.cli.overrides import CONF_DIR, check_command_line, compose_checked
from easgd_lightning.cli.validate import ConfigError, validate_config

# (overrides, the line's key, a fragment saying what is allowed)
BAD = [
    # unknown keys, with or without '+': the valid keys of that group, the closest first
    (["+foo=1"], "foo", "valid keys of the top level: allow_nonfinite_loss, checkpoint, comm, compression"),
    (["foo=1"], "foo", "valid keys of the top level"),
    (["++foo=1"], "foo", "valid keys of the top level"),
    (["+trainer.max_epocs=3"], "trainer.max_epocs", "did you mean trainer.max_epochs?"),
    (["trainer.max_epocs=3"], "trainer.max_epocs", "did you mean trainer.max_epochs?"),
    (["strategy=sync_easgd", "+strategy.tua=4"], "strategy.tua",
     "did you mean strategy.tau? valid keys of strategy (strategy=sync_easgd): alpha, beta, name, overlap, rho, tau"),
    (["+strategy.tau=4"], "strategy.tau", "valid keys of strategy (strategy=ddp): name"),
    (["strategy=async_sgd", "trainer.devices=4", "+strategy.tau=4"], "strategy.tau", "valid keys of strategy (strategy=async_sgd)"),
    (["~optim.nope"], "optim.nope", "valid keys of optim"),
    (["strategy=sync_easgd", "+strategy.tau=3"], "strategy.tau", "write strategy.tau=3"),
    # Hydra-level: unknown group options (optional groups too), unparsable overrides
    (["strategy=bogus"], "strategy=bogus", "choose one of async_easgd, async_measgd"),
    (["strategy=sync_easg"], "strategy=sync_easg", "did you mean sync_easgd?"),
    (["compression=bogus"], "compression=bogus", "choose one of acpsgd, adaptive, bf16, csc, dgc"),
    (["model=bogus"], "model=bogus", "choose one of alexnet, googlenet, gpt_tiny, mlp, resnet50"),
    (["recipe=bogus"], "recipe=bogus", "imagenet/alexnet_gpu"),
    (["trainer=bogus"], "trainer=bogus", "choose one of cpu, gpu"),
    (["hydra/launcher=bogus"], "hydra/launcher=bogus", "slurm"),
    (["optim.milestones=[1,2"], "optim.milestones", "cannot parse the override"),
    (["strategy=ddp,sync_easgd"], "strategy", "add --multirun (-m)"),
    # values the workers would refuse (or silently change) 45-100 s later
    (["optim.lr=0"], "optim.lr", "must be a number > 0"),
    (["optim.lr=-1"], "optim.lr", "must be a number > 0"),
    (["optim.lr=abc"], "optim.lr", "must be a number > 0, got 'abc'"),
    (["optim.momentum=-0.5"], "optim.momentum", "in [0, 1)"),
    (["optim.weight_decay=-1"], "optim.weight_decay", ">= 0"),
    (["optim.optimizer=adam"], "optim.optimizer", "one of ['sgd', 'adamw'], got 'adam'"),
    (["optim.schedule=linear"], "optim.schedule", "one of ['constant', 'cosine', 'step', 'multistep'], got 'linear'"),
    (["trainer.max_epochs=abc"], "trainer.max_epochs", "an integer >= 1 or -1"),
    (["trainer.max_epochs=0"], "trainer.max_epochs", "an integer >= 1 or -1"),
    (["trainer.max_epochs=-1"], "trainer.max_epochs", "needs trainer.max_steps >= 1"),
    (["trainer.max_steps=-2"], "trainer.max_steps", "an integer >= 1 or -1"),
    (["trainer.precision=16-mixed"], "trainer.precision", "on CPU choose one of 32-true, 64-true, bf16-mixed"),
    (["trainer.precision=65-true"], "trainer.precision", "one of ['32-true', '64-true'"),
    (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches", "an integer >= 1"),
    (["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val", ">= 0"),
    (["trainer.limit_train_batches=0"], "trainer.limit_train_batches", "a fraction in (0, 1]"),
    (["trainer.accelerator=tpu"], "trainer.accelerator", "one of ['cpu', 'gpu', 'cuda', 'auto'], got 'tpu'"),
    (["checkpoint.every_n_epochs=0"], "checkpoint.every_n_epochs", "an integer >= 1"),
    (["data.num_workers=-1"], "data.num_workers", "an integer >= 0"),
    (["data.batch_size=0"], "data.batch_size", ">= 1"),
    (["seed=abc"], "seed", "an integer in [0, 4294967295], got 'abc'"),
    (["seed=-1"], "seed", "an integer in [0, 4294967295], got -1"),
    (["model.hidden=-5"], "model.hidden", "an integer >= 1, got -5"),
    (["model.hidden=[64,0]"], "model.hidden", "a non-empty list of integers >= 1, got [64, 0]"),
    (["strategy=pipeline_3d"], "model.name", "use model=gpt_tiny or a recipe=nlp3d/"),
    # moved here from the one-subprocess-per-case CLI tests (local SGD, nlp3d, hogwild)
    (["strategy=local_sgd", "strategy.tau=0"], "strategy.tau", ""),
    (["strategy=local_sgd", "strategy.tau_rule=qsr", "strategy.qsr_coefficient=0"], "strategy.qsr_coefficient", ""),
    (["strategy=local_sgd", "strategy.tau_rule=linear"], "strategy.tau_rule", ""),
    (["strategy=local_sgd", "strategy.cocod=true", "compression=fp16"], "strategy.cocod", ""),
    # the names before 0.2 still work (with a FutureWarning): the same errors, new names
    (["strategy=local_sgd", "strategy.period=0"], "strategy.tau", ""),
    (["strategy=local_sgd", "strategy.overlap=true", "compression=fp16"], "strategy.cocod", ""),
    (["recipe=nlp3d/gpt_tiny_pp2", "strategy.pp=3"], "strategy.pp",
     "strategy.pp * strategy.tp * strategy.dp = 3 * 1 * 1 = 3 must equal the world size 2"),
    (["recipe=nlp3d/gpt_tiny_pp2", "strategy.pp=4", "trainer.devices=4"], "strategy.pp",
     "strategy.pp (4) is larger than model.n_layer (2)"),
    (["recipe=nlp3d/gpt_tiny_pp2", "strategy.pp=1", "strategy.tp=3", "trainer.devices=3", "model.n_head=4",
      "model.d_model=96"], "strategy.tp", "strategy.tp (3) must divide model.n_head (4)"),
    (["strategy=hogwild_easgd", "trainer.num_nodes=2"], "strategy.server", "dedicated"),
]


class _UserModule(pl.LightningModule):
    """A user's module with a body and a head (built by the CLI through ``model.builder``)."""

    def __init__(self, optimizers: int = 1, manual: bool = False) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(64, 32), nn.Linear(32, 10)
        self.n_optimizers = optimizers
        self.automatic_optimization = not manual

    def configure_optimizers(self):
        if self.n_optimizers == 1:
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return [torch.optim.SGD(self.body.parameters(), lr=0.1), torch.optim.Adam(self.head.parameters())]


def one_optimizer(cfg, dm) -> pl.LightningModule:
    return _UserModule()


def two_optimizers(cfg, dm) -> pl.LightningModule:
    return _UserModule(optimizers=2, manual=True)


def manual_pipeline(cfg, dm) -> pl.LightningModule:
    from easgd_lightning.models.gpt import build_lightning_module

    module = build_lightning_module(cfg, dm)
    module.automatic_optimization = False
    return module


_USER = "model.builder=tests.unit.cli.test_validation:"
BAD += [
    # what the strategy cannot train, known before launch from the module built on the meta device
    (["model=gpt_tiny", f"{_USER}two_optimizers", "strategy=sync_easgd"], "model=gpt",
     "configure_optimizers returns 2 optimizers; strategy=sync_easgd drives exactly 1"),
    (["model=gpt_tiny", f"{_USER}two_optimizers", "strategy=async_easgd", "trainer.devices=3"], "model=gpt",
     "strategy=async_easgd drives exactly 1: return one optimizer"),
    (["model=gpt_tiny", f"{_USER}two_optimizers", "strategy=hogwild_sgd"], "model=gpt", "or use strategy=ddp"),
    (["recipe=nlp3d/gpt_tiny_pp2", f"{_USER}manual_pipeline"], "model=gpt",
     "manual optimization (automatic_optimization=False), which strategy=pipeline_3d does not support"),
    (["recipe=nlp3d/gpt_tiny_pp2", f"{_USER}one_optimizer"], "model=gpt", "_UserModule has no pipeline form"),
]

# the strategies' own values, the async family, compression values (were tables composed in
# tests/e2e/test_cli_foundation.py and test_async_cli.py, and one CLI run each in
# tests/e2e/test_compression_convergence.py)
BAD += [
    (["strategy=sync_easgd", "strategy.tau=0"], "strategy.tau", "an integer >= 1, got 0"),
    (["strategy=easgd_round_robin", "strategy.tau=-2"], "strategy.tau", "an integer >= 1, got -2"),
    (["strategy=sync_easgd", "strategy.alpha=1.5"], "strategy.alpha", "in (0, 1), got 1.5"),
    (["strategy=sync_easgd", "strategy.alpha=0"], "strategy.alpha", "in (0, 1), got 0"),
    (["strategy=sync_easgd", "strategy.alpha=0.7", "trainer.devices=2"], "strategy.alpha",
     "beta = world_size * alpha must be < 1 for a stable center, got 2 * 0.7 = 1.4"),
    (["strategy=easgd_round_robin", "strategy.beta=-0.1"], "strategy.beta", "in (0, 1), got -0.1"),
    (["strategy=sync_easgd", "trainer.devices=1"], "trainer.devices", "strategy=sync_easgd: it needs at least 2"),
    (["strategy=easgd_round_robin", "trainer.devices=1"], "trainer.devices", "it needs at least 2"),
    (["trainer.devices=0"], "trainer.devices", "an integer >= 1, got 0"),
    (["strategy.name=nonsense"], "strategy.name", "choose one of async_easgd, async_measgd, async_msgd, async_sgd, ddp_compressed, diloco, easgd_round_robin"),
    (["model.name=nonsense"], "model.name", "choose one of alexnet"),
    (["data.name=nonsense"], "data.name", "choose one of digits"),
    (["logger.name=nonsense"], "logger.name", "choose one of wandb, tensorboard, csv, none"),
    (["faults.slow_rank=5"], "faults.slow_rank", "an integer in [0, 1] or null, got 5"),
    (["timeout_s=0"], "timeout_s", "a number of seconds > 0, got 0"),
    (["launcher.start_method=forkserver"], "launcher.start_method", "one of ['auto', 'fork', 'spawn'], got 'forkserver'"),
    (["trainer.accelerator=gpu", "launcher.start_method=fork"], "launcher.start_method",
     "cannot start GPU ranks"),
    (["strategy=async_easgd", "trainer.devices=4", "strategy.tau=0"], "strategy.tau", "an integer >= 1"),
    (["strategy=hogwild_easgd", "strategy.tau=-1"], "strategy.tau", "an integer >= 1"),
    (["strategy=async_measgd", "trainer.devices=4", "strategy.momentum=1.0"], "strategy.momentum", "in [0, 1)"),
    (["strategy=async_msgd", "trainer.devices=4", "strategy.momentum=-0.5"], "strategy.momentum", "in [0, 1)"),
    (["strategy=hogwild_sgd", "strategy.momentum=1.2"], "strategy.momentum", "in [0, 1)"),
    (["strategy=hogwild_sgd", "trainer.num_nodes=2"], "strategy.server", "needs a parameter server"),
    (["strategy=async_easgd", "trainer.devices=2"], "trainer.devices", "it needs at least 3 processes"),
    (["strategy=async_easgd", "trainer.devices=4", "strategy.server=thread"], "strategy.server", "choose 'dedicated'"),
    # strategy.servers (a sharded center): an integer >= 1, at most the workers, what does not shard yet
    (["strategy=async_easgd", "trainer.devices=4", "strategy.servers=0"], "strategy.servers", "an integer >= 1, got 0"),
    (["strategy=async_sgd", "trainer.devices=4", "strategy.servers=abc"], "strategy.servers", "an integer >= 1, got 'abc'"),
    (["strategy=async_msgd", "trainer.devices=5", "strategy.servers=3"], "strategy.servers",
     "at most as many servers as workers; 5 processes give 2 workers"),
    (["strategy=async_measgd", "trainer.devices=3", "strategy.servers=2"], "trainer.devices",
     "needs at least 4 processes (2 workers + 2 parameter servers)"),
    (["strategy=async_easgd", "trainer.devices=4", "strategy.servers=2", "compression=topk"], "strategy.servers",
     "does not shard compressed pushes yet"),
    (["strategy=async_easgd", "trainer.devices=4", "strategy.servers=2", "ft=torchft"], "strategy.servers",
     "re-admits restarted workers (ft=torchft) with one server only"),
    (["strategy=hogwild_easgd", "trainer.devices=4", "+strategy.servers=2"], "strategy.servers",
     "valid keys of strategy (strategy=hogwild_easgd)"),
    (["strategy=async_easgd", "trainer.devices=4", "compression=fp16"], "compression.name",
     "compresses its pushes with one of"),
    (["strategy=hogwild_easgd", "trainer.devices=3", "compression=topk"], "compression",
     "applies its updates lock-free"),
    (["strategy=async_easgd", "trainer.devices=4", "compression=topk", "compression.two_way=true"],
     "compression.two_way", "replies with the dense d"),
    # the user's optimizer is what runs: refused where the strategy would change its rule
    (["strategy=async_measgd", "trainer.devices=4", "optim.optimizer=adamw"], "optim.optimizer",
     "AdamW has momentum of its own"),
    (["strategy=async_msgd", "trainer.devices=4", "optim.optimizer=adamw"], "strategy.momentum",
     "needs torch.optim.SGD, got AdamW"),
    (["strategy=async_msgd", "trainer.devices=4", "optim.momentum=0.5"], "strategy.momentum",
     "the optimizer's momentum=0.5 (param group 0, optim.momentum) differ"),
    (["strategy=hogwild_sgd", "strategy.momentum=0.5", "optim.optimizer=adamw"], "strategy.momentum",
     "needs torch.optim.SGD"),
    (["compression=topk", "compression.ratio=1.5"], "compression.ratio", "in (0, 1], got 1.5"),
    # sgc keeps each rank's own value when it skips: right for gradients only
    (["strategy=sync_easgd", "compression=sgc"], "compression=sgc",
     "applies to gradients only (strategy=ddp): strategy=sync_easgd exchanges differences"),
    (["strategy=local_sgd", "compression=sgc"], "compression=sgc", "use strategy=ddp with compression=sgc"),
    (["compression=powersgd", "compression.rank=0"], "compression.rank", "an integer >= 1, got 0"),
    # DiLoCo's options (strategies/diloco.py)
    (["strategy=diloco", "strategy.tau=0"], "strategy.tau", "an integer >= 1"),
    (["strategy=diloco", "strategy.outer=adam"], "strategy.outer", "one of ['nesterov', 'average', 'elastic'], got 'adam'"),
    (["strategy=diloco", "strategy.outer_lr=0"], "strategy.outer_lr", "(0, inf)"),
    (["strategy=diloco", "strategy.outer_momentum=1.0"], "strategy.outer_momentum", "[0, 1)"),
    (["strategy=diloco", "strategy.outer_nesterov=maybe"], "strategy.outer_nesterov", "true or false"),
    (["strategy=diloco", "strategy.tau=16", "strategy.fragments=3"], "strategy.tau=16 must be a multiple", ""),
    (["strategy=diloco", "strategy.tau=8", "strategy.fragments=2", "strategy.fragment_sync_delay=4"],
     "strategy.fragment_sync_delay", "[0, tau / fragments = 4)"),
    (["strategy=diloco", "strategy.fragment_update_alpha=1.5"], "strategy.fragment_update_alpha", "[0, 1]"),
    (["strategy=diloco", "strategy.alpha=0.3"], "strategy.alpha", "outer=elastic only"),
    (["strategy=diloco", "strategy.outer=elastic", "strategy.alpha=0.6"], "strategy.alpha", "beta = world_size * alpha"),
    (["strategy=diloco", "strategy.fragments=16", "strategy.tau=16"], "strategy.fragments=16", "at most 4"),
    (["compression=sidco", "compression.distribution=cauchy"], "compression.distribution",
     "one of ['exponential', 'gamma', 'gpareto'], got 'cauchy'"),
]

# issue 31 item 5: accepted silently, failing after the workers started, or a traceback before
BAD += [
    (["faults.crash_at_step=2"], "faults.crash_at_step", "set faults.crash_rank too"),
    (["faults.nan_rank=1"], "faults.nan_rank", "set faults.nan_at_step too"),
    (["faults.nan_at_step=abc"], "faults.nan_at_step", "an integer >= 1 or null, got 'abc'"),
    (["faults.nan_at_step=-3"], "faults.nan_at_step", "an integer >= 1 or null, got -3"),
    (["faults.crash_at_step=0", "faults.crash_rank=1"], "faults.crash_at_step", "an integer >= 1 or null, got 0"),
    (["faults.slow_ms=abc"], "faults.slow_ms", "a number >= 0 or null, got 'abc'"),
    (["faults.slow_ms=-5"], "faults.slow_ms", "a number >= 0 or null, got -5"),
    # issue 28 item 4: every value through utils.checks (num_nodes refused a bool only by luck)
    (["trainer.num_nodes=true"], "trainer.num_nodes", "an integer >= 1, got True"),
    (["faults.kill_rank=1"], "faults.kill_rank", "set faults.kill_at_step too"),
    (["faults.kill_rank=1", "faults.kill_at_step=0"], "faults.kill_at_step", "an integer >= 1 or null, got 0"),
    (["faults.kill_rank=1", "faults.kill_at_step=3", "faults.kill_at_end=true"], "faults.kill_at_end", "not both"),
    (["faults.kill_rank=1", "faults.kill_at_end=yes"], "faults.kill_at_end", "true or false"),
    (["trainer.limit_val_batches=-1"], "trainer.limit_val_batches",
     "an integer >= 0 or a fraction in (0, 1] or null, got -1"),
    (["strategy=async_easgd", "trainer.devices=3", "faults.crash_rank=2", "faults.crash_at_step=2"],
     "faults.crash_rank", "rank 2 is strategy=async_easgd's parameter server, which never takes a training step"),
    (["strategy=async_sgd", "trainer.devices=3", "faults.slow_rank=2", "faults.slow_ms=10"], "faults.slow_rank",
     "choose a worker rank in [0, 1]"),
    # with two servers (the last two ranks) the first of them too
    (["strategy=async_easgd", "trainer.devices=5", "strategy.servers=2", "faults.crash_rank=3", "faults.crash_at_step=2"],
     "faults.crash_rank", "rank 3 is strategy=async_easgd's parameter server, which never takes a training step, "
     "so the fault would never fire; choose a worker rank in [0, 2]"),
    (["strategy=pipeline_3d", "model=gpt_tiny", "data=text", "trainer.precision=64-true"], "trainer.precision",
     "strategy=pipeline_3d runs in fp32: set trainer.precision=32-true, got 64-true"),
    (["recipe=nlp3d/gpt_tiny_pp2", "trainer.precision=bf16-mixed"], "trainer.precision", "runs in fp32"),
    (["model=gpt_tiny"], "model=gpt", "a language model needs token data with a vocabulary (data=text"),
    (["model._target_=nonexistent.mod.fn"], "model._target_", "cannot import 'nonexistent.mod.fn'"),
    (["trainer.gradient_clip_algorithm=foo"], "trainer.gradient_clip_algorithm", "one of ['norm', 'value'] or null, got 'foo'"),
    (["loss_explosion_factor=1"], "loss_explosion_factor", "a number > 1"),
    # issue 27: seeded random kills need the launcher that restarts them
    (["faults.kill_every_s=20"], "faults.kill_every_s", "needs ft=torchft"),
    (["ft=torchft", "strategy=local_sgd", "faults.kill_every_s=0"], "faults.kill_every_s", "a number of seconds > 0, got 0"),
    (["ft=torchft", "strategy=local_sgd", "faults.kill_every_s=20", "faults.kill_seed=-1"], "faults.kill_seed",
     "an integer >= 0 or null, got -1"),
]


def _check(overrides: list[str]) -> None:
    validate_config(compose_checked(overrides))


@pytest.mark.parametrize("overrides,key,allowed", BAD, ids=[" ".join(o) for o, _, _ in BAD])
def test_bad_input_is_one_line_naming_the_key(overrides: list[str], key: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as err:
        _check(overrides)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(key), message
    assert allowed in message, message


def test_gpus_that_this_machine_does_not_have() -> None:
    import torch

    if torch.cuda.is_available():  # more GPUs than any node has
        overrides, expected = ["trainer=gpu", "trainer.devices=4096"], "trainer.devices: 4096 GPUs per node asked for"
    else:
        overrides, expected = ["trainer=gpu"], "trainer.accelerator: gpu asked for, but this machine has no CUDA GPU"
    with pytest.raises(ConfigError) as err:
        _check(overrides)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)
    validate_config(compose_checked(overrides), hardware=False)  # the config itself is valid


def test_yaml_syntax_error_in_a_config_file_is_one_line(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "strategy" / "broken.yaml").write_text("name: sync_easgd\n  tau: [1\n")
    with pytest.raises(ConfigError) as err:
        compose_checked(["strategy=broken"], conf_dir=str(conf))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{conf / 'strategy' / 'broken.yaml'}, line 2, column")
    assert "not valid YAML" in message


def test_every_job_of_a_sweep_is_checked_before_any_runs() -> None:
    with pytest.raises(ConfigError, match=r"^strategy=bogus: no such option"):
        check_command_line(["-m", "strategy=ddp,bogus"])
    with pytest.raises(ConfigError, match=r"^strategy\.tua: unknown key; did you mean strategy\.tau\?"):
        check_command_line(["--multirun", "strategy=sync_easgd,local_sgd", "+strategy.tua=1"])
    check_command_line(["-m", "strategy=ddp,sync_easgd", "optim.lr=range(0.1,0.3,0.1)"])


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["strategy=sync_easgd", "strategy.tau=4", "trainer.precision=64-true"],
        ["strategy=hogwild_easgd", "trainer.devices=2"],  # two workers sharing the center: valid
        ["strategy=async_sgd", "trainer.devices=3"],
        ["++data.batch_size=16", "model.hidden=[64,32]", "trainer.precision=32", "seed=4294967295"],
        ["trainer.max_epochs=-1", "trainer.max_steps=5", "trainer.limit_train_batches=0.5"],
        ["recipe=nlp3d/gpt_tiny_pp2"],
        ["recipe=imagenet/alexnet_knl", "data.synthetic=true"],
        ["hydra.run.dir=/tmp/x", "hydra/launcher=slurm", "hydra.job.chdir=false"],
        ["model=gpt_tiny", f"{_USER}two_optimizers", "strategy=ddp"],  # Lightning's DDP drives any number
        ["model=gpt_tiny", f"{_USER}one_optimizer", "strategy=sync_easgd"],
        # every strategy at its minimum world size, and the async family's accepted variants
        ["strategy=easgd_round_robin"],
        *([f"strategy={s}", "trainer.devices=4"] for s in ("async_easgd", "async_measgd", "async_msgd")),
        ["strategy=hogwild_sgd", "trainer.devices=3"],
        ["strategy=hogwild_easgd", "strategy.server=dedicated", "trainer.devices=4", "trainer.num_nodes=2"],
        *([f"strategy={s}", f"trainer.devices={n}", "optim.optimizer=adamw"]  # any optimizer runs as given
          for s, n in (("async_easgd", 4), ("async_sgd", 4), ("hogwild_sgd", 3))),
        ["strategy=async_msgd", "trainer.devices=4", "optim.momentum=0"],
        ["strategy=diloco", "strategy.tau=8", "strategy.fragments=4", "strategy.fragment_sync_delay=1",
         "compression=qsgd"],
        ["strategy=diloco", "strategy.outer=elastic", "trainer.devices=1"],
        # a real Trainer argument (issue 31 item 5: it was refused as unknown)
        ["trainer.gradient_clip_val=1.0", "trainer.gradient_clip_algorithm=value"],
        ["faults.nan_at_step=3"],  # nan_rank null: every rank
        ["strategy=async_easgd", "trainer.devices=3", "faults.crash_rank=1", "faults.crash_at_step=2"],
        ["loss_explosion_factor=null"],
    ],
)
def test_good_inputs_pass(overrides: list[str]) -> None:
    check_command_line(overrides)
    _check(overrides)


def test_help_and_other_config_trees_are_left_to_hydra() -> None:
    check_command_line(["--help"])
    check_command_line(["--cfg", "job", "+foo=1", "--config-dir", "/nonexistent"])


def _records(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "never engages" in r.getMessage()]


def test_compression_that_never_engages_warns_once_naming_min_numel(caplog: pytest.LogCaptureFixture) -> None:
    # the digits MLP's largest tensor is 64 x 128 = 8192 elements, below DGC's 16384
    with caplog.at_level(logging.WARNING, logger="easgd_lightning"):
        _check(["compression=dgc", "optim.momentum=0"])
    (line,) = _records(caplog)
    assert "compression.min_numel=16384" in line and "8192" in line and "\n" not in line
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="easgd_lightning"):
        _check(["compression=dgc", "optim.momentum=0", "compression.min_numel=8192"])
        _check(["compression=none"])
    assert _records(caplog) == []


def test_pipeline_setup_refuses_manual_optimization_in_one_line() -> None:
    """The Python API: ``Trainer(strategy=Pipeline3DStrategy(...))`` with a manual-optimization
    module stops in the strategy's setup, before the engine is built (no process group)."""
    from types import SimpleNamespace

    from pytorch_lightning.accelerators import CPUAccelerator
    from pytorch_lightning.trainer.states import TrainerFn

    from easgd_lightning.strategies.pipeline import Pipeline3DStrategy

    module = _UserModule(manual=True)
    strategy = Pipeline3DStrategy(pp=1, tp=1, accelerator=CPUAccelerator())
    strategy._lightning_module = module
    trainer = SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING), accumulate_grad_batches=1)
    with pytest.raises(ValueError, match=r"^strategy=pipeline_3d does not support manual optimization") as err:
        strategy.setup(trainer)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides,name",
    [
        (["strategy=sync_easgd"], "sync_easgd"),
        (["strategy=easgd_round_robin"], "easgd_round_robin"),
        (["strategy=local_sgd"], "local_sgd"),
        (["recipe=nlp3d/gpt_tiny_pp2"], "pipeline_3d"),
        (["strategy=async_easgd", "trainer.devices=3"], "async_easgd"),
        ([], "ddp_compressed"),
    ],
)
def test_unknown_strategy_option_in_a_config_file_is_refused(overrides: list[str], name: str) -> None:
    """A key that only a config file adds (a user's strategy/NAME.yaml or recipe: the command
    line cannot add one) stops before launch; these strategies used to ignore it."""
    from omegaconf import open_dict

    cfg = compose_checked(overrides)
    validate_config(cfg)  # valid as composed
    with open_dict(cfg):
        cfg.strategy.tua = 4
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    message = str(err.value)
    from easgd_lightning.cli.targets import target_path
    from easgd_lightning.strategies.registry import strategy_spec

    # the one rule of every built group (cli/targets.py): the arguments of strategy._target_
    assert message.startswith("strategy.tua: unknown key; "), message
    assert f"valid keys of strategy (arguments of {target_path(strategy_spec(name).cls)}" in message, message
    assert "\n" not in message


def test_threads_beyond_the_cores_warn_naming_the_override(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 31 item 6: recipe=imagenet/alexnet_knl (4 ranks x 16 threads, 2 loaders each) on
    a small machine warns before launch, naming what fits it; within the cores, or with one
    thread per rank (nothing to lower), it does not."""
    from easgd_lightning.cli.values import threads_warning

    knl = compose_checked(["recipe=imagenet/alexnet_knl", "data.synthetic=true"])
    line = threads_warning(knl, cores=2)
    assert line == (
        "threads_per_process=16 x trainer.devices=4 = 64 threads (plus data.num_workers=2 loader processes per "
        "rank) on a machine with 2 cores: the ranks will time-share the cores and run many times slower; on this "
        "machine use threads_per_process=1 trainer.devices=2 data.num_workers=0")
    assert threads_warning(knl, cores=64) is None  # the KNL node it was written for
    assert "use threads_per_process=4" in threads_warning(
        compose_checked(["recipe=imagenet/alexnet_knl", "data.synthetic=true", "trainer.devices=2"]), cores=8)
    assert threads_warning(compose_checked(["trainer.devices=4"]), cores=2) is None  # one thread each
    small = compose_checked(["recipe=imagenet/alexnet_knl", "data.synthetic=true", "threads_per_process=1",
                             "trainer.devices=2", "data.num_workers=0"])
    assert threads_warning(small, cores=2) is None  # the README's small-machine override
    cores = len(os.sched_getaffinity(0))
    with caplog.at_level(logging.WARNING, logger="easgd_lightning"):
        validate_config(compose_checked(["recipe=imagenet/alexnet_knl", "data.synthetic=true",
                                         f"threads_per_process={cores + 1}", "trainer.devices=2"]))
    said = [r.getMessage() for r in caplog.records if "threads_per_process=" in r.getMessage()]
    assert len(said) == 1 and f"on a machine with {cores} cores" in said[0], said


@pytest.mark.parametrize("strategy", ["sync_easgd", "async_easgd", "ddp"])
@pytest.mark.parametrize("compression", ["none", "topk"])
def test_the_readme_sweep_is_accepted(strategy: str, compression: str) -> None:
    """README's sweep ``-m strategy=sync_easgd,async_easgd,ddp trainer.devices=3
    compression=none,topk``: every job passes the check before launch (issue 31: the
    ``async_easgd`` jobs of the former ``compression=none,dgc`` example were refused)."""
    _check([f"strategy={strategy}", "trainer.devices=3", f"compression={compression}"])
