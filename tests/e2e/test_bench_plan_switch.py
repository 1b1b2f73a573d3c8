"""End-to-end, quick: ``bench/cluster.py`` with the SeCoPa planner's rows and with
``--aggregator switch`` (NetReduce emulated) on two emulated hosts at 100 Mbit/s.

Runs the real harness (network namespaces, ``tc``-shaped links, one ``easgd-train`` per
host over gloo; the switch's aggregator in the bridge namespace) for a few steps and
checks that every row ran, the planner logged its plan, the switch row sent each bucket
once, and the ratios and the no-communication floor (the limit row) are printed. Needs
root (or CAP_NET_ADMIN + CAP_SYS_ADMIN); skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_bench_cluster import netns_ok, run_cluster_bench  # noqa: F401 (fixture)


def _bench(tmp_path: Path, *args: str) -> dict:
    """bench/cluster.py quick, 2 hosts, 100 Mbit/s, 12 steps (bounded by the shared runner)."""
    table = run_cluster_bench(
        tmp_path, "quick", ["--workers", "2", "--rate-mbit", "100", "--steps", "12", "--warmup-steps", "0", *args]
    )
    md = (tmp_path / "quick" / "cluster.md").read_text()
    assert "limit" in md and "efficiency" in md  # the no-communication floor is printed
    return table


def _row(table: dict, strategy: str, compression: str, *overrides: str) -> dict:
    return next(
        r for r in table["rows"]
        if (r["strategy"], r["compression"]) == (strategy, compression) and set(overrides) <= set(r["overrides"])
    )


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.usefixtures("netns_ok")
def test_planner_against_compress_everything_and_nothing(tmp_path: Path) -> None:
    table = _bench(
        tmp_path, "--configs",
        "ddp/none,ddp/topk;compression.min_numel=0,ddp/topk;compression.plan=secopa;compression.min_numel=0",
    )
    assert all(r["status"] == "ok" for r in table["rows"]), [r["status"] for r in table["rows"]]
    planned = _row(table, "ddp", "topk", "compression.plan=secopa")
    plan = json.loads((Path(planned["run_dir"]) / "plan.json").read_text())
    assert plan["planner"] == "secopa" and plan["tensors"] == len(plan["decisions"]) == 4
    assert plan["costs"]["world"] == 2
    for row in table["rows"]:
        assert row["ratio"]["step_time_s"] > 0 and row["efficiency"] > 0


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.usefixtures("netns_ok")
def test_switch_aggregator_against_ring(tmp_path: Path) -> None:
    table = _bench(tmp_path, "--configs", "ddp/none", "--aggregator", "switch")
    keys = [(r["strategy"], r["compression"], tuple(r["overrides"])) for r in table["rows"]]
    assert keys == [("ddp", "none", ()), ("limit", "none", ()), ("ddp", "none", ("comm.allreduce=switch",))]
    assert all(r["status"] == "ok" for r in table["rows"]), [r["status"] for r in table["rows"]]
    switch = _row(table, "ddp", "none", "comm.allreduce=switch")
    log = (Path(switch["run_dir"]) / "logs" / "switch.log").read_text()
    assert "served" in log  # the aggregator at the switch summed the buckets
    summary = json.loads((Path(switch["run_dir"]) / "summary.json").read_text())
    assert summary["extras"][0]["compression_stats"]["allreduce"] == "switch"
    ring = table["rows"][0]
    # one pass each way: the switch row sends each bucket once (+ a header); the ring
    # all-reduce of 2 ranks sends it once too, so the bytes agree within the headers
    assert switch["bytes_per_step_per_worker"] == pytest.approx(ring["bytes_per_step_per_worker"], rel=0.01)
