"""Issue 29 sections 4 and 5 in bench/cluster: the sc17 row's share of its bandwidth bound,
the cost model's SC17 row beside it, and the optimus scenario's loss gap and tokens/s."""

from __future__ import annotations

import pytest

from bench._scenarios import OPTIMUS_CC, OPTIMUS_NONE, SC17_OVERLAPPED, SCENARIOS, one_config


def _row(spec, status="ok", **figures):
    strategy, rest = spec.split("/", 1)
    compression, *overrides = rest.split(";")
    return {"strategy": strategy, "compression": compression, "overrides": overrides, "status": status, **figures}


def _scenario(name, workers, rate):
    return {
        "name": name, "workers": workers, "steps": 40, "warmup_steps": 10, "workload": [], "extra": [],
        "link": {"rate_mbit": rate, "latency_ms": 0.1, "latency_emulated": False},
        "machine": {"cpus": 2, "platform": "linux"}, "date": "today", "command": "bench/cluster.py",
    }


def test_sc17_of_bound_is_the_measured_speedup_over_the_printed_bound():
    """8 workers: the ring moves 2 x 7/8 of the 614400-byte difference, 1.75 x 614400 x 8 /
    60e6 = 143.4 ms at 60 Mbit/s, longer than the 30 ms limit step, so the bound is round-robin's
    0.9 s / 0.1434 s = 6.28x; an overlapped step of 0.2 s is 4.5x, 71.7% of it: MISS at 80%."""
    from bench._tables import finish_table, loss_gap, share_of_bound

    rows = [
        _row("ddp/none", step_time_s=0.5),
        _row("limit/none", step_time_s=0.03),
        _row("easgd_round_robin/none", step_time_s=0.9),
        _row("sync_easgd/none;strategy.overlap=false", step_time_s=0.3, bytes_per_step_per_worker=614_400),
        _row(SC17_OVERLAPPED, step_time_s=0.2, bytes_per_step_per_worker=614_400),
    ]
    scenario = _scenario("sc17", 8, 60.0)
    md = finish_table(rows, scenario, SCENARIOS["sc17"].targets)
    wire = 1.75 * 614_400 * 8 / 60e6
    assert rows[4]["of_bound"] == pytest.approx((0.9 / 0.2) / (0.9 / wire))
    assert rows[3]["of_bound"] == pytest.approx((0.9 / 0.3) / (0.9 / wire))
    verdict = next(t for t in scenario["targets"] if t["kind"] == "of_bound")
    assert verdict["measured"] == pytest.approx(wire / 0.2) and verdict["status"] == "MISS"
    assert "Bandwidth bound (8 workers)" in md and "4.50x measured, 72% of the bound" in md
    assert "Cost model's SC17 row: not available" in md
    # a step 1.25x the wire is 80% of the bound; no round-robin step: no share
    assert share_of_bound(0.9, 1.25 * wire, {"max_speedup": 0.9 / wire}) == pytest.approx(0.8)
    assert share_of_bound(None, 0.2, {"max_speedup": 2.0}) is None
    assert loss_gap(2.1, 2.0) == pytest.approx(0.05) and loss_gap(1.9, 2.0) == pytest.approx(0.05)
    assert loss_gap(None, 2.0) is None and loss_gap(2.0, 0.0) is None


def test_sc17_projection_row_is_read_from_the_cost_models_projection():
    from bench._tables import sc17_projection, sc17_projection_md

    projection = {
        "note": "MODEL PROJECTION, not a measurement",
        "table": {"knl": {"sync_easgd/none": {"64": 0.5}, "sync_easgd/none (SC17 tree)": {"64": 0.97, "4096": 0.62}},
                  "gpu": {"sync_easgd/none (SC17 tree)": {"64": 0.1}}},
        "sc17": {"workers": 4253, "efficiency": 0.915},
    }
    record = sc17_projection(projection, "cm.json")
    assert record["efficiency"] == {"64": 0.97, "4096": 0.62} and record["layout"] == "knl"
    md = sc17_projection_md(record)
    assert "64 workers 97.0%, 4096 workers 62.0%" in md and "SC17 measured 91.5% on 4253 KNL cores" in md
    assert sc17_projection({"table": {"knl": {}}}, "cm.json") is None


def test_optimus_scenario_runs_its_two_rows_and_judges_tokens_and_loss():
    """The preset runs exactly its two pipeline_3d rows (no ddp/none, no limit row); the
    speedup is step-time based (the same tokens per step), the loss gap is issue 5's 5%."""
    from bench._tables import finish_table, tokens_per_s
    from bench.cluster import _parser, resolve_settings

    preset = SCENARIOS["optimus"]
    settings = resolve_settings(_parser().parse_args(["--scenario", "optimus", "--hosts", "4"]), preset)
    assert settings.configs == [one_config(OPTIMUS_NONE), one_config(OPTIMUS_CC)] and settings.workers == 4
    assert resolve_settings(_parser().parse_args(["--scenario", "sc17", "--hosts", "8"]), SCENARIOS["sc17"]).workers == 8
    rows = [
        _row(OPTIMUS_NONE, step_time_s=0.6, samples_per_s=53.3, final_loss=2.50),
        _row(OPTIMUS_CC, step_time_s=0.5, samples_per_s=64.0, final_loss=2.60),
    ]
    for r in rows:
        r["tokens_per_s"] = tokens_per_s(r["samples_per_s"], 64)
    scenario = _scenario("optimus", 4, 100.0)
    md = finish_table(rows, scenario, preset.targets)
    speed, loss = scenario["targets"]
    assert speed["measured"] == pytest.approx(1.2) and speed["status"] == "MISS"
    assert loss["measured"] == pytest.approx(0.04) and loss["status"] == "PASS"
    assert f"{OPTIMUS_CC} 4096 tokens/s" in md and "pipeline_3d/optimus_cc `compression.dp_rank=8`" in md and "loss gap <= 5%" in md
    assert tokens_per_s(None, 64) is None


def test_sc17_table_reads_the_projection_from_costmodel_json(tmp_path):
    """``--costmodel``: the projection ``bench.costmodel`` stored in costmodel.json; nothing
    (None: the table says how to get one) where neither it nor its inputs exist."""
    import json

    from bench.cluster import costmodel_sc17

    path = tmp_path / "costmodel.json"
    assert costmodel_sc17(path) is None and costmodel_sc17(None) is None
    table = {"knl": {"sync_easgd/none (SC17 tree)": {"64": 0.9, "512": 0.8, "4096": 0.7}}}
    path.write_text(json.dumps({"projection": {"table": table, "sc17": {"workers": 4253, "efficiency": 0.915}}}))
    record = costmodel_sc17(path)
    assert record["efficiency"] == {"64": 0.9, "512": 0.8, "4096": 0.7} and record["source"] == str(path)


def test_sc17_calibration_steps_down_at_most_tenfold_per_probe():
    """8 ranks on 2 cores: round-robin at 1 Gbit/s read 1 - limit/step = -34% (the limit's
    ranks all compute at once); the odds model would jump to 1.2 Mbit/s, the cap to 100."""
    from bench._runs import sc17_next_rate

    assert sc17_next_rate(1000.0, -0.34, 0.87) == 100.0
    assert sc17_next_rate(1000.0, 0.6, 0.87) == 190.0  # within the cap: the odds model
    assert sc17_next_rate(100.0, 0.5, 0.87, max_drop=2.0) == 50.0
