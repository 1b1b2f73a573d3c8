"""compression.two_way (Zhong et al. 2021): error feedback conserves mass in both
directions, two ranks in threads, against the rule written out in the test."""

from __future__ import annotations

import pytest
import torch

from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks.compressors.two_way import TwoWayCompressor, shard_bounds
from easgd_lightning.hooks.memory import ResidualMemory
from tests.helpers import SoloCollective
from tests.unit.test_acpsgd import ThreadRanks


@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.05, "exact": True}), ("signsgd", {})])
def test_mass_is_conserved_in_both_directions(name, params):
    world, n, steps = 2, 301, 8
    comp = build_compressor(name, two_way=True, min_numel=0, **params)
    assert isinstance(comp, TwoWayCompressor) and comp.name == name
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    grads = [[torch.randn(n, dtype=torch.float64, generator=gens[r]) for _ in range(steps)] for r in range(world)]
    ranks = ThreadRanks(world)

    def worker(r):
        memory, st, coll = ResidualMemory(), {}, ranks.collective(r)
        sent_up = torch.zeros(n, dtype=torch.float64)
        outs = []
        for t in range(steps):
            p = memory.compensate("w", grads[r][t])
            out, local = comp.aggregate(p, st, coll)
            memory.update("w", p, local)
            sent_up += local
            outs.append(out.clone())
        return sent_up, memory.residual("w"), outs, st["f"]

    res = ranks.run(worker)
    # direction 1 (worker -> owners): sum_t c_i + e_i = sum_t g_i on every worker
    for r in range(world):
        sent_up, e, _, _ = res[r]
        torch.testing.assert_close(sent_up + e, sum(grads[r]), rtol=1e-12, atol=1e-12)
    # every rank gets the same result
    for t in range(steps):
        torch.testing.assert_close(res[0][2][t], res[1][2][t], rtol=0, atol=0)
    # direction 2 (owners -> workers): sum_t d_j + f_j = sum_t m_j, m = mean of the c_i
    total_c = (res[0][0] + res[1][0]) / world
    total_out = sum(res[0][2])
    for r in range(world):
        a, b = shard_bounds(n, world, r)
        torch.testing.assert_close(total_out[a:b] + res[r][3], total_c[a:b], rtol=1e-12, atol=1e-12)
    # and the second compression really compressed (the result is sparse / sign-valued)
    if name == "topk":
        assert int((res[0][2][-1] != 0).sum()) <= 2 * 8  # ceil(0.05 * 150) per shard


def test_two_way_refusals_and_config_key():
    with pytest.raises(ValueError, match=r"compression\.two_way needs compression\.name"):
        build_compressor("powersgd", two_way=True)
    with pytest.raises(ValueError, match=r"compression\.two_way must be true or false"):
        build_compressor("topk", two_way="yes")
    assert not isinstance(build_compressor("topk", two_way=False), TwoWayCompressor)
    # one rank: the same two-stage rule on the whole tensor
    comp = build_compressor("topk", two_way=True, ratio=0.5, exact=True)
    x = torch.tensor([4.0, -1.0, 3.0, 0.5])
    out, local = comp.aggregate(x, {}, SoloCollective())
    assert out.tolist() == [4.0, 0.0, 3.0, 0.0] and local.tolist() == [4.0, 0.0, 3.0, 0.0]


def test_second_residual_resumes_from_the_checkpointed_f():
    """The memory of f is scratch: a state restored without it (as from a checkpoint)
    continues bit for bit."""
    from easgd_lightning.utils.checkpoint import from_plain, to_plain

    comp = build_compressor("topk", two_way=True, ratio=0.1, exact=True, min_numel=0)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(97, dtype=torch.float64, generator=gen) for _ in range(6)]
    st, outs = {}, []
    for x in xs:
        outs.append(comp.aggregate(x, st, SoloCollective())[0].clone())
    st = {}
    for t, x in enumerate(xs):
        if t == 3:
            st = from_plain(to_plain(st), "cpu")
            assert "_scratch" not in st and "f" in st
        assert torch.equal(comp.aggregate(x, st, SoloCollective())[0], outs[t])
