"""compression.two_way (Zhong et al. 2021): ranks in threads against the rule written out in
the test (float64, plain torch): each worker top-k's every shard of g + e and sends it to
the shard's owner, the owner top-k's its mean plus f, and the owners' shards are gathered.
Error feedback conserves mass in both directions; a checkpoint of the state resumes it."""

from __future__ import annotations

import math

import pytest
import torch

from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks.compressors.two_way import (
    TwoWayCompressor,
    pack_parts,
    shard_bounds,
    unpack_parts,
)
from easgd_lightning.hooks.memory import ResidualMemory
from easgd_lightning.utils.checkpoint import from_plain, to_plain
from tests.helpers import SoloCollective
from tests.unit.hooks.compressors.test_acpsgd import ThreadRanks


def topk(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """x with all but its ceil(ratio n) largest-magnitude entries zeroed."""
    out = torch.zeros_like(x)
    if x.numel():
        idx = x.abs().topk(max(1, math.ceil(ratio * x.numel() - 1e-9))).indices
        out[idx] = x[idx]
    return out


def reference(grads, up, down) -> dict:
    """The two-way rule, every rank in one loop: grads[i][t] -> per step the result, and
    at the end every worker's sent total and residual e, every owner's f. ``up(i, j, x)``
    is worker i's compression of shard j, ``down(j, x)`` owner j's."""
    world, n = len(grads), grads[0][0].numel()
    bounds = [shard_bounds(n, world, j) for j in range(world)]
    e = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    f = [torch.zeros(b - a, dtype=torch.float64) for a, b in bounds]
    sent = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    outs = []
    for t in range(len(grads[0])):
        ups = []
        for i in range(world):
            p = grads[i][t] + e[i]
            c = torch.cat([up(i, j, p[a:b]) for j, (a, b) in enumerate(bounds)])
            e[i] = p - c
            sent[i] += c
            ups.append(c)
        out = []
        for j, (a, b) in enumerate(bounds):
            m = torch.zeros(b - a, dtype=torch.float64)
            for c in ups:
                m += c[a:b]
            q = m / world + f[j]
            d = down(j, q)
            f[j] = q - d
            out.append(d)
        outs.append(torch.cat(out))
    return {"outs": outs, "e": e, "f": f, "sent": sent}


def topk_reference(grads, ratio: float) -> dict:
    """:func:`reference` with exact top-k at ``ratio`` both ways."""
    return reference(grads, lambda i, j, x: topk(x, ratio), lambda j, x: topk(x, ratio))


def grads_for(world: int, n: int, steps: int):
    gens = [torch.Generator().manual_seed(r) for r in range(world)]
    return [[torch.randn(n, dtype=torch.float64, generator=gens[r]) for _ in range(steps)] for r in range(world)]


def run_ranks(comp, grads, *, resume_at: int | None = None) -> tuple[list[dict], ThreadRanks]:
    """Every rank: residual memory, two-way aggregate, memory update per step; with
    ``resume_at`` the state and memory go through a checkpoint round trip before that step."""
    world, steps = len(grads), len(grads[0])
    ranks = ThreadRanks(world)
    head = 8 * len(comp.inner.compress(torch.ones(8, dtype=torch.float64), {}).tensors)  # a length per tensor

    def worker(r):
        memory, st, coll = ResidualMemory(), {"key_hash": 5}, ranks.collective(r)
        sent, outs, up, down = torch.zeros_like(grads[r][0]), [], [], []
        for t in range(steps):
            if t == resume_at:
                st = from_plain(to_plain(st), "cpu")
                memory = from_plain(to_plain(memory), "cpu")
                assert "_scratch" not in st and "f" in st
            before = ranks.sent_bytes[r]
            p = memory.compensate("w", grads[r][t])
            out, local = comp.aggregate(p, st, coll)
            memory.update("w", p, local)
            sent += local
            outs.append(out.clone())
            up.append(st["last_up_bytes"])
            down.append(st["last_down_bytes"])
            assert ranks.sent_bytes[r] - before == up[-1] + head * (world - 1) + down[-1]
        return {"sent": sent, "e": memory.residual("w"), "outs": outs, "f": st["f"], "up": up, "down": down}

    return ranks.run(worker), ranks


@pytest.mark.parametrize("world,n", [(2, 301), (3, 301), (4, 1000)])
def test_topk_matches_the_reference_rule_on_every_rank(world, n):
    grads = grads_for(world, n, 6)
    ref = topk_reference(grads, 0.05)
    res, _ = run_ranks(build_compressor("topk", two_way=True, ratio=0.05, exact=True, min_numel=0), grads)
    for r in range(world):
        for t, out in enumerate(res[r]["outs"]):
            torch.testing.assert_close(out, ref["outs"][t], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res[r]["e"], ref["e"][r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res[r]["f"], ref["f"][r], rtol=1e-12, atol=1e-12)
        # bytes: the pieces for the other owners (12 bytes per entry: float64 value, int32 index)
        k = [math.ceil(0.05 * (b - a) - 1e-9) for a, b in (shard_bounds(n, world, j) for j in range(world))]
        assert res[r]["up"] == [12 * (sum(k) - k[r])] * 6 and res[r]["down"] == [12 * k[r]] * 6


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.05, "exact": True}), ("signsgd", {})])
def test_mass_is_conserved_in_both_directions(name, params, world):
    n, steps = 301, 8
    comp = build_compressor(name, two_way=True, min_numel=0, **params)
    assert isinstance(comp, TwoWayCompressor) and comp.name == name
    grads = grads_for(world, n, steps)
    res, _ = run_ranks(comp, grads)
    # direction 1 (worker -> owners): sum_t concat_j c_i^j + e_i = sum_t g_i on every worker
    for r in range(world):
        torch.testing.assert_close(res[r]["sent"] + res[r]["e"], sum(grads[r]), rtol=1e-12, atol=1e-12)
    # every rank gets the same result
    for t in range(steps):
        for r in range(1, world):
            torch.testing.assert_close(res[0]["outs"][t], res[r]["outs"][t], rtol=0, atol=0)
    # direction 2 (owners -> workers): sum_t d_j + f_j = sum_t m_j, m = mean of the c_i
    total_c = sum(res[r]["sent"] for r in range(world)) / world
    total_out = sum(res[0]["outs"])
    for r in range(world):
        a, b = shard_bounds(n, world, r)
        torch.testing.assert_close(total_out[a:b] + res[r]["f"], total_c[a:b], rtol=1e-12, atol=1e-12)
    # and the second compression really compressed (the result is sparse / sign-valued)
    last = res[0]["outs"][-1]
    if name == "topk":
        k = sum(math.ceil(0.05 * (b - a)) for a, b in (shard_bounds(n, world, j) for j in range(world)))
        assert int((last != 0).sum()) <= k
    else:  # one magnitude per shard
        for j in range(world):
            a, b = shard_bounds(n, world, j)
            assert last[a:b].abs().unique().numel() == 1


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


def test_pack_parts_round_trips_mixed_dtypes():
    """A scale (float64) and a bit field of odd length: the second part's bytes start
    unaligned for a wider dtype, and the lengths come from the message itself."""
    parts = [torch.tensor([1.5], dtype=torch.float64), torch.arange(5, dtype=torch.uint8),
             torch.tensor([-2.0, 3.0], dtype=torch.float32)]
    msg = pack_parts(parts)
    assert msg.dtype == torch.uint8 and msg.numel() == 3 * 8 + 8 + 5 + 8
    got = unpack_parts(msg, [p.dtype for p in parts])
    assert all(torch.equal(g, p) for g, p in zip(got, parts))


def test_second_residual_resumes_from_the_checkpointed_f():
    """The memory of f is scratch: a state restored without it (as from a checkpoint)
    continues bit for bit."""
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


@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.05}), ("redsync", {"ratio": 0.05})])
def test_three_ranks_resume_bit_for_bit(name, params):
    """Three ranks, per-shard up states (redsync keeps its threshold there), f and e all go
    through a checkpoint round trip mid-run: the results are those of the run without it."""
    comp = build_compressor(name, two_way=True, min_numel=0, **params)
    grads = grads_for(3, 1001, 6)
    plain, _ = run_ranks(comp, grads)
    resumed, _ = run_ranks(build_compressor(name, two_way=True, min_numel=0, **params), grads, resume_at=3)
    for r in range(3):
        for a, b in zip(plain[r]["outs"], resumed[r]["outs"]):
            assert torch.equal(a, b)


def test_measured_collective_counts_the_pieces_that_move():
    """An all-to-all moves the pieces for the other ranks out and theirs in; a rank's own
    piece stays (a world of one moves nothing)."""
    from easgd_lightning.hooks.compressors.base import MeasuredCollective

    ranks = ThreadRanks(3)

    def worker(r):
        coll = MeasuredCollective(ranks.collective(r))
        sends = [torch.zeros(10 * r + j + 1, dtype=torch.uint8) for j in range(3)]
        got = coll.all_to_all(sends)
        assert [g.numel() for g in got] == [10 * i + r + 1 for i in range(3)]
        return coll.traffic.nbytes

    sent = [sum(10 * r + j + 1 for j in range(3) if j != r) for r in range(3)]
    recv = [sum(10 * i + r + 1 for i in range(3) if i != r) for r in range(3)]
    assert ranks.run(worker) == [s + g for s, g in zip(sent, recv)]
    solo = MeasuredCollective(SoloCollective())
    assert solo.all_to_all([torch.ones(4)])[0].tolist() == [1.0] * 4 and solo.traffic.nbytes == 0
