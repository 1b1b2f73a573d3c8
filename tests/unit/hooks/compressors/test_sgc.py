"""sgc (IWQoS 2024): skip / aggregate decisions on constructed gradients, two ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks.compressors.sgc import sgc_decision
from tests.unit.hooks.compressors.test_acpsgd import ThreadRanks


def run_two_ranks(comp, grads_per_rank, steps):
    ranks = ThreadRanks(2)

    def worker(r):
        st, out = {}, []
        coll = ranks.collective(r)
        for t in range(steps):
            mean, _ = comp.aggregate(grads_per_rank(r, t), st, coll)
            out.append((st["last_aggregated"], st["last_similarity"], mean.clone()))
        return out

    return ranks.run(worker), ranks


def test_identical_gradients_skip_ever_longer_up_to_max_skip():
    comp = build_compressor("sgc", threshold=0.9, max_skip=4, sample_size=64)
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    results, ranks = run_two_ranks(comp, lambda r, t: g * (1 + 0.01 * t), 16)
    pattern = [agg for agg, _, _ in results[0]]
    # reference: skip 1, aggregate, skip 2, aggregate, skip 4, aggregate, skip 4, ...
    expect = [False, True, False, False, True] + [False] * 4 + [True] + [False] * 4 + [True] + [False]
    assert pattern == expect
    assert [agg for agg, _, _ in results[1]] == expect  # the same decision on every rank
    assert all(s == pytest.approx(1.0) for _, s, _ in results[0])
    # a skipped step returns the local value; never more than max_skip skips in a row
    runs = "".join("s" if not a else "a" for a in pattern).split("a")
    assert max(len(x) for x in runs) <= 4
    # bytes: (64 + 1) floats every step, the 1000 floats only on the 4 aggregations
    assert ranks.sent_bytes == [16 * 65 * 4 + 4 * 1000 * 4] * 2


def test_disagreeing_gradients_are_always_aggregated():
    comp = build_compressor("sgc", threshold=0.9, sample_size=50)
    gens = [torch.Generator().manual_seed(10 + r) for r in range(2)]
    grads = {(r, t): torch.randn(500, generator=gens[r]) for r in range(2) for t in range(6)}
    results, _ = run_two_ranks(comp, lambda r, t: grads[(r, t)], 6)
    for t, (agg, sim, mean) in enumerate(results[0]):
        assert agg
        torch.testing.assert_close(mean, (grads[(0, t)] + grads[(1, t)]) / 2)
        # reference similarity on the same strided sample (stride 10, offset t mod 10)
        x0, x1 = (grads[(r, t)][t % 10 :: 10][:50].double().numpy() for r in range(2))
        ref = np.sum((x0 + x1) ** 2) / (2 * (np.sum(x0**2) + np.sum(x1**2)))
        assert sim == pytest.approx(ref, rel=1e-5) and sim < 0.9


def test_agreement_lost_resets_the_frequency():
    assert sgc_decision(0.99, 0, 1, 0.9, 8) == (False, 1, 1)
    assert sgc_decision(0.99, 1, 1, 0.9, 8) == (True, 0, 2)
    assert sgc_decision(0.99, 3, 4, 0.9, 8) == (False, 4, 4)
    assert sgc_decision(0.99, 4, 4, 0.9, 8) == (True, 0, 8)
    assert sgc_decision(0.99, 0, 8, 0.9, 8) == (False, 1, 8)
    assert sgc_decision(0.5, 2, 8, 0.9, 8) == (True, 0, 1)
    assert sgc_decision(0.99, 0, 1, 0.9, 0) == (True, 0, 0)  # max_skip 0: never skip


def test_bad_params():
    with pytest.raises(ValueError, match=r"compression\.threshold"):
        build_compressor("sgc", threshold=1.5)
    with pytest.raises(ValueError, match=r"compression\.max_skip"):
        build_compressor("sgc", max_skip=-1)


@pytest.mark.parametrize("strategy", ["sync_easgd", "local_sgd"])
def test_elastic_strategies_refuse_it_in_one_line(strategy):
    """A skip keeps each rank's own value: the elastic centers would diverge, so the elastic
    strategies refuse sgc when they are built (before any process starts)."""
    from easgd_lightning.strategies.registry import strategy_spec

    with pytest.raises(ValueError) as err:
        strategy_spec(strategy).cls(compression=build_compressor("sgc"))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("compression=sgc applies to gradients only (strategy=ddp)")
    assert f"strategy={strategy} exchanges differences" in msg
    strategy_spec("ddp_compressed").cls(compression=build_compressor("sgc"))  # gradients: fine
