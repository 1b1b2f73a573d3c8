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
    with pytest.raises(ValueError, match="strategy.pp must be a positive integer"):
        validate_layout(bad, 1, 1, 1)
