"""Real gloo processes: compression.two_way's reduce-scatter of compressed shards (an
all-to-all) and all-gather of the owners' shards give every rank the same result, that of
the single-process reference of tests/unit/hooks/compressors/test_two_way.py, and the meter counts what the
all-to-all really moved: the pieces for the other owners (their lengths as headers), then
this rank's shard payload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from easgd_lightning.hooks import build_compressor
from tests.helpers import launch_ranks
from tests.unit.hooks.compressors.test_two_way import grads_for, reference, topk_reference

SCRIPT = Path(__file__).parent / "scripts" / "two_way_run.py"
N, STEPS = 1001, 5  # 1001 = 3 * 333 + 2: uneven shards on 2, 3 and 4 ranks


def inner_reference(grads, name: str, **params) -> dict:
    """:func:`reference` with the inner compressor's own codec as C, one state per
    (worker, shard) up and per owner down, as the ranks keep them."""
    comp = build_compressor(name, min_numel=0, **params)
    world = len(grads)
    up_states = [[{} for _ in range(world)] for _ in range(world)]
    down_states = [{} for _ in range(world)]

    def codec(x, st):
        return comp.decompress(comp.compress(x.clone(), st), x.shape)

    return reference(grads, lambda i, j, x: codec(x, up_states[i][j]), lambda j, x: codec(x, down_states[j]))


@pytest.fixture(scope="module", params=[3, 2])
def ranks(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"two_way_{world}")
    launch_ranks(SCRIPT, world, [str(out), str(N), str(STEPS), "topk,redsync,signsgd,exchange"], timeout=300)
    return world, [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("case", ["topk", "redsync", "signsgd"])
def test_every_rank_gets_the_reference_result(ranks, case):
    world, res = ranks
    grads = grads_for(world, N, STEPS)
    ref = (topk_reference(grads, 0.05) if case == "topk"
           else inner_reference(grads, case, **({"ratio": 0.05} if case == "redsync" else {})))
    for r in range(world):
        for t, row in enumerate(res[r][case]["rows"]):
            assert torch.equal(row["out"], res[0][case]["rows"][t]["out"])
            torch.testing.assert_close(row["out"], ref["outs"][t], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res[r][case]["e"], ref["e"][r], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res[r][case]["f"], ref["f"][r], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["topk", "redsync", "signsgd"])
def test_the_meter_counts_the_bytes_the_all_to_all_moved(ranks, case):
    world, res = ranks
    parts = 2 if case == "signsgd" else 1  # payload tensors: signsgd's scale and bits
    for t in range(STEPS):
        rows = [res[r][case]["rows"][t] for r in range(world)]
        # what one rank sent the others is what they got from it
        assert sum(row["a2a_sent"] for row in rows) == sum(row["a2a_recv"] for row in rows)
        for r, row in enumerate(rows):
            # the pieces for the other owners, each with an 8-byte length per payload tensor
            assert row["a2a_sent"] == row["up"] + 8 * parts * (world - 1)
            # plus this rank's shard, all-gathered with its header; dense charged once
            assert row["sent"] == row["a2a_sent"] + 8 * parts + row["down"], (r, row)
            others = sum(8 * parts + rows[i]["down"] for i in range(world) if i != r)
            assert row["recv"] == row["a2a_recv"] + others, (r, row)
            assert row["dense"] == N * 8


def test_the_attach_points_exchange_gives_the_reference_result(ranks):
    """Through exchange_tensors (residual memory, batched all-gathers), two tensors."""
    world, res = ranks
    for size, i in ((N, 0), (37, 1)):
        ref = topk_reference(grads_for(world, size, STEPS), 0.05)
        for r in range(world):
            for t, outs in enumerate(res[r]["exchange"]["outs"]):
                torch.testing.assert_close(outs[i], ref["outs"][t], rtol=1e-12, atol=1e-12)
