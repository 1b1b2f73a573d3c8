"""ImageNet recipes: they compose with the papers' values, and one per model trains through the CLI.

The runs use ``data.synthetic=true`` at 64 px, 2 CPU processes, 2 optimizer steps; the
recipe's own model, per-worker batch, optimizer and lr schedule must reach the Trainer
(each rank records what it trained with in ``summary.json``'s ``extras[r]["run"]``).
One Hydra multirun trains one recipe of each model, both hardware kinds and both lr
schedules among them (one parent process, each job its own workers); the other three
differ from these only in values the composition tests check.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, run_cli, train_summary
from tests.helpers import compose as _compose

RECIPE_DIR = REPO / "recipes" / "imagenet"
RECIPES = ["alexnet_gpu", "alexnet_knl", "googlenet_gpu", "googlenet_knl", "resnet50_gpu", "resnet50_knl"]
#: trained through the CLI: each model once, gpu and knl (bf16-mixed / CPU precision) both
TRAINED = ["alexnet_knl", "googlenet_gpu", "resnet50_knl"]

# The papers' values, written out independently of the recipe files (see their comments).
ALEXNET = dict(model="alexnet", model_class="AlexNet", strategy="sync_easgd", batch=128, lr=0.01,
               momentum=0.9, weight_decay=5e-4, schedule="step", gamma=0.1, step_size_epochs=20,
               warmup_epochs=0, milestone_epochs=None, max_epochs=90)
GOOGLENET = dict(model="googlenet", model_class="GoogLeNet", strategy="sync_easgd", batch=32, lr=0.01,
                 momentum=0.9, weight_decay=2e-4, schedule="step", gamma=0.96, step_size_epochs=8,
                 warmup_epochs=0, milestone_epochs=None, max_epochs=250)
RESNET50 = dict(model="resnet50", model_class="ResNet", strategy="ddp", batch=32, lr=None,  # linear rule
                momentum=0.9, weight_decay=1e-4, schedule="multistep", gamma=0.1, step_size_epochs=None,
                warmup_epochs=5, milestone_epochs=[30, 60, 80], max_epochs=90)
PAPER = {"alexnet": ALEXNET, "googlenet": GOOGLENET, "resnet50": RESNET50}
HARDWARE = {
    "gpu": dict(accelerator="gpu", devices=8, threads=None, backend=None),
    "knl": dict(accelerator="cpu", devices=4, threads=16, backend="gloo"),
}


def _expect(recipe: str) -> dict:
    model, kind = recipe.split("_")
    return {**PAPER[model], **HARDWARE[kind], "kind": kind}


def _cpu_has_native_bf16() -> bool:
    """Independent of the resolver: read the CPU flags."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# ----------------------------------------------------------------------------- composition
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_file_layout(recipe: str) -> None:
    text = (RECIPE_DIR / f"{recipe}.yaml").read_text()
    lines = text.splitlines()
    assert lines[0] == "# @package _global_"
    header = "\n".join(ln for ln in lines if ln.startswith("#"))
    assert f"easgd-train recipe=imagenet/{recipe}" in header  # the exact launch command
    assert "torchrun" in header and "Values and sources" in header
    sections = [ln.split()[-1] for ln in lines if ln.startswith("# ----")]
    assert sections == ["data", "model", "optimisation", "parallelism", "logging"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_composes_with_the_papers_values(recipe: str) -> None:
    from omegaconf import OmegaConf

    e = _expect(recipe)
    cfg = OmegaConf.to_container(_compose([f"recipe=imagenet/{recipe}"]), resolve=True)
    assert cfg["model"]["name"] == e["model"] and cfg["model"]["channels_last"] is True
    assert cfg["data"]["name"] == "imagenet" and cfg["data"]["image_size"] == 224
    assert cfg["data"]["batch_size"] == e["batch"]
    assert cfg["strategy"]["name"] == e["strategy"]
    o = cfg["optim"]
    assert (o["optimizer"], o["momentum"], o["weight_decay"], o["schedule"], o["gamma"]) == (
        "sgd", e["momentum"], e["weight_decay"], e["schedule"], e["gamma"]
    )
    assert o["warmup_epochs"] == e["warmup_epochs"]
    assert o["step_size_epochs"] == e["step_size_epochs"]
    assert o["milestone_epochs"] == e["milestone_epochs"]
    t = cfg["trainer"]
    assert (t["accelerator"], t["devices"], t["num_nodes"], t["max_epochs"]) == (
        e["accelerator"], e["devices"], 1, e["max_epochs"]
    )
    assert cfg.get("threads_per_process") == e["threads"]
    assert cfg["strategy"].get("process_group_backend") == e["backend"]
    if e["kind"] == "gpu":
        assert t["precision"] == "bf16-mixed"
    else:
        assert t["precision"] == ("bf16-mixed" if _cpu_has_native_bf16() else "32-true")
    if e["strategy"] == "sync_easgd":  # tau 1; alpha/beta unset: the default beta = 0.9
        assert (cfg["strategy"]["tau"], cfg["strategy"]["alpha"], cfg["strategy"]["beta"]) == (1, None, None)
    if e["model"] == "resnet50":  # Goyal et al.: lr = 0.1 * k*n / 256
        assert o["lr"] == pytest.approx(0.1 * e["batch"] * e["devices"] / 256)
        assert cfg["model"]["zero_init_residual"] is True
    else:
        assert o["lr"] == e["lr"]
    assert e["model"] in cfg["logger"]["tags"] and e["kind"] in cfg["logger"]["tags"]


@pytest.mark.parametrize("strategy", ["ddp", "sync_easgd", "easgd_round_robin"])
def test_recipe_composes_with_any_strategy(strategy: str) -> None:
    """Recipes carry no strategy-specific keys, so strategy sweeps over a recipe validate."""
    from easgd_lightning.cli.validate import validate_config

    cfg = _compose(["recipe=imagenet/googlenet_knl", f"strategy={strategy}", "data.synthetic=true",
                    "trainer.devices=2"])
    validate_config(cfg)
    assert cfg.strategy.name == strategy and cfg.strategy.process_group_backend == "gloo"


def test_command_line_beats_the_recipe() -> None:
    from omegaconf import OmegaConf

    cfg = _compose(["recipe=imagenet/resnet50_gpu", "trainer.num_nodes=4", "data.batch_size=64", "compression=fp16"])
    assert cfg.compression.name == "fp16"
    assert OmegaConf.to_container(cfg.optim, resolve=True)["lr"] == pytest.approx(0.1 * 64 * 8 * 4 / 256)


@pytest.mark.parametrize("launcher,gpus", [("slurm", None), ("slurm_gpu", 8)])
def test_slurm_launcher_configs(launcher: str, gpus: int | None) -> None:
    recipe = "alexnet_knl" if launcher == "slurm" else "alexnet_gpu"
    cfg = _compose([f"recipe=imagenet/{recipe}", f"hydra/launcher={launcher}"], hydra_config=True)
    lc = cfg.hydra.launcher
    assert lc._target_ == "hydra_plugins.easgd_lightning_slurm.launcher.SlurmLauncher"  # wraps the submitit plugin
    assert lc.tasks_per_node == cfg.trainer.devices and lc.nodes == cfg.trainer.num_nodes
    assert lc.gpus_per_node == gpus
    if launcher == "slurm":
        assert lc.cpus_per_task == 16  # threads_per_process
    # every key is a field of the submitit plugin's SlurmQueueConf (hydra-submitit-launcher 1.2)
    fields = {
        "_target_", "submitit_folder", "timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node",
        "mem_gb", "nodes", "name", "stderr_to_stdout", "partition", "qos", "comment", "constraint",
        "exclude", "gres", "cpus_per_gpu", "gpus_per_task", "mem_per_gpu", "mem_per_cpu", "account",
        "signal_delay_s", "max_num_timeout", "additional_parameters", "array_parallelism", "setup",
    }
    assert set(lc.keys()) <= fields


def test_missing_data_root_is_a_config_error() -> None:
    from easgd_lightning.cli.validate import ConfigError, validate_config

    with pytest.raises(ConfigError, match=r"data\.root is not set.*train/<class>/<image>"):
        validate_config(_compose(["recipe=imagenet/alexnet_gpu", "trainer.accelerator=cpu", "trainer.devices=2"]))


def test_bad_data_root_is_a_config_error(tmp_path: Path) -> None:
    """In-process, as easgd-train checks it before any process (the CLI's exit 2 and single
    line for a value error: tests/e2e/test_bad_input_cli.py)."""
    from easgd_lightning.cli.validate import ConfigError, validate_config

    with pytest.raises(ConfigError) as err:
        validate_config(_compose(["recipe=imagenet/alexnet_knl", f"data.root={tmp_path / 'nope'}"]))
    line = str(err.value)
    assert line.startswith("data.root=") and "\n" not in line
    assert "does not exist" in line and "<data.root>/train/<class>" in line


# ----------------------------------------------------------------------------- training
SMOKE = [
    "++data.synthetic=true", "++data.image_size=64", "++data.train_size=512",
    "++data.val_size=16", "++data.train_eval_size=8", "++data.val_batch_size=8",
    "data.num_workers=0", "trainer.accelerator=cpu", "trainer.devices=2", "threads_per_process=1",
    "trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1",
    "checkpoint.enabled=false", "logger=csv", "trainer.enable_progress_bar=false",
]


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory) -> dict[str, dict]:
    """The TRAINED recipes, 2 steps each, one multirun; {recipe: summary}."""
    sweep = tmp_path_factory.mktemp("recipes")
    recipes = ",".join(f"imagenet/{r}" for r in TRAINED)
    proc = run_cli(["-m", f"recipe={recipes}", *SMOKE, f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"],
                   check=False, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-6000:]
    runs = {}
    for job in sorted(p for p in sweep.iterdir() if p.is_dir()):
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        recipe = next(o.split("/")[-1] for o in overrides if o.startswith("recipe="))
        runs[recipe] = json.loads((job / "summary.json").read_text())
    assert sorted(runs) == sorted(TRAINED), proc.stderr[-3000:]
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("recipe", TRAINED)
def test_recipe_trains_two_steps_with_its_settings(recipe_runs: dict, recipe: str) -> None:
    e = _expect(recipe)
    s = recipe_runs[recipe]
    assert s["status"] == "ok", s.get("error")
    assert s["strategy"] == e["strategy"] and s["world_size"] == 2
    assert s["steps_per_rank"] == [2, 2]
    assert all(b > 0 for b in s["comm"]["bytes_sent"])
    assert math.isfinite(s["train_loss"]) and s["val_acc"] is not None
    assert s["config"]["optim"]["schedule"] == e["schedule"]
    if e["strategy"] == "sync_easgd":  # SC17: every iteration, beta = p * alpha = 0.9
        assert s["extras"][0]["tau"] == 1
        assert s["extras"][0]["beta"] == pytest.approx(0.9) and s["extras"][0]["alpha"] == pytest.approx(0.45)
    lr = e["lr"] if e["lr"] is not None else 0.1 * e["batch"] * 2 / 256  # linear rule at 2 workers
    for rank in range(2):
        run = s["extras"][rank]["run"]
        assert run["model_class"] == e["model_class"] and run["module_class"] == "ClassifierModule"
        assert run["datamodule_class"] == "ImageNetDataModule"
        assert (run["batch_size"], run["num_classes"], run["image_size"]) == (e["batch"], 1000, 64)
        assert run["channels_last"] is True and run["torch_threads"] == 1
        assert run["process_group_backend"] == "gloo"
        if e["kind"] == "gpu":
            assert run["precision"] == "bf16-mixed"
        else:
            assert run["precision"] == ("bf16-mixed" if _cpu_has_native_bf16() else "32-true")
        assert run["optimizer"] == "SGD"
        assert (run["momentum"], run["weight_decay"]) == (e["momentum"], e["weight_decay"])
        assert run["lr_initial"] == pytest.approx(lr)
        sched = run["schedule"]
        assert sched["steps_per_epoch"] == 2  # limit_train_batches=2: epochs convert at 2 steps
        assert sched["warmup_steps"] == e["warmup_epochs"] * 2
        if e["schedule"] == "step":
            assert sched["step_size"] == e["step_size_epochs"] * 2 and sched["gamma"] == e["gamma"]
            expected_final = lr  # 2 steps: no decay yet
        else:
            assert sched["milestones"] == [m * 2 for m in e["milestone_epochs"]]
            expected_final = lr * 3 / (e["warmup_epochs"] * 2)  # linear warm-up, after 2 steps
        assert run["lr_final"] == pytest.approx(expected_final)


# ----------------------------------------------------------------------------- real files
def _jpeg_tree(root: Path, classes: int = 3, train_per_class: int = 4, val_per_class: int = 2) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for i in range(n):
                h, w = rng.integers(40, 72, size=2)
                pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
                pixels[..., c] = 255 - pixels[..., c] // 4  # a colour cue per class
                Image.fromarray(pixels).save(folder / f"img_{i}.JPEG", quality=90)


@pytest.mark.slow
def test_imagefolder_tree_trains_via_data_root(tmp_path: Path) -> None:
    tree = tmp_path / "imagenet"
    _jpeg_tree(tree)
    s = train_summary(
        tmp_path / "run", "recipe=imagenet/googlenet_knl", f"data.root={tree}", "data.image_size=32",
        "data.batch_size=2", "data.num_workers=1", "data.train_eval_size=null", "trainer.devices=2",
        "threads_per_process=1", "trainer.max_epochs=1", "checkpoint.enabled=false",
        timeout=600,
    )
    assert s["status"] == "ok", s.get("error")
    assert s["steps_per_rank"] == [3, 3]  # 12 training images / 2 ranks / batch 2
    run = s["extras"][0]["run"]
    assert run["num_classes"] == 3 and run["model_class"] == "GoogLeNet" and run["image_size"] == 32
    assert s["val_acc"] is not None and 0.0 <= s["val_acc"] <= 1.0
    assert math.isfinite(s["train_loss"]) and s["samples_per_s"] > 0
    assert s["config"]["data"]["root"] == str(tree)
