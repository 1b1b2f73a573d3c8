"""Real gloo processes: the fused exchange's multi-round form (``rounds_segments``: sgc's
summaries then its aggregated tensors, adaptive's agreement then its payload) equals the
per-tensor exchange bitwise, step after step, and after the fused side resumes from the
per-tensor side's checkpoint (tests/distributed/scripts/fused_rounds_run.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import launch_ranks

SCRIPT = Path(__file__).parent / "scripts" / "fused_rounds_run.py"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("rounds")
    launch_ranks(SCRIPT, 2, [str(out), "sgc,adaptive"], timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _all_equal(rec: dict) -> None:
    for field in ("mean_equal", "local_equal", "residual_equal", "own_equal"):
        assert all(rec[field]), (field, rec[field])
    assert all(0.5 < s < 100 for s in rec["scale"])  # real numbers, not zeros


def test_sgc_fused_equals_per_tensor_bitwise(two_ranks):
    """Each tensor decides with its own state (tensor order: 1200, 1200, 700, 150 entries):
    the agreeing one skips up to max_skip = 2, the disagreeing one aggregates, the others
    change; every step is one summary all-reduce (plus the dense gather) and one more
    all-reduce unless every tensor skips (step 5)."""
    expect = ["sasa", "aaas", "sasa", "saaa", "aaaa", "ssss", "saaa"]  # per step: a aggregated, s skipped
    for rank in two_ranks:
        for name in ("sgc", "sgc_memory"):
            rec = rank["sgc"][name]
            _all_equal(rec)
            decided = ["".join("a" if st["last_aggregated"] else "s" for st in step) for step in rec["own"]]
            assert decided == expect, (name, decided)
            assert [step[0]["skipped"] for step in rec["own"]] == [1, 0, 1, 2, 0, 1, 2]  # max_skip 2
            assert all(st["step"] == t + 1 for t, step in enumerate(rec["own"]) for st in step)
            # (step 0: the variable-length gather learns its capacity, one call more)
            assert rec["calls"][1:] == [2 + ("a" in d) for d in expect][1:], rec["calls"]


def test_adaptive_fused_equals_per_tensor_bitwise(two_ranks):
    """One agreement per exchange (ratio 0.05 sparse, 1.0 dense on steps 2 and 5), the
    same means, residuals and transmitted buffers as each tensor's own exchange; three
    collectives per step (the dense gather, the vote, the payload)."""
    for rank in two_ranks:
        for name in ("adaptive", "adaptive_exact", "adaptive_nomem"):
            rec = rank["adaptive"][name]
            _all_equal(rec)
            ratios = [{st["ratio"] for st in step} for step in rec["own"]]
            assert ratios == [{1.0} if t in (2, 5) else {0.05} for t in range(7)], (name, ratios)
            assert rec["calls"][1:] == [3] * 6, rec["calls"]
