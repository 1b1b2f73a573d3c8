"""Where a sharded center (``strategy.servers``) is cut, and the merge of the servers' states
(easgd_lightning/strategies/ps/shards.py), against values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from easgd_lightning.strategies.ps.shards import (
    aligned_bounds,
    equal_bounds,
    merge_states,
    shard_bounds,
)


def test_equal_numel_cut_covers_the_center_contiguously() -> None:
    assert equal_bounds(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert equal_bounds(9610, 2) == [(0, 4805), (4805, 9610)]
    assert shard_bounds("elastic", [8192, 128, 1280, 10], 9610, 1) == [(0, 9610)]


def test_parameter_aligned_cut_takes_the_nearest_boundary_and_keeps_a_tensor_per_shard() -> None:
    # digits MLP: 8192 | 128 | 1280 | 10; the middle (4805) is nearest the end of the first weight
    assert shard_bounds("sgd", [8192, 128, 1280, 10], 9610, 2) == [(0, 8192), (8192, 9610)]
    # four equal tensors, a buffer tail of 3: each shard one tensor, the tail with the last
    assert aligned_bounds([5, 5, 5, 5], 23, 4) == [(0, 5), (5, 10), (10, 15), (15, 23)]
    # one large tensor first: the later edges still leave a tensor to every shard
    assert aligned_bounds([100, 1, 1], 102, 3) == [(0, 100), (100, 101), (101, 102)]
    with pytest.raises(ValueError, match=r"strategy.servers=3: .* 2 parameter tensors; choose strategy.servers <= 2"):
        aligned_bounds([4, 4], 8, 3)


def test_merged_state_concatenates_shards_and_unions_the_optimizer_state() -> None:
    a = {"center": torch.tensor([1.0, 2.0]), "updates": 5, "served": [3, 2, 0], "worker_steps": [3, 2],
         "optimizer": {"state": {0: {"step": 5}}, "param_groups": [{"params": [0, 1]}]},
         "momentum": torch.tensor([0.5, 0.5])}
    b = {"center": torch.tensor([3.0]), "updates": 4, "served": [2, 2, 0, 0], "worker_steps": [2, 2],
         "optimizer": {"state": {1: {"step": 4}}, "param_groups": [{"params": [0, 1]}]}, "momentum": None}
    m = merge_states([a, b], [2, 1])
    assert torch.equal(m["center"], torch.tensor([1.0, 2.0, 3.0]))
    assert m["updates"] == 5 and m["served"] == [3, 2, 0, 0] and m["worker_steps"] == [3, 2]
    assert m["optimizer"]["state"] == {0: {"step": 5}, 1: {"step": 4}}
    assert torch.equal(m["momentum"], torch.tensor([0.5, 0.5, 0.0]))  # zeros where a shard has none
    assert m["shards"] == [a, b]
