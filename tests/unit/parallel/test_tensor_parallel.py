"""Tensor-parallel layers in one process: shapes, sharding, and the unsplit special case.

The split (tp=2) equivalence runs in real processes: tests/distributed/test_pipeline_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from easgd_lightning.models.gpt import GPT, GPTBlock, GPTConfig, gpt_loss
from easgd_lightning.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelContext,
    VocabParallelEmbedding,
    shard_range,
)


def test_shard_range_splits_evenly_and_rejects_remainders():
    assert [shard_range(12, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="divisible by strategy.tp"):
        shard_range(10, 4, 0, "output features")


def test_context_validation():
    with pytest.raises(ValueError, match="strategy.tp"):
        TensorParallelContext(size=0)
    with pytest.raises(ValueError, match="outside"):
        TensorParallelContext(size=2, rank=2)
    with pytest.raises(RuntimeError, match="group is not set"):
        TensorParallelContext(size=2, rank=0).require_group()


def test_shards_are_slices_of_the_unsplit_weight():
    """Every rank draws the full weight from the same RNG state, then keeps its slice."""
    torch.manual_seed(3)
    full = ColumnParallelLinear(8, 6, TensorParallelContext())
    for rank in range(2):
        torch.manual_seed(3)
        col = ColumnParallelLinear(8, 6, TensorParallelContext(size=2, rank=rank))
        assert torch.equal(col.weight, full.weight[rank * 3 : (rank + 1) * 3])
    torch.manual_seed(5)
    full_row = RowParallelLinear(8, 6, TensorParallelContext())
    for rank in range(2):
        torch.manual_seed(5)
        row = RowParallelLinear(8, 6, TensorParallelContext(size=2, rank=rank))
        assert torch.equal(row.weight, full_row.weight[:, rank * 4 : (rank + 1) * 4])
    torch.manual_seed(9)
    emb = VocabParallelEmbedding(10, 4, TensorParallelContext())
    torch.manual_seed(9)
    half = VocabParallelEmbedding(10, 4, TensorParallelContext(size=2, rank=1))
    assert torch.equal(half.weight, emb.weight[5:])


def test_unsplit_layers_are_plain_linear_and_embedding():
    tp = TensorParallelContext()
    x = torch.randn(3, 5, 8)
    col = ColumnParallelLinear(8, 6, tp)
    assert torch.allclose(col(x), F.linear(x, col.weight, col.bias))
    row = RowParallelLinear(8, 6, tp)
    assert torch.allclose(row(x), F.linear(x, row.weight, row.bias))
    emb = VocabParallelEmbedding(10, 4, tp)
    tokens = torch.randint(0, 10, (2, 3))
    assert torch.equal(emb(tokens), emb.weight[tokens])
    h = torch.randn(2, 3, 4)
    assert torch.allclose(emb.logits(h), h @ emb.weight.t())


def test_block_rejects_heads_not_divisible_by_tp():
    cfg = GPTConfig(n_head=3, d_model=48)
    with pytest.raises(ValueError, match=r"model.n_head \(3\) must be divisible by strategy.tp \(2\)"):
        GPTBlock(cfg, TensorParallelContext(size=2, rank=0))


def test_gpt_is_causal_and_trains_one_step():
    cfg = GPTConfig(seq_len=12, n_layer=2, n_head=2, d_model=16)
    model = GPT(cfg, base_seed=0)
    tokens = torch.randint(0, 256, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, 256)
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 256
    # positions before the change do not see it
    assert torch.allclose(model(changed)[:, :8], logits[:, :8], atol=1e-6)
    loss = gpt_loss(logits, tokens)
    loss.backward()
    assert model.embed.weight.grad is not None and torch.isfinite(loss)


def test_gpt_config_errors_name_keys():
    with pytest.raises(ValueError, match="model.d_model"):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError, match="model.n_layer"):
        GPTConfig(n_layer=0)
    assert GPTConfig(vocab_size=257).padded_vocab(4) == 260
