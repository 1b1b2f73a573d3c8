"""compression=csc (GradientFlow's coarse-grained sparse communication) against references
written out here: chunk L1 scores, the agreed top chunks, dense chunks, conserved residual."""

from __future__ import annotations

import math

import pytest
import torch

from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks.compressors.csc import chunk_scores, select_chunks
from easgd_lightning.hooks.memory import make_memory
from tests.helpers import SoloCollective


def test_chunk_scores_are_l1_norms_with_a_short_last_chunk() -> None:
    x = torch.randn(1000, dtype=torch.float64)
    ref = [float(x[a : a + 128].abs().sum()) for a in range(0, 1000, 128)]
    got = chunk_scores(x, 128)
    assert got.numel() == 8 and torch.allclose(got, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-12)


def test_selection_is_the_k_largest_and_ties_go_to_the_lower_index() -> None:
    scores = torch.tensor([1.0, 5.0, 3.0, 5.0, 0.5, 3.0])
    assert select_chunks(scores, 3).tolist() == [1, 2, 3]
    assert select_chunks(scores, 1).tolist() == [1]


def test_one_rank_sends_its_top_chunks_densely_and_the_residual_keeps_the_rest() -> None:
    comp = build_compressor("csc", ratio=0.25, chunk_size=100, min_numel=0)
    memory = make_memory(comp)
    state: dict = {}
    sent_total = torch.zeros(1050, dtype=torch.float64)
    inputs_total = torch.zeros(1050, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        g = torch.randn(1050, generator=gen, dtype=torch.float64)
        inputs_total += g
        comp_in = memory.compensate("w", g)
        expected_chunks = sorted(sorted(range(11), key=lambda j: -float(comp_in[j * 100:(j + 1) * 100].abs().sum()))[:3])
        mean, local = comp.aggregate(comp_in, state, SoloCollective())
        ref = torch.zeros(1050, dtype=torch.float64)
        for j in expected_chunks:
            ref[j * 100:(j + 1) * 100] = comp_in[j * 100:(j + 1) * 100]
        assert torch.equal(local, ref) and torch.equal(mean, ref)
        assert state["chosen"].tolist() == expected_chunks
        assert state["last_payload_bytes"] == (11 + 300) * 8  # 11 scores + 3 dense chunks
        memory.update("w", comp_in, local)
        sent_total += local
    # error feedback conserves the mass: everything fed in was sent or is still owed
    assert torch.allclose(sent_total + memory.residual("w"), inputs_total, rtol=0, atol=1e-12)


def test_the_last_short_chunk_can_be_chosen() -> None:
    comp = build_compressor("csc", ratio=0.01, chunk_size=64, min_numel=0)
    x = torch.zeros(200)
    x[195] = 10.0  # in the last chunk (entries 192..199)
    mean, _ = comp.aggregate(x, {}, SoloCollective())
    assert torch.equal(mean, x)


@pytest.mark.parametrize(("params", "key"), [({"ratio": 0.0}, "compression.ratio"),
                                             ({"chunk_size": 0}, "compression.chunk_size")])
def test_bad_options_name_the_key(params: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_compressor("csc", **params)


def test_k_is_a_fraction_of_the_chunks() -> None:
    comp = build_compressor("csc", ratio=0.1, chunk_size=1000)
    assert comp._k(25_000_000) == math.ceil(0.1 * 25_000)
