"""Every built config group (strategy, compression, model, data, trainer) follows one rule
(``easgd_lightning/cli/targets.py``): ``_target_`` names what builds it, every key is an
argument of that target (or one easgd-train reads itself), anything else is refused before
launch in one line naming ``group.key`` and the valid keys; a user's own subclass or
factory may stand in ``_target_``. In-process: compose as ``easgd-train`` does, validate,
build."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import open_dict
from torch import nn

import easgd_lightning.cli.train  # noqa: F401  (registers the recipe resolvers)
from easgd_lightning.cli.build import (
    ConfigError,
    build_compression,
    build_model_and_data,
    build_strategy,
)
from easgd_lightning.cli.overrides import CONF_DIR, compose_checked
from easgd_lightning.cli.targets import target_arguments, target_path
from easgd_lightning.cli.validate import validate_config
from easgd_lightning.data import DATA_NAMES, datamodule_target
from easgd_lightning.data.digits import DigitsDataModule
from easgd_lightning.hooks.compressors import TopKCompressor, compressor_class
from easgd_lightning.models import model_factory
from easgd_lightning.models.gpt import gpt_module
from easgd_lightning.strategies import SyncEASGDStrategy
from easgd_lightning.strategies.registry import strategy_spec

# ------------------------------------------------------------------ a user's own targets

class NotedSyncEASGD(SyncEASGDStrategy):
    """A user's strategy: Sync EASGD plus one argument of its own, shown in the summary."""

    def __init__(self, note: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.note = note

    def summary_extras(self) -> dict:
        return {**super().summary_extras(), "note": self.note}


class CountingTopK(TopKCompressor):
    """A user's compressor: top-k that counts its compress calls."""

    def __init__(self, start: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls = start


class HalfDigits(DigitsDataModule):
    """A user's data module: digits with a smaller batch by default."""

    def __init__(self, halve: bool = True, **kwargs) -> None:
        super().__init__(**kwargs)
        self.batch_size //= 2 if halve else 1


def wide_net(in_features: int, num_classes: int, width: int = 16) -> nn.Module:
    """A user's model factory: in_features / num_classes come from the data module."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, width), nn.ReLU(), nn.Linear(width, num_classes))


def _set(cfg, group: str, **keys):
    with open_dict(cfg):
        for key, value in keys.items():
            cfg[group][key] = value
    return cfg


# ------------------------------------------------------------------ the shipped yaml files

def _default_target(group: str, name: str) -> str:
    if group == "strategy":
        return target_path(strategy_spec({"ddp": "ddp_compressed"}.get(name, name)).cls)
    if group == "compression":
        return target_path(compressor_class(name))
    if group == "model":
        return target_path(gpt_module if name == "gpt" else model_factory(name))
    return datamodule_target(name)


@pytest.mark.parametrize("group", ["strategy", "compression", "model", "data"])
def test_every_shipped_option_names_its_target_and_keys_are_its_arguments(group: str) -> None:
    framework = {"strategy": {"name"}, "compression": {"name", "two_way", "plan", "replan_steps", "max_partitions"},
                 "model": {"name", "builder", "channels_last"}, "data": {"name"}}[group]
    for path in sorted(Path(CONF_DIR, group).glob("*.yaml")):
        keys = yaml.safe_load(path.read_text())
        assert keys["_target_"] == _default_target(group, keys["name"]), path.name
        from hydra.utils import get_object

        takes = target_arguments(get_object(keys["_target_"]), ("pytorch_lightning.",), ("process_group_backend",))
        assert set(keys) - {"_target_"} - framework <= takes, path.name


# ------------------------------------------------------------------ unknown keys, one line each

UNKNOWN = [
    # (overrides, group, a key nothing reads, the start of the line, a fragment of the valid keys)
    (["strategy=sync_easgd"], "strategy", "tua",
     "strategy.tua: unknown key; did you mean strategy.tau? valid keys of strategy (arguments of "
     "easgd_lightning.strategies.sync_easgd.SyncEASGDStrategy, and name): ", "alpha, beta"),
    (["compression=topk"], "compression", "ration",
     "compression.ration: unknown key; did you mean compression.ratio? valid keys of compression (arguments of "
     "easgd_lightning.hooks.compressors.topk.TopKCompressor, and name, two_way, plan, replan_steps, "
     "max_partitions): ", "exact, max_partitions, memory, min_numel"),
    (["model=mlp"], "model", "hiden",
     "model.hiden: unknown key; did you mean model.hidden? valid keys of model (arguments of "
     "easgd_lightning.models.factory.mlp, and name, builder, channels_last): ", "hidden, in_features"),
    (["data=digits"], "data", "batchsize",
     "data.batchsize: unknown key; did you mean data.batch_size? valid keys of data (arguments of "
     "easgd_lightning.data.digits.DigitsDataModule, and name): ", "batch_size, name, num_workers"),
    (["trainer=cpu"], "trainer", "max_epocs",
     "trainer.max_epocs: unknown key; did you mean trainer.max_epochs? valid keys of trainer (arguments of "
     "pytorch_lightning.trainer.trainer.Trainer): ", "accumulate_grad_batches"),
]


@pytest.mark.parametrize("overrides,group,key,start,fragment", UNKNOWN, ids=[u[1] for u in UNKNOWN])
def test_an_unknown_key_of_each_group_is_one_line_before_launch(overrides, group, key, start, fragment) -> None:
    cfg = compose_checked(overrides)
    validate_config(cfg, hardware=False)  # valid as composed
    with pytest.raises(ConfigError) as err:
        validate_config(_set(cfg, group, **{key: 1}), hardware=False)
    message = str(err.value)
    assert message.startswith(start), message
    assert fragment in message and "\n" not in message, message


@pytest.mark.parametrize("group,key,where", [
    ("strategy", "compression", "compression=NAME"),
    ("strategy", "timeout", "timeout_s"),
    ("trainer", "callbacks", "easgd-train's own callbacks"),
])
def test_arguments_easgd_train_builds_are_refused_naming_where_they_are_set(group: str, key: str, where: str) -> None:
    cfg = _set(compose_checked(["strategy=sync_easgd"]), group, **{key: "x"})
    with pytest.raises(ConfigError, match=rf"^{group}\.{key}: easgd-train sets it from {where}"):
        validate_config(cfg, hardware=False)


def test_lightning_arguments_of_a_strategy_are_not_config_keys() -> None:
    """The Trainer sets a strategy's accelerator and cluster environment; only
    process_group_backend passes through (the imagenet recipes choose it)."""
    cfg = _set(compose_checked(["strategy=sync_easgd"]), "strategy", accelerator="cpu")
    with pytest.raises(ConfigError, match=r"^strategy\.accelerator: unknown key; .*process_group_backend"):
        validate_config(cfg, hardware=False)
    validate_config(_set(compose_checked(["strategy=sync_easgd"]), "strategy", process_group_backend="gloo"),
                    hardware=False)


# ------------------------------------------------------------------ a user's _target_

def test_a_users_strategy_subclass_takes_its_own_argument() -> None:
    cfg = _set(compose_checked(["strategy=sync_easgd", "strategy.tau=3", "compression=topk"]), "strategy",
               _target_=f"{__name__}.NotedSyncEASGD", note="lab")
    validate_config(cfg, hardware=False)
    strategy = build_strategy(cfg)
    assert type(strategy) is NotedSyncEASGD and strategy.note == "lab" and strategy.tau == 3
    assert type(strategy._compression) is TopKCompressor  # easgd-train's compressor reached it
    with pytest.raises(ConfigError, match=r"^strategy\.nota: unknown key; did you mean strategy\.note\?"):
        validate_config(_set(cfg, "strategy", nota=1), hardware=False)


def test_a_target_of_another_strategy_or_kind_is_refused() -> None:
    cfg = _set(compose_checked(["strategy=sync_easgd"]), "strategy",
               _target_="easgd_lightning.strategies.local_sgd.LocalSGDStrategy")
    with pytest.raises(ConfigError, match=r"^strategy\._target_: '.*LocalSGDStrategy' is no subclass of "
                                          r"easgd_lightning\.strategies\.sync_easgd\.SyncEASGDStrategy "
                                          r"\(the class of strategy\.name=sync_easgd\)"):
        validate_config(cfg, hardware=False)
    cfg = _set(compose_checked([]), "data", _target_="no.such.Module")
    with pytest.raises(ConfigError, match=r"^data\._target_: cannot import 'no\.such\.Module'"):
        validate_config(cfg, hardware=False)


def test_a_users_compressor_data_module_and_model_factory() -> None:
    cfg = compose_checked(["compression=topk", "compression.ratio=0.05"])
    _set(cfg, "compression", _target_=f"{__name__}.CountingTopK", start=7)
    _set(cfg, "data", _target_=f"{__name__}.HalfDigits")
    with open_dict(cfg):
        cfg.model = {"name": "wide", "_target_": f"{__name__}.wide_net", "width": 24}
    validate_config(cfg, hardware=False)
    compressor = build_compression(cfg)
    assert type(compressor) is CountingTopK and compressor.calls == 7 and compressor.ratio == 0.05
    module, dm = build_model_and_data(cfg)
    assert type(dm) is HalfDigits and dm.batch_size == 16
    layers = list(module.net)
    assert (layers[1].in_features, layers[1].out_features, layers[3].out_features) == (64, 24, 10)
    assert type(module).__name__ == "ClassifierModule"  # a network: wrapped with optim.*
    with pytest.raises(ConfigError, match=r"^model\.widht: unknown key; did you mean model\.width\?"):
        validate_config(_set(cfg, "model", widht=3), hardware=False)


def test_shipped_names_still_select_and_check() -> None:
    """``name`` stays what summaries and reports show; a shipped target checks it."""
    with pytest.raises(ConfigError, match=r"^model\.name='nonsense' is unknown; choose one of alexnet"):
        validate_config(compose_checked(["model.name=nonsense"]), hardware=False)
    with pytest.raises(ConfigError, match=r"^data\.name='nonsense' is unknown; choose one of digits"):
        validate_config(compose_checked(["data.name=nonsense"]), hardware=False)
    assert set(DATA_NAMES) == {"digits", "imagenet", "synthetic", "text"}


def test_a_config_without_target_builds_the_class_of_its_name() -> None:
    """A config file of one's own written before _target_ (name only) still builds."""
    cfg = compose_checked(["strategy=sync_easgd", "compression=topk"])
    with open_dict(cfg):
        for group in ("strategy", "compression", "model", "data"):
            del cfg[group]["_target_"]
    validate_config(cfg, hardware=False)
    assert type(build_strategy(cfg)) is SyncEASGDStrategy
    module, dm = build_model_and_data(cfg)
    assert type(dm) is DigitsDataModule and module.net[1].in_features == 64
