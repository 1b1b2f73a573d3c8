"""Real gloo processes: the meter tells exposed from hidden communication.

A collective whose partner arrives late is waited for: blocking, all of it is exposed;
launched non-blocking and waited for after a known compute interval (a sleep longer
than the partner's delay), it is counted as hidden. The DDP dense hook's first bucket,
launched before a known interval of backward computation, is hidden the same way.
Only inequalities with wide margins against the known sleep; no speed assertions.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import launch_ranks

SCRIPT = Path(__file__).parent / "scripts" / "exposed_time_run.py"
SLEEP_S = 1.6  # rank 1 is SLEEP_S / 2 late; rank 0 computes SLEEP_S before waiting


def test_exposed_vs_hidden_two_ranks(tmp_path: Path) -> None:
    launch_ranks(SCRIPT, 2, [str(tmp_path), str(SLEEP_S)], timeout=180)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        for kind, tot in rank["by_kind"].items():
            assert 0.0 <= tot["exposed_s"] <= tot["time_s"] + 0.05, (kind, tot)
        assert rank["by_kind"]["blocking"]["exposed_s"] == rank["by_kind"]["blocking"]["time_s"]
        assert rank["grads_agree"]  # the hook still averages the gradients
    r0 = ranks[0]["by_kind"]
    # blocking: rank 0 waited for the late partner inside the call
    assert r0["blocking"]["time_s"] > 0.25 * SLEEP_S
    # non-blocking: the same wait took place behind the sleep, so it is hidden
    assert r0["hidden"]["time_s"] > 0.25 * SLEEP_S
    assert r0["hidden"]["exposed_s"] < 0.25 * SLEEP_S
    assert r0["hidden"]["exposed_s"] < 0.5 * r0["hidden"]["time_s"]
    # DDP: rank 0's first bucket waited ~SLEEP_S for rank 1, behind rank 0's own backward
    hidden, exposed = ranks[0]["ddp"]["ddp_hidden"], ranks[0]["ddp"]["ddp_exposed"]
    assert hidden["calls"] == exposed["calls"] == 2  # two buckets per iteration
    assert hidden["time_s"] > 0.5 * SLEEP_S
    assert hidden["exposed_s"] < 0.25 * SLEEP_S
    # ... and without its own compute after the first bucket, it waited at the end of backward
    assert exposed["time_s"] > 0.5 * SLEEP_S
    assert exposed["exposed_s"] > 0.5 * SLEEP_S
    assert exposed["exposed_s"] <= exposed["time_s"] + 0.05
