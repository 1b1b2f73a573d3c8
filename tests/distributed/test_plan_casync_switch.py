"""Real gloo processes: the SeCoPa plan under DDP gives, decision by decision, dense
all-reduce bits for dense tensors and the codec's result for compressed (and partitioned)
ones; CaSync's pipelined partitions equal the partitions exchanged alone; the emulated
switch's sum equals all_reduce (float64) with the aggregator in rank 0 or in a process of
its own."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from easgd_lightning.utils.rank_env import free_port
from tests.helpers import PY, base_env, launch_ranks, start_ranks

SCRIPT = Path(__file__).parent / "scripts" / "plan_run.py"


def _run(tmp_path: Path, world: int, scenarios: str) -> list[dict]:
    launch_ranks(SCRIPT, world, [str(tmp_path), scenarios], timeout=300)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    return out, _run(out, 2, "plan_fixed,casync,fused_rounds")


def test_fixed_plan_is_followed_decision_by_decision(two_ranks):
    _, ranks = two_ranks
    for r in ranks:
        res = r["plan_fixed"]
        assert res["worst"] == {"dense": 0.0, "compressed": 0.0}
        assert res["decisions"]["fc2.weight"] == [True, 4] and res["decisions"]["fc3.weight"] == [False, 1]
        assert res["stats"]["plan"]["partitioned"] == 1


def test_measured_plan_is_the_same_on_every_rank_and_followed(tmp_path):
    ranks = _run(tmp_path, 2, "plan_measured")
    a, b = (r["plan_measured"] for r in ranks)
    assert a["decisions"] == b["decisions"]
    assert a["worst"] == {"dense": 0.0, "compressed": 0.0} and b["worst"] == a["worst"]
    logged = json.loads((tmp_path / "plan.json").read_text())
    assert {d["key"]: [d["compress"], d["partitions"]] for d in logged["decisions"]} == a["decisions"]
    assert logged["costs"]["world"] == 2 and len(logged["probes"]["sizes"]) >= 2
    # the biases (< min_numel = 1000 elements) travel dense whatever the measurements say
    assert not a["decisions"]["fc1.bias"][0] and not a["decisions"]["fc3.bias"][0]
    assert a["stats"]["plan"]["tensors"] == 6


def test_replan_steps_measures_and_plans_again(tmp_path):
    """compression.replan_steps=2 (hook warm-up 1, 6 iterations): the first plan at
    iteration 1, replans at 3 and 5 (2 replans), plan.json rewritten each time (its
    iteration and replans fields), every plan the same on both ranks and followed."""
    ranks = _run(tmp_path, 2, "plan_replan")
    a, b = (r["plan_replan"] for r in ranks)
    for res in (a, b):
        assert res["worst"] == {"dense": 0.0, "compressed": 0.0}
        assert [h["planned_at"] for h in res["history"]] == [-1, 1, 1, 3, 3, 5]
        assert [h["replans"] for h in res["history"]] == [0, 0, 0, 1, 1, 2]
        assert [p[0] for p in res["plans"]] == [1, 3, 5]
        assert res["stats"]["plan"]["replans"] == 2 and res["stats"]["plan"]["iteration"] == 5
    assert a["plans"] == b["plans"]
    assert [h["written"] for h in a["history"]] == [None, [1, 0], [1, 0], [3, 1], [3, 1], [5, 2]]
    logged = json.loads((tmp_path / "plan.json").read_text())
    assert (logged["iteration"], logged["replans"]) == (5, 2)
    assert {d["key"]: [d["compress"], d["partitions"]] for d in logged["decisions"]} == a["decisions"]


def test_casync_pipeline_equals_partitions_exchanged_alone(two_ranks):
    _, ranks = two_ranks
    for r in ranks:
        res = r["casync"]
        for codec in ("topk", "fp16", "powersgd"):
            assert res[codec]["diff_vs_alone"] == 0.0, (codec, res[codec])
        assert res["fp16"]["diff_vs_whole"] == 0.0
        assert res["exchange_plan"]["mean_diff"] == 0.0
        assert res["exchange_plan"]["mass"] < 1e-6
        assert res["exchange_plan"]["dense_diff"] == 0.0


def test_multi_round_codecs_fuse_their_rounds_across_tensors(two_ranks):
    """GradientFlow's lazy all-reduce (issue 13 s1) for PowerSGD, fp16, csc and sketch: each
    tensor's result is its own aggregate's (bits; csc's also a plain-torch model of the
    rule's, float64); one fusion buffer per round and dtype instead of a message per
    tensor and round."""
    _, ranks = two_ranks
    for r in ranks:
        res = r["fused_rounds"]
        for codec in ("powersgd", "fp16", "csc", "sketch"):
            for mode in ("unfused", "fused"):
                assert res[codec][mode]["worst"] == 0.0, (codec, mode, res[codec])
        # 3 compressed tensors, the 3 small ones dense in one message
        assert res["powersgd"]["unfused"]["messages"] == [1 + 3 * 2] * 2  # P and Q per tensor
        assert res["powersgd"]["fused"]["messages"] == [2] * 2  # P's (with the small ones), Q's
        assert res["fp16"]["unfused"]["messages"] == [1 + 3] * 2
        assert res["fp16"]["fused"]["messages"] == [2] * 2  # one float16 buffer, one float32
        # fused (one rounds_segments generator): P's buffer with the small ones, Q's
        assert res["elastic"]["messages"] == 2 and res["elastic"]["local_shape"] == [48 * 16 + 7 + 32 * 24 + 15 + 800 + 9]
        for mode in ("unfused", "fused"):
            assert res["csc"][mode]["independent"] == 0.0, (mode, res["csc"])
        assert res["csc"]["unfused"]["messages"] == [1 + 3 * 2] * 2  # scores and chunks per tensor
        assert res["csc"]["fused"]["messages"] == [2] * 2  # the scores (with the small ones), the chunks
        assert res["elastic_csc"]["messages"] == 2
        assert res["sketch"]["unfused"]["messages"] == [1 + 3 * 2] * 2  # bitmap OR and sketch sum per tensor
        assert res["sketch"]["fused"]["messages"] == [3] * 2  # the small ones' sum, one OR buffer, one sketch sum


def test_switch_sum_equals_all_reduce_float64(tmp_path):
    for r in _run(tmp_path, 2, "switch"):
        res = r["switch"]
        assert res["equal"] == [True, True, True]
        assert res["sent"] == res["expected_sent"]  # each tensor once (+ a 24-byte header)
        assert res["ddp_equal"]


def test_switch_with_an_external_aggregator_process(tmp_path):
    world, port = 2, free_port()
    env = base_env()
    agg = subprocess.Popen(
        [PY, "-m", "easgd_lightning.comm.switch", "--addr", "127.0.0.1", "--port", str(port),
         "--workers", str(world), "--timeout-s", "60"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    # the ranks forked from the session's script server (as launch_ranks'), rendezvous at
    # the aggregator's port; the aggregator itself a fresh `python -m easgd_lightning.comm.switch`
    procs = start_ranks(SCRIPT, world, [str(tmp_path), "switch_external"], port=port)
    try:
        outs = [p.communicate(timeout=240) for p in procs]
        agg_out = agg.communicate(timeout=60)
    finally:
        for p in [*procs, agg]:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [o[1][-3000:] for o in outs]
    assert agg.returncode == 0, agg_out[1][-3000:]
    assert "served" in agg_out[0]
    for r in range(world):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())["switch_external"]
        assert res["equal"] == [True, True, True] and res["ddp_equal"]
