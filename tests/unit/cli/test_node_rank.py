"""``NODE_RANK`` from ``RANK`` / ``LOCAL_RANK`` for launchers that set neither it nor
``GROUP_RANK`` (DeepSpeed's launcher): Lightning computes ``global = node * devices + local``."""

from __future__ import annotations

import os

import pytest

from easgd_lightning.cli.build import ConfigError
from easgd_lightning.cli.train import _set_node_rank


@pytest.fixture
def env(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(key, raising=False)
    return monkeypatch


@pytest.mark.parametrize("rank,local,devices,node", [(0, 0, 2, "0"), (3, 1, 2, "1"), (5, 1, 2, "2"), (7, 3, 4, "1")])
def test_node_rank_inverts_lightnings_rule(env, rank, local, devices, node) -> None:
    env.setenv("RANK", str(rank))
    env.setenv("LOCAL_RANK", str(local))
    _set_node_rank(devices)
    assert os.environ["NODE_RANK"] == node
    assert int(node) * devices + local == rank  # what LightningEnvironment will compute


@pytest.mark.parametrize("preset", ["NODE_RANK", "GROUP_RANK"])
def test_launchers_node_rank_is_kept(env, preset) -> None:
    env.setenv("RANK", "3")
    env.setenv("LOCAL_RANK", "1")
    env.setenv(preset, "7")
    _set_node_rank(2)
    assert os.environ.get("NODE_RANK", "7") == "7" and os.environ[preset] == "7"


def test_devices_that_do_not_match_the_launcher_name_the_key(env) -> None:
    env.setenv("RANK", "3")
    env.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError, match=r"trainer.devices=2 is not the launcher's processes per node"):
        _set_node_rank(2)
