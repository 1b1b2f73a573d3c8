"""End-to-end, quick: ``bench/cluster.py`` with the SeCoPa planner's rows and with
``--aggregator switch`` (NetReduce emulated) on two emulated hosts at 100 Mbit/s.

Runs the real harness (network namespaces, ``tc``-shaped links, one ``easgd-train`` per
host over gloo; the switch's aggregator in the bridge namespace) for a few steps and
checks that every row ran, the planner logged its plan, GradientFlow's chunk-sparse rows
(csc) travel as two fused messages per step, the switch row sent each bucket
once, and the ratios and the no-communication floor (the limit row) are printed. One run
(the planner's rows with ``--aggregator switch``) serves both tests. Needs
root (or CAP_NET_ADMIN + CAP_SYS_ADMIN); skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_bench_cluster import netns_ok, run_cluster_bench  # noqa: F401 (fixture)

CSC_ROW = "ddp/csc;compression.chunk_size=1024;compression.min_numel=0"
PLAN_CONFIGS = ("ddp/none,ddp/topk;compression.min_numel=0,ddp/topk;compression.plan=secopa;compression.min_numel=0,"
                + CSC_ROW)


@pytest.fixture(scope="module")
def plan_switch_table(netns_ok: None, tmp_path_factory: pytest.TempPathFactory) -> dict:  # noqa: F811
    """One bench/cluster.py quick run for both tests (each row costs process start-up; the
    two tests read different rows): 2 hosts, 100 Mbit/s, 12 steps, the planner's rows and
    ``--aggregator switch`` (which adds the switch row after ddp/none)."""
    tmp_path = tmp_path_factory.mktemp("plan_switch")
    table = run_cluster_bench(
        tmp_path, "quick",
        ["--workers", "2", "--rate-mbit", "100", "--steps", "12", "--warmup-steps", "0",
         "--configs", PLAN_CONFIGS, "--aggregator", "switch"],
    )
    md = (tmp_path / "quick" / "cluster.md").read_text()
    assert "limit" in md and "efficiency" in md  # the no-communication floor is printed
    keys = [(r["strategy"], r["compression"], tuple(r["overrides"])) for r in table["rows"]]
    assert keys == [
        ("ddp", "none", ()), ("limit", "none", ()), ("ddp", "none", ("comm.allreduce=switch",)),
        ("ddp", "topk", ("compression.min_numel=0",)),
        ("ddp", "topk", ("compression.plan=secopa", "compression.min_numel=0")),
        ("ddp", "csc", ("compression.chunk_size=1024", "compression.min_numel=0")),
    ]
    return table


def _row(table: dict, strategy: str, compression: str, *overrides: str) -> dict:
    return next(
        r for r in table["rows"]
        if (r["strategy"], r["compression"]) == (strategy, compression) and set(overrides) <= set(r["overrides"])
    )


@pytest.mark.slow
@pytest.mark.netns
def test_planner_against_compress_everything_and_nothing(plan_switch_table: dict) -> None:
    table = plan_switch_table
    assert all(r["status"] == "ok" for r in table["rows"]), [r["status"] for r in table["rows"]]
    planned = _row(table, "ddp", "topk", "compression.plan=secopa")
    plan = json.loads((Path(planned["run_dir"]) / "plan.json").read_text())
    assert plan["planner"] == "secopa" and plan["tensors"] == len(plan["decisions"]) == 4
    assert plan["costs"]["world"] == 2
    for row in table["rows"]:
        assert row["ratio"]["step_time_s"] > 0 and row["efficiency"] > 0


@pytest.mark.slow
@pytest.mark.netns
def test_switch_aggregator_against_ring(plan_switch_table: dict) -> None:
    table = plan_switch_table
    keys = [(r["strategy"], r["compression"], tuple(r["overrides"])) for r in table["rows"]]
    # the switch row added after ddp/none and the limit row (the planner's rows follow)
    assert keys[:3] == [("ddp", "none", ()), ("limit", "none", ()), ("ddp", "none", ("comm.allreduce=switch",))]
    assert all(r["status"] == "ok" for r in table["rows"]), [r["status"] for r in table["rows"]]
    switch = _row(table, "ddp", "none", "comm.allreduce=switch")
    log = (Path(switch["run_dir"]) / "logs" / "switch.log").read_text()
    assert "served" in log  # the aggregator at the switch summed the buckets
    summary = json.loads((Path(switch["run_dir"]) / "summary.json").read_text())
    assert summary["extras"][0]["compression_stats"]["allreduce"] == "switch"
    # only the switch row ran on the switch's aggregator
    assert not any((Path(r["run_dir"]) / "logs" / "switch.log").exists() for r in table["rows"] if r is not switch)
    ring = table["rows"][0]
    # one pass each way: the switch row sends each bucket once (+ a header); the ring
    # all-reduce of 2 ranks sends it once too, so the bytes agree within the headers
    assert switch["bytes_per_step_per_worker"] == pytest.approx(ring["bytes_per_step_per_worker"], rel=0.01)


@pytest.mark.slow
@pytest.mark.netns
def test_csc_chunks_travel_in_two_fused_messages(plan_switch_table: dict) -> None:
    """GradientFlow's coarse-grained sparse communication under DDP: after the hook's one
    dense iteration (one bucket: 1 message), each step sends the bucket's chunk scores and
    then its chosen chunks, each round fused over the bucket's tensors: 2 messages, so
    (1 + 2 * 11) / 12 over the 12 steps; fewer bytes than the dense row."""
    csc = _row(plan_switch_table, "ddp", "csc", "compression.chunk_size=1024")
    dense = _row(plan_switch_table, "ddp", "none")
    assert csc["status"] == "ok"
    assert csc["messages_per_step"] == pytest.approx((1 + 2 * 11) / 12)
    assert dense["messages_per_step"] == pytest.approx(1.0)
    assert 0 < csc["bytes_per_step_per_worker"] < 0.5 * dense["bytes_per_step_per_worker"]
