"""Real gloo processes: GradientFlow's lazy all-reduce and hierarchical reduction.

Fused sums equal unfused ones bit for bit (float64), and each exchange sends as many
messages as an independent model of the lazy all-reduce rule predicts (written out here,
not imported). Hierarchical reduction (4 ranks as 2 nodes x 2) gives the flat sum: bit
for bit on dyadic data (every order of additions is exact there), within float64
rounding in training (a different order of additions); it takes 3 messages per buffer on
a node leader, 2 elsewhere.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers import launch_ranks

SCRIPT = Path(__file__).parent / "scripts" / "fusion_run.py"


def predicted_buffers(sizes_bytes: list[int], threshold: int) -> int:
    """Lazy all-reduce, modelled independently: add tensors to a buffer, send it once it
    holds >= threshold bytes, send what is left at the end."""
    count, filled, pending = 0, 0, False
    for n in sizes_bytes:
        filled += n
        pending = True
        if filled >= threshold:
            count, filled, pending = count + 1, 0, False
    return count + pending


def test_fusion_and_hierarchy_collectives(tmp_path: Path) -> None:
    threshold = 2000
    launch_ranks(SCRIPT, 4, [str(tmp_path), "collectives", str(threshold)], timeout=400)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    sizes = ranks[0]["sizes"]
    from tests.distributed.scripts.fusion_run import dyadic

    reference = sum(dyadic(r, sum(sizes)) for r in range(4))  # exact: dyadic values
    assert ranks[0]["nodes"] == [[0, 1], [2, 3]]
    for r, res in enumerate(ranks):
        for name in ("unfused", "fused", "one", "node"):
            assert torch.equal(res[name]["sum"], reference), (r, name)
            assert res[name]["async_equal"], (r, name)
        assert res["unfused"]["messages"] == len(sizes)
        assert res["fused"]["messages"] == predicted_buffers([8 * n for n in sizes], threshold) == 3
        assert res["one"]["messages"] == 1
        per_buffer = 3 if res["is_leader"] else 2  # reduce, (leaders: all-reduce,) broadcast
        assert res["node"]["messages"] == per_buffer * res["fused"]["messages"]
        # compressed (randomk, all-reduce payloads): bitwise the same sums; messages of the
        # second exchange = the small tensors' one all-gather + the fused payload buffers
        unf, fus = res["compressed_unfused"], res["compressed_fused"]
        assert all(torch.equal(a, b) for a, b in zip(unf["sums"], fus["sums"]))
        big = [n for n in sizes if n >= 32]
        payloads = [8 * math.ceil(0.5 * n) for n in big]
        assert unf["messages_second"] == 1 + len(big)
        assert fus["messages_second"] == 1 + predicted_buffers(payloads, threshold) == 3
        # the fused exchange (issue 29): one codec call, the all-gather and one all-reduce
        one = res["compressed_one_call"]
        assert all(torch.equal(a, b) for a, b in zip(unf["sums"], one["sums"]))
        assert one["messages_second"] == 2


@pytest.mark.parametrize("world", [2, 4])
def test_fusion_and_hierarchy_training(tmp_path: Path, world: int) -> None:
    threshold = 700
    launch_ranks(SCRIPT, world, [str(tmp_path), "train", str(threshold)], timeout=600)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for r, res in enumerate(ranks):  # ddp: DDP's buckets; the hierarchy sums the same gradients
        flat = res[("ddp", "fused")]
        assert torch.equal(flat["final"], ranks[0][("ddp", "fused")]["final"])
        assert flat["messages"] >= flat["exchanges"]  # at least one bucket per step
        if world == 4:
            node = res[("ddp", "node")]
            torch.testing.assert_close(node["final"], flat["final"], rtol=1e-12, atol=1e-13)
            assert node["messages"] == flat["messages"] * (3 if r in (0, 2) else 2)
    for strat in ("sync_easgd", "local_sgd", "local_sgd_cocod"):
        for r, res in enumerate(ranks):
            unf, fus = res[(strat, "unfused")], res[(strat, "fused")]
            assert torch.equal(unf["final"], ranks[0][(strat, "unfused")]["final"])  # every rank the center
            if world == 2:  # a sum of two is the same in any order: fused == unfused bitwise
                assert torch.equal(fus["final"], unf["final"]), (strat, r)
            else:
                torch.testing.assert_close(fus["final"], unf["final"], rtol=1e-12, atol=1e-13)
            sizes = unf["tensor_bytes"]
            assert len(sizes) == 12
            assert unf["messages"] == unf["exchanges"] * len(sizes)
            buffers = predicted_buffers(sizes, threshold)
            assert 1 < buffers < len(sizes)
            assert fus["messages"] == fus["exchanges"] * buffers
            if world == 4:
                node = res[(strat, "node")]
                torch.testing.assert_close(node["final"], unf["final"], rtol=1e-12, atol=1e-13)
                assert torch.equal(node["final"], ranks[0][(strat, "node")]["final"])
                per_buffer = 3 if r in (0, 2) else 2
                assert node["messages"] == node["exchanges"] * buffers * per_buffer
