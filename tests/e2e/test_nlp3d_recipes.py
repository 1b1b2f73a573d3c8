"""The nlp3d recipes: they compose and validate, bad layouts fail before any process
starts, and the tiny pipeline recipe trains through the real CLI."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import REPO, compose, run_cli

RECIPES = sorted(p.stem for p in (REPO / "recipes" / "nlp3d").glob("*.yaml"))


def test_all_recipes_listed():
    assert RECIPES == [
        "gpt2_medium_3d", "gpt2_medium_3d_optimus", "gpt2_small_3d", "gpt_tiny_pp2",
        "gpt_tiny_pp2_dp2_optimus",
    ]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_validates(name):
    from easgd_lightning.cli.validate import validate_config

    cfg = compose([f"recipe=nlp3d/{name}"])
    assert cfg.strategy.name == "pipeline_3d"
    world = cfg.trainer.devices * cfg.trainer.num_nodes
    assert cfg.strategy.pp * cfg.strategy.tp * cfg.strategy.dp == world
    assert cfg.data.batch_size % cfg.strategy.micro_batches == 0
    validate_config(cfg, hardware=False)  # layout and model shape checked without starting processes
    text = (REPO / "recipes" / "nlp3d" / f"{name}.yaml").read_text()
    assert "easgd-train" in text or "torchrun" in text  # each recipe says how to launch it


# bad layouts (pp * tp * dp, pp > n_layer, tp not dividing n_head) fail before any process:
# tests/unit/cli/test_validation.py


@pytest.mark.slow
def test_tiny_pipeline_recipe_trains_through_the_cli(tmp_path):
    run_cli(
        [f"hydra.run.dir={tmp_path}", "recipe=nlp3d/gpt_tiny_pp2_dp2_optimus", "logger=csv",
         "trainer.max_steps=12", "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false"],
        timeout=400,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["strategy"] == "pipeline_3d"
    assert summary["compression"] == "optimus_cc" and summary["world_size"] == 4
    assert summary["steps_per_rank"] == [12] * 4
    assert math.isfinite(summary["val_loss"]) and summary["val_loss"] < math.log(256)
    kinds = summary["comm"]["by_kind"]
    assert {"pipeline", "data_parallel", "embedding"} <= set(kinds)
    assert kinds["pipeline"]["bytes_sent"] < kinds["pipeline"]["dense_bytes"]
