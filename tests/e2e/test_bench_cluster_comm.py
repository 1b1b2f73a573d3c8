"""End-to-end: ``bench/cluster.py`` with 2 hosts x 2 processes (``--procs-per-host``):
the hierarchy and fusion scenarios, short.

Each runs the real harness (network namespaces, a shaped bridge, four ``easgd-train``
ranks over gloo, two per host) for a few steps and checks what the table says about the
messages: one all-reduce per exchange flat, reduce + all-reduce + broadcast on the
leaders and reduce + broadcast elsewhere hierarchically (2.5 per step on average); one
message per tensor unfused, one per exchange with the 25 MiB lazy all-reduce. No timing
is asserted. Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and network namespaces;
skipped, with the reason printed, elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_bench_cluster import _netns_names, netns_ok, run_cluster_bench  # noqa: F401


def _run(tmp_path: Path, scenario: str, configs: str) -> dict:
    # --only-configs: just the two rows compared (each row of 4 ranks costs ~12 s of
    # process start-up here); the ddp/none baseline and the limit row are asserted on by
    # test_bench_cluster's quick test, not here.
    table = run_cluster_bench(
        tmp_path, scenario, ["--configs", configs, "--only-configs", "--steps", "8", "--warmup-steps", "0"]
    )
    run_id = table["scenario"]["run_id"]
    assert not {n for n in _netns_names() if n.startswith(run_id + "-")}, "namespaces left behind"
    assert table["scenario"]["workers"] == 2 and table["scenario"]["procs_per_host"] == 2
    assert len(table["rows"]) == 2, [r["strategy"] for r in table["rows"]]
    return table


def _rows(table: dict) -> dict:
    return {(r["strategy"], *r["overrides"]): r for r in table["rows"]}


def _summary(row: dict) -> dict:
    return json.loads((Path(row["run_dir"]) / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.netns
def test_hierarchy_scenario_two_hosts_two_processes(netns_ok: None, tmp_path: Path) -> None:  # noqa: F811
    table = _run(tmp_path, "hierarchy", "sync_easgd/none,sync_easgd/none;comm.hierarchy=node")
    rows = _rows(table)
    flat, node = rows[("sync_easgd",)], rows[("sync_easgd", "comm.hierarchy=node")]
    for row in (flat, node):
        assert row["status"] == "ok"
    assert flat["messages_per_step"] == pytest.approx(1.0)  # the wide MLP is one buffer
    assert node["messages_per_step"] == pytest.approx(2.5)  # (3 + 2 + 3 + 2) / 4
    s_flat, s_node = _summary(flat), _summary(node)
    assert s_flat["world_size"] == s_node["world_size"] == 4
    assert s_node["extras"][0]["comm"]["nodes"] == [[0, 1], [2, 3]]  # LOCAL_WORLD_SIZE=2 per host
    # the same training up to the order of float32 additions in the sum
    assert s_node["train_loss"] == pytest.approx(s_flat["train_loss"], rel=1e-3)
    target = next(t for t in table["scenario"]["targets"] if t["row"] == "sync_easgd/none;comm.hierarchy=node")
    assert target["measured"] == pytest.approx(flat["step_time_s"] / node["step_time_s"])


@pytest.mark.slow
@pytest.mark.netns
def test_fusion_scenario_many_small_tensors(netns_ok: None, tmp_path: Path) -> None:  # noqa: F811
    table = _run(tmp_path, "fusion", "sync_easgd/none;comm.fusion_mb=0,sync_easgd/none")
    rows = _rows(table)
    unfused, fused = rows[("sync_easgd", "comm.fusion_mb=0")], rows[("sync_easgd",)]
    for row in (unfused, fused):
        assert row["status"] == "ok"
    tensors = 2 * (48 + 1)  # weight and bias of 49 linear layers
    assert unfused["messages_per_step"] == pytest.approx(tensors)
    assert fused["messages_per_step"] == pytest.approx(1.0)
    assert unfused["bytes_per_step_per_worker"] == pytest.approx(fused["bytes_per_step_per_worker"])
    assert _summary(fused)["train_loss"] == pytest.approx(_summary(unfused)["train_loss"], rel=1e-3)
