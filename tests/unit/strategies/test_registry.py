"""The strategy registry is the one source of names, minimum world sizes and options.

Every registered strategy satisfies the protocol the CLI and the summary read, declares
exactly the options of its config file, refuses unknown keyword arguments in one line, and
is what Lightning's ``StrategyRegistry`` and the CLI hand out under its name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry

import easgd_lightning  # noqa: F401  (registers with Lightning)
from easgd_lightning.cli import build
from easgd_lightning.cli.overrides import CONF_DIR
from easgd_lightning.strategies import STRATEGY_CLASSES
from easgd_lightning.strategies.registry import (
    StrategyProtocol,
    check_options,
    register_strategy,
    strategy_spec,
    strategy_specs,
)

SPECS = strategy_specs()
EXPECTED = {  # name -> fewest processes, written out here independently of the classes
    "ddp_compressed": 1, "sync_easgd": 2, "easgd_round_robin": 2, "local_sgd": 1, "diloco": 1, "pipeline_3d": 1,
    "async_easgd": 3, "async_measgd": 3, "async_sgd": 3, "async_msgd": 3, "hogwild_easgd": 2, "hogwild_sgd": 2,
}


def _config_file(name: str) -> Path:
    """conf/strategy/<option>.yaml of a registered name (Hydra's option may differ)."""
    files = {yaml.safe_load(f.read_text())["name"]: f for f in sorted(Path(CONF_DIR, "strategy").glob("*.yaml"))}
    return files[name] if name in files else files[SPECS[name].config_name]


def test_every_strategy_is_registered_once_with_its_minimum_world_size() -> None:
    assert {n: s.min_world_size for n, s in SPECS.items()} == EXPECTED
    assert build.strategy_names() == list(SPECS)
    assert STRATEGY_CLASSES == {n: s.cls for n, s in SPECS.items()}
    for name, spec in SPECS.items():
        assert spec.cls.strategy_name == name
        assert build.min_world_size(name) == EXPECTED[name]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_strategy_satisfies_the_protocol(name: str) -> None:
    strategy = SPECS[name].cls()
    assert isinstance(strategy, StrategyProtocol)
    assert strategy.local_steps == 0
    assert isinstance(strategy.summary_extras(), dict)
    if name == "pipeline_3d":  # pp = 1 (the default): any world is a data-parallel layout
        strategy.validate_world_size(2)
    else:
        strategy.validate_world_size(EXPECTED[name])
    if EXPECTED[name] > 1:
        with pytest.raises(ValueError, match=r"^trainer\.devices: .* needs at least") as err:
            strategy.validate_world_size(EXPECTED[name] - 1)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_options_are_the_keys_of_the_config_file(name: str) -> None:
    keys = set(yaml.safe_load(_config_file(name).read_text())) - {"name", "_target_"}
    assert set(SPECS[name].options) == keys


@pytest.mark.parametrize("name", list(EXPECTED))
def test_unknown_keyword_is_refused_in_one_line(name: str) -> None:
    with pytest.raises(ValueError) as err:
        SPECS[name].cls(tua=4)
    message = str(err.value)
    assert message.startswith(f"strategy.tua is not an option of {name}; its options are: ")
    assert "\n" not in message
    with pytest.raises(ValueError, match=rf"^strategy\.tua is not an option of {name}"):
        check_options(name, ["tua"])
    check_options(name, SPECS[name].options)


def test_lightning_keywords_still_pass() -> None:
    from datetime import timedelta

    strategy = SPECS["sync_easgd"].cls(tau=2, timeout=timedelta(seconds=5), process_group_backend="gloo")
    assert strategy.tau == 2 and strategy._timeout == timedelta(seconds=5)


def test_lightning_registry_hands_out_the_same_classes() -> None:
    for name, spec in SPECS.items():
        assert StrategyRegistry[name]["strategy"] is spec.cls
    assert StrategyRegistry["ddp"]["strategy"] is DDPStrategy  # Lightning's own name stays Lightning's


def test_unknown_name_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"^strategy\.name='bogus' is unknown; choose one of async_easgd, "):
        strategy_spec("bogus")


def test_a_second_class_cannot_take_a_registered_name() -> None:
    class Impostor(DDPStrategy):
        """Not the real sync_easgd."""

    with pytest.raises(ValueError, match="'sync_easgd' is registered already, by SyncEASGDStrategy"):
        register_strategy("sync_easgd", options=())(Impostor)
    assert strategy_spec("sync_easgd").cls is STRATEGY_CLASSES["sync_easgd"]


def test_ddp_passes_torch_ddp_keywords_on() -> None:
    strategy = SPECS["ddp_compressed"].cls(find_unused_parameters=True, bucket_cap_mb=5)
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "bucket_cap_mb": 5}
