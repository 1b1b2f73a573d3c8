"""The shipped config tree, extended by a user's own directory (``hydra.searchpath``): the
command-line checker sees the user's groups and options exactly as Hydra's run does."""

from __future__ import annotations

from pathlib import Path

import pytest

from easgd_lightning.cli.build import ConfigError, validate_config
from easgd_lightning.cli.overrides import check_command_line, compose_checked
from easgd_lightning.conf import CONF_DIR, CONF_PACKAGE


@pytest.fixture
def user_conf(tmp_path: Path) -> Path:
    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "my_sync.yaml").write_text("defaults:\n  - sync_easgd\n  - _self_\ntau: 2\n")
    (tmp_path / "recipe" / "mine").mkdir(parents=True)
    (tmp_path / "recipe" / "mine" / "short.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: 5\n")
    return tmp_path


def test_config_tree_is_package_data() -> None:
    package_dir = Path(__file__).resolve().parents[2] / "easgd_lightning"
    assert Path(CONF_DIR) == package_dir / "conf"
    assert (Path(CONF_DIR) / "train.yaml").is_file()
    assert (Path(CONF_DIR) / "recipe" / "imagenet" / "alexnet_knl.yaml").is_file()
    assert CONF_PACKAGE == "pkg://easgd_lightning.conf"


def test_a_users_directory_adds_options_and_recipes(user_conf: Path) -> None:
    searchpath = f"hydra.searchpath=[file://{user_conf}]"
    cfg = compose_checked([searchpath, "strategy=my_sync", "recipe=mine/short", "strategy.alpha=0.3"])
    assert cfg.strategy.name == "sync_easgd" and cfg.strategy.tau == 2 and cfg.strategy.alpha == 0.3
    assert cfg.trainer.max_steps == 5
    assert cfg.compression.name == "none"  # the rest from the shipped tree
    validate_config(cfg, hardware=False)
    check_command_line([searchpath, "-m", "strategy=my_sync,ddp"])  # every job of a sweep


def test_without_the_searchpath_the_users_option_is_unknown(user_conf: Path) -> None:
    with pytest.raises(ConfigError, match=r"^strategy=my_sync: no such option; .*choose one of async_easgd"):
        compose_checked(["strategy=my_sync"])


def test_unknown_key_of_a_users_option_is_one_line(user_conf: Path) -> None:
    with pytest.raises(ConfigError) as err:
        compose_checked([f"hydra.searchpath=[file://{user_conf}]", "strategy=my_sync", "strategy.tauu=3"])
    message = str(err.value)
    assert message.startswith("strategy.tauu: unknown key; did you mean strategy.tau? valid keys of strategy (strategy=my_sync)")
    assert "\n" not in message
