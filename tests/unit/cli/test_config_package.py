"""The shipped config tree, extended by a user's own directory (``hydra.searchpath``): the
command-line checker sees the user's groups and options exactly as Hydra's run does. The
``trainer`` group is the Trainer's own arguments (``_target_``): each reaches it, any other
key is refused before launch."""

from __future__ import annotations

from pathlib import Path

import pytest
import pytorch_lightning as pl

from easgd_lightning.cli.overrides import check_command_line, compose_checked
from easgd_lightning.cli.trainer_config import build_trainer, check_trainer_keys
from easgd_lightning.cli.validate import ConfigError, validate_config
from easgd_lightning.config_tree import CONF_DIR, CONF_PATH, RECIPES_DIR, locate
from hydra_plugins.easgd_lightning_recipes.source import checkout_recipes


@pytest.fixture
def user_conf(tmp_path: Path) -> Path:
    (tmp_path / "strategy").mkdir()
    (tmp_path / "strategy" / "my_sync.yaml").write_text("defaults:\n  - sync_easgd\n  - _self_\ntau: 2\n")
    (tmp_path / "recipe" / "mine").mkdir(parents=True)
    (tmp_path / "recipe" / "mine" / "short.yaml").write_text("# @package _global_\ntrainer:\n  max_steps: 5\n")
    return tmp_path


def test_a_checkout_reads_its_top_level_conf_and_recipes() -> None:
    repo = Path(__file__).resolve().parents[3]
    assert (Path(CONF_DIR), CONF_PATH, Path(RECIPES_DIR)) == (repo / "conf", str(repo / "conf"), repo / "recipes")
    assert (Path(CONF_DIR) / "train.yaml").is_file()
    assert (Path(RECIPES_DIR) / "imagenet" / "alexnet_knl.yaml").is_file()
    assert not list((repo / "easgd_lightning").rglob("*.yaml"))  # one source: no copy inside the package
    assert checkout_recipes(f"file://{CONF_DIR}") == repo / "recipes"  # the plugin mounts them as recipe/
    cfg = compose_checked(["recipe=imagenet/alexnet_knl"])
    assert (cfg.strategy.name, cfg.model.name, cfg.data.name) == ("sync_easgd", "alexnet", "imagenet")


def test_the_config_tree_is_located_by_the_package_directory(tmp_path: Path) -> None:
    """The rule of ``locate``: the package's own conf/ (a wheel), else the checkout's."""
    checkout, package = tmp_path / "checkout", tmp_path / "checkout" / "easgd_lightning"
    (checkout / "conf").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"^easgd-lightning's config tree is missing: neither .*$"):
        locate(package)
    (checkout / "conf" / "train.yaml").write_text("seed: 0\n")
    assert locate(package) == (checkout / "conf", str(checkout / "conf"), checkout / "recipes")
    (package / "conf").mkdir(parents=True)
    (package / "conf" / "train.yaml").write_text("seed: 0\n")  # a wheel's layout wins
    assert locate(package) == (package / "conf", "pkg://easgd_lightning.conf", package / "conf" / "recipe")


def test_the_recipes_plugin_leaves_other_config_directories_alone(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "recipes").mkdir()
    assert checkout_recipes(str(tmp_path / "conf")) is None  # no easgd_lightning/ beside it
    (tmp_path / "easgd_lightning").mkdir()
    (tmp_path / "easgd_lightning" / "config_tree.py").write_text("")
    assert checkout_recipes(str(tmp_path / "conf")) == tmp_path / "recipes"
    assert checkout_recipes(f"file://{tmp_path / 'conf'}") == tmp_path / "recipes"
    assert checkout_recipes("pkg://easgd_lightning.conf") is None  # an installed wheel
    assert checkout_recipes(str(tmp_path / "recipes")) is None


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


# ------------------------------------------------------------------ trainer keys (_target_)

class NotedTrainer(pl.Trainer):
    """A user's Trainer subclass with one argument of its own (trainer._target_)."""

    def __init__(self, note: str = "", **kwargs):
        super().__init__(**kwargs)
        self.note = note


def _with_recipe(user_conf: Path, text: str, *overrides: str):
    (user_conf / "recipe" / "mine" / "extra.yaml").write_text("# @package _global_\n" + text)
    return compose_checked([f"hydra.searchpath=[file://{user_conf}]", "recipe=mine/extra", *overrides])


def test_every_shipped_trainer_key_reaches_the_trainer() -> None:
    cfg = compose_checked(["trainer.devices=1", "trainer.max_epochs=3", "trainer.limit_val_batches=2"])
    assert check_trainer_keys(cfg) is pl.Trainer
    trainer = build_trainer(cfg, strategy="auto", logger=False, enable_checkpointing=False)
    assert type(trainer) is pl.Trainer
    assert (trainer.max_epochs, trainer.limit_val_batches, trainer.num_sanity_val_steps) == (3, 2, 0)
    assert trainer.log_every_n_steps == cfg.trainer.log_every_n_steps == 10
    assert trainer.accumulate_grad_batches == 1 and trainer.check_val_every_n_epoch == 1
    assert not any(type(c).__name__ == "ModelSummary" for c in trainer.callbacks)  # our default: off
    shipped = {str(k) for k in cfg.trainer} - {"_target_"}
    assert shipped >= {"accelerator", "devices", "precision", "max_steps", "gradient_clip_val", "deterministic"}


def test_a_trainer_key_the_worker_did_not_map_now_reaches_the_trainer(user_conf: Path) -> None:
    cfg = _with_recipe(user_conf, "trainer:\n  val_check_interval: 0.5\n  gradient_clip_algorithm: value\n",
                       "trainer.devices=1")
    validate_config(cfg, hardware=False)
    trainer = build_trainer(cfg, strategy="auto", logger=False, enable_checkpointing=False)
    assert trainer.val_check_interval == 0.5
    assert trainer.gradient_clip_algorithm == "value"


def test_an_unknown_trainer_key_is_one_line_before_launch(user_conf: Path) -> None:
    cfg = _with_recipe(user_conf, "trainer:\n  max_epocs: 1\n")
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, hardware=False)
    message = str(err.value)
    assert message.startswith("trainer.max_epocs: unknown key; did you mean trainer.max_epochs? valid keys of trainer")
    assert "accumulate_grad_batches" in message and "threads_per_process" not in message and "\n" not in message


def test_trainer_arguments_built_by_easgd_train_are_refused(user_conf: Path) -> None:
    cfg = _with_recipe(user_conf, "trainer:\n  strategy: ddp_spawn\n")
    with pytest.raises(ConfigError, match=r"^trainer.strategy: easgd-train sets it from strategy=NAME"):
        validate_config(cfg, hardware=False)


def test_trainer_target_may_be_a_subclass_with_its_own_arguments(user_conf: Path) -> None:
    cfg = _with_recipe(user_conf, f"trainer:\n  _target_: {__name__}.NotedTrainer\n  note: lab\n",
                       "trainer.devices=1")
    validate_config(cfg, hardware=False)
    trainer = build_trainer(cfg, strategy="auto", logger=False, enable_checkpointing=False)
    assert isinstance(trainer, NotedTrainer) and trainer.note == "lab" and trainer.max_epochs == 10
    with pytest.raises(ConfigError, match=r"^trainer._target_: 'builtins.dict' is no subclass of pytorch_lightning.Trainer"):
        check_trainer_keys(compose_checked(["trainer._target_=builtins.dict"]))
