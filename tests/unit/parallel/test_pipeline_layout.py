"""Bad 3D layouts fail before any process starts, with a line naming the keys."""

from __future__ import annotations

import pytest

from easgd_lightning.parallel.layout import validate_layout


def test_valid_layout():
    layout = validate_layout(2, 2, 2, 8, n_layers=4, n_heads=4, d_model=64, micro_batches=4)
    assert (layout.pp, layout.tp, layout.dp, layout.world_size) == (2, 2, 2, 8)


def test_product_must_equal_world_size():
    with pytest.raises(ValueError, match=r"strategy.pp \* strategy.tp \* strategy.dp = 2 \* 1 \* 1 = 2 must equal the world size 4"):
        validate_layout(2, 1, 1, 4)


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match=r"strategy.pp \(4\) is larger than model.n_layer \(2\)"):
        validate_layout(4, 1, 1, 4, n_layers=2, n_heads=4)


def test_tp_must_divide_heads():
    with pytest.raises(ValueError, match=r"strategy.tp \(3\) must divide model.n_head \(4\); allowed tp values: \[1, 2, 4\]"):
        validate_layout(1, 3, 1, 3, n_layers=2, n_heads=4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_degrees_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="strategy.pp must be an integer >= 1"):
        validate_layout(bad, 1, 1, 1)


def test_strategy_checks_layout_before_processes_start():
    from easgd_lightning.strategies.pipeline import Pipeline3DStrategy

    strategy = Pipeline3DStrategy(pp=2, tp=1, dp=1, n_layer=4, n_head=4)
    with pytest.raises(ValueError, match="must equal the world size 4"):
        strategy.validate_world_size(4)
    strategy.validate_world_size(2)
    with pytest.raises(ValueError, match=r"strategy.pp \(3\) is larger than model.n_layer \(2\)"):
        Pipeline3DStrategy(pp=3, n_layer=2).validate_world_size(3)
    with pytest.raises(ValueError, match=r"strategy.tp \(3\) must divide model.n_head \(4\)"):
        Pipeline3DStrategy(tp=3, n_head=4).validate_world_size(3)
    with pytest.raises(ValueError, match="strategy.micro_batches must be an integer >= 1"):
        Pipeline3DStrategy(micro_batches=0)


def test_strategy_compression_choices():
    from easgd_lightning.hooks.optimus_cc import OptimusCCConfig
    from easgd_lightning.strategies.pipeline import resolve_optimus, split_micro_batches

    assert resolve_optimus(None) is None and resolve_optimus({"name": "none"}) is None
    cfg = resolve_optimus({"name": "optimus_cc", "rank": 8, "epilogue_only": True})
    assert isinstance(cfg, OptimusCCConfig) and cfg.rank == 8 and cfg.epilogue_only
    with pytest.raises(ValueError, match="compression=none or compression=optimus_cc, got 'topk'"):
        resolve_optimus({"name": "topk", "ratio": 0.01})
    import torch

    parts = split_micro_batches((torch.arange(8).view(8, 1), torch.arange(8)), 4)
    assert [p[1].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"data.batch_size\) must be a multiple of strategy.micro_batches"):
        split_micro_batches((torch.zeros(6, 1), torch.zeros(6)), 4)
