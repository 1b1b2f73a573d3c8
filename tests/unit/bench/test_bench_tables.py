"""bench/_tables.add_efficiency: limit step time / row step time, over one window only."""

from __future__ import annotations

import pytest

from bench._tables import add_efficiency


def _row(strategy, step, measured="steps 5..36", status="ok"):
    return {"strategy": strategy, "compression": "none", "step_time_s": step, "measured": measured, "status": status}


def test_efficiency_is_the_limit_step_over_the_row_step_in_one_window():
    rows = [_row("ddp", 0.05), _row("limit", 0.01), _row("sync_easgd", 0.02)]
    add_efficiency(rows)
    assert [r["efficiency"] for r in rows] == [pytest.approx(0.2), pytest.approx(1.0), pytest.approx(0.5)]


def test_a_row_measured_over_another_window_than_the_limit_gets_no_efficiency():
    # the limit row fell back to whole-run figures (its steady window came out <= 0):
    # whole run / steady state would put start-up on one side of the ratio only
    rows = [_row("ddp", 0.05), _row("limit", 0.04, measured="whole run"), _row("sync_easgd", 0.02)]
    add_efficiency(rows)
    assert [r["efficiency"] for r in rows] == [None, pytest.approx(1.0), None]
    # and a row that fell back while the limit is steady
    rows = [_row("ddp", 0.09, measured="whole run"), _row("limit", 0.01), _row("sync_easgd", 0.02)]
    add_efficiency(rows)
    assert [r["efficiency"] for r in rows] == [None, pytest.approx(1.0), pytest.approx(0.5)]


def test_ring_bound_of_the_sc17_comparison():
    from bench._tables import max_speedup_at_share, ring_bound, sc17_bound

    # 4 workers, 614400 bytes, 270 Mbit/s: 1.5 x 614400 x 8 / 270e6 = 27.3 ms on the wire
    b = ring_bound(4, 614_400, 270.0, 0.007, 0.090)
    assert b["wire_s"] == pytest.approx(0.0273067, rel=1e-5)
    assert b["best_step_s"] == pytest.approx(b["wire_s"])
    assert b["max_speedup"] == pytest.approx(0.090 / 0.0273067, rel=1e-5)
    assert b["min_exposed_share"] == pytest.approx((0.0273067 - 0.007) / 0.0273067, rel=1e-5)
    # 20.3 ms of every step waits: 14% exposed needs steps >= 0.145 s, slower than 0.090
    assert max_speedup_at_share(b, 0.14) == pytest.approx(0.090 * 0.14 / (0.0273067 - 0.007), rel=1e-5)
    # compute longer than the wire: the limit step bounds it and nothing need stay exposed
    fast = ring_bound(4, 614_400, 2700.0, 0.007, 0.090)
    assert fast["best_step_s"] == 0.007 and fast["min_exposed_share"] == 0.0
    rows = [
        _row("limit", 0.007),
        _row("easgd_round_robin", 0.090),
        dict(_row("sync_easgd", 0.041), bytes_per_step_per_worker=614_400),
    ]
    scenario = {"workers": 4, "link": {"rate_mbit": 270.0}}
    assert sc17_bound(rows, scenario) == b
    rows[1]["status"] = "failed"
    assert sc17_bound(rows, scenario) is None


def test_lowband_targets_read_bytes_to_target_and_the_largest_exchange():
    """The lowband presets judge DiLoCo by the bytes a worker sent until the target and by
    its largest exchange, each as ref / row."""
    from bench._runs import bytes_to_target, peak_exchange
    from bench._scenarios import LOWBAND_4BIT, LOWBAND_DILOCO, LOWBAND_STREAMING, SCENARIOS
    from bench._tables import evaluate_targets

    assert bytes_to_target({"bytes_per_step_per_worker": 1000.0}, {"step": 30}) == 30000.0
    assert bytes_to_target({"bytes_per_step_per_worker": 1000.0}, None) is None
    assert peak_exchange({"extras": [{"peak_exchange_dense_bytes": 328704}, {}]}) == 328704
    assert peak_exchange({"extras": [{}]}) is None

    def row(spec, **figures):
        strategy, rest = spec.split("/", 1)
        compression, *overrides = rest.split(";")
        return {"strategy": strategy, "compression": compression, "overrides": overrides, "status": "ok", **figures}

    rows = [
        row("ddp/none", bytes_to_target=2.0e8, time_to_target_s=300.0),
        row(LOWBAND_DILOCO, peak_exchange_bytes=1_129_512),
        row(LOWBAND_STREAMING, peak_exchange_bytes=328_704),
        row(LOWBAND_4BIT, bytes_to_target=1.0e6, time_to_target_s=150.0),
    ]
    verdicts = {(t["row"], t["short"]): (t["status"], t["measured"])
                for t in evaluate_targets(rows, SCENARIOS["lowband10"].targets)}
    assert verdicts[(LOWBAND_4BIT, "100x vs ddp/none")] == ("PASS", pytest.approx(200.0))
    assert verdicts[(LOWBAND_STREAMING, "3x vs diloco/none")] == ("PASS", pytest.approx(1_129_512 / 328_704))
    assert verdicts[(LOWBAND_4BIT, "3x vs ddp/none")] == ("MISS", pytest.approx(2.0))


def _spec_row(spec, status="ok", **figures):
    strategy, rest = spec.split("/", 1)
    compression, *overrides = rest.split(";")
    return {"strategy": strategy, "compression": compression, "overrides": overrides, "status": status, **figures}


def test_best_dense_is_the_fastest_completed_of_ddp_none_bf16_fp16():
    """Issue 29: the reference is the least figure among the dense rows that completed;
    rows that change the exchange (comm.*) or training (optim.*) are not baselines."""
    from bench._scenarios import BF16_ROW, FP16_ROW
    from bench._tables import best_dense, is_dense, row_spec

    rows = [
        _spec_row("ddp/none", step_time_s=0.30, time_to_target_s=40.0),
        _spec_row(BF16_ROW, step_time_s=0.18, time_to_target_s=None),
        _spec_row(FP16_ROW, step_time_s=0.20, time_to_target_s=25.0),
        _spec_row("ddp/none;comm.hierarchy=node", step_time_s=0.05),  # the row under test
        _spec_row("ddp/bf16;optim.momentum=0", step_time_s=0.01),
        _spec_row("ddp/powersgd", step_time_s=0.02),
    ]
    assert [is_dense(r) for r in rows] == [True, True, True, False, False, False]
    assert row_spec(best_dense(rows)) == BF16_ROW
    assert row_spec(best_dense(rows, "time_to_target_s")) == FP16_ROW  # bf16 never got there
    rows[1]["status"] = "failed (rc=[1, 1])"
    assert row_spec(best_dense(rows)) == FP16_ROW
    assert best_dense([rows[1], *rows[3:]]) is None


def test_throughput_and_tta_tables_name_their_reference_and_keep_the_fp32_ratio():
    from bench._scenarios import BF16_ROW, FP16_ROW
    from bench._tables import finish_table

    rows = [
        _spec_row("ddp/none", step_time_s=0.40, samples_per_s=100.0),
        _spec_row("limit/none", step_time_s=0.05, samples_per_s=800.0),
        _spec_row(BF16_ROW, step_time_s=0.25, samples_per_s=160.0),
        _spec_row(FP16_ROW, step_time_s=0.26, samples_per_s=155.0),
        _spec_row("ddp/powersgd", step_time_s=0.10, samples_per_s=400.0),
    ]
    scenario = {
        "name": "quick", "workers": 2, "steps": 20, "warmup_steps": 2, "workload": [], "extra": [],
        "link": {"rate_mbit": 100.0, "latency_ms": 0.1, "latency_emulated": False},
        "machine": {"cpus": 2, "platform": "linux"}, "date": "today", "command": "bench/cluster.py",
    }
    md = finish_table(rows, scenario, ())
    assert scenario["reference"]["row"] == BF16_ROW
    assert scenario["reference"]["candidates"] == {"ddp/none": 0.40, BF16_ROW: 0.25, FP16_ROW: 0.26}
    assert f"- reference: {BF16_ROW} (best dense" in md
    assert rows[4]["ratio"]["step_time_s"] == pytest.approx(0.10 / 0.25)
    assert rows[4]["ratio"]["samples_per_s"] == pytest.approx(400.0 / 160.0)
    assert rows[4]["x_vs_none"] == pytest.approx(0.10 / 0.40)
    assert "| 0.40x | 0.25x |" in md  # powersgd: x against bf16, then x vs ddp/none
    tta = [
        _spec_row("ddp/none", time_to_target_s=40.0),
        _spec_row(BF16_ROW, time_to_target_s=30.0),
        _spec_row(FP16_ROW, time_to_target_s=32.0),
        _spec_row("sync_easgd/topk", time_to_target_s=10.0),
    ]
    tta_scenario = dict(scenario, kind="tta", epochs=4, target_acc=0.95)
    md = finish_table(tta, tta_scenario, ())
    assert tta_scenario["reference"]["row"] == BF16_ROW and f"- reference: {BF16_ROW}" in md
    assert tta[3]["speedup"] == pytest.approx(3.0) and tta[3]["speedup_vs_none"] == pytest.approx(4.0)


def test_best_dense_targets_resolve_per_run_and_say_against_which_row():
    """A target with ref BEST_DENSE (the presets' former ref="ddp/none") is judged against
    the best dense row of that run, for its own figure, and names it."""
    from bench._scenarios import BEST_DENSE, DGC_ROW, FP16_ROW, SCENARIOS, Target
    from bench._tables import evaluate_targets

    rows = [
        _spec_row("ddp/none", step_time_s=0.40),
        _spec_row(FP16_ROW, step_time_s=0.30),
        _spec_row(DGC_ROW, step_time_s=0.125),
    ]
    (speed,) = [t for t in evaluate_targets(rows, SCENARIOS["default"].targets) if t["kind"] == "speedup"]
    assert speed["ref"] == FP16_ROW and speed["short"] == "2x vs ddp/fp16"
    assert speed["measured"] == pytest.approx(0.30 / 0.125) and speed["status"] == "PASS"
    assert f"{FP16_ROW} ({BEST_DENSE})" in speed["target"]
    # only ddp/none ran: the same verdict as before issue 29
    (speed,) = [t for t in evaluate_targets([rows[0], rows[2]], SCENARIOS["default"].targets) if t["kind"] == "speedup"]
    assert speed["short"] == "2x vs ddp/none" and speed["measured"] == pytest.approx(0.40 / 0.125)
    # no dense row at all: n/a, not a ratio against something else
    (speed,) = [t for t in evaluate_targets([rows[2]], SCENARIOS["default"].targets) if t["kind"] == "speedup"]
    assert speed["status"] == f"n/a: {BEST_DENSE} not run" and speed["measured"] is None
    # time to target: no dense row got there; the one that trained shortest bounds it
    target = Target("sync_easgd/topk", "speedup", ">=", 2.0, ref=BEST_DENSE, figure="time_to_target_s")
    tta = [
        _spec_row("ddp/none", time_to_target_s=None, train_time_s=60.0),
        _spec_row(FP16_ROW, time_to_target_s=None, train_time_s=30.0),
        _spec_row("sync_easgd/topk", time_to_target_s=10.0),
    ]
    (got,) = evaluate_targets(tta, [target])
    assert got["ref"] == FP16_ROW and got["status"].startswith("PASS") and "> 3.00x" in got["status"]


def test_async_time_to_accuracy_names_the_best_dense_row():
    from bench.async_time_to_accuracy import summarise

    def run(t):
        return [{"roles": ["worker"] * 3, "steps": [10], "time_to_target": t, "val_acc": 0.9, "bytes_sent": 1e6}]

    md = summarise({"sync_easgd": run(8.0), "ddp": run(6.0), "ddp/bf16": run(4.0), "ddp/fp16": run(None),
                    "async_easgd": run(2.0)}, 0.9)
    assert "reference: ddp/bf16 (best dense: the soonest of ddp, ddp/bf16, ddp/fp16)" in md
    assert "| async_easgd | 3 | [10] | 2.00 | 0.25 | 0.50 |" in md


def test_shards_target_is_the_one_server_step_over_the_four_server_step():
    """``--scenario shards`` (issue 29 section 1): async_easgd with 4 servers judged by its
    per-step speedup over the same strategy with one server."""
    from bench._scenarios import SCENARIOS, SHARDS_FOUR, SHARDS_ONE
    from bench._tables import evaluate_targets

    rows = [_spec_row("ddp/none", step_time_s=0.5), _spec_row(SHARDS_ONE, step_time_s=0.30),
            _spec_row(SHARDS_FOUR, step_time_s=0.12)]
    (got,) = evaluate_targets(rows, SCENARIOS["shards"].targets)
    assert got["ref"] == SHARDS_ONE and got["measured"] == pytest.approx(2.5) and got["status"].startswith("PASS")


def _summary(readings):
    """A summary's train_cpu_per_rank: rank 0 reads the machine; (host fields, process s, wall s)."""
    zero = dict.fromkeys(("nice", "iowait", "irq"), 0.0)
    return {"train_cpu_per_rank": [
        {"host": {**zero, **host} if host else None, "process_s": proc, "wall_s": wall} for host, proc, wall in readings]}


def test_steady_cpu_is_the_long_run_minus_the_short_one_per_step():
    from bench._tables import cpu_md, steady_cpu

    # 2 cores: between the short run's training (2 s) and the long run's (12 s), 20 core-
    # seconds: 12 user, 3 system, 2 softirq, 1 steal, 2 idle; rank 1 used 8.5 s of CPU more
    host = {"user": 2.0, "system": 0.5, "idle": 1.0, "softirq": 0.3, "steal": 0.2}
    short = _summary([(host, 1.0, 2.0), (None, 1.5, 2.0)])
    long = _summary([({"user": 14.0, "system": 3.5, "idle": 3.0, "softirq": 2.3, "steal": 1.2}, 10.0, 12.0),
                     (None, 10.0, 12.0)])
    cpu = steady_cpu(long, short, steps=1000, cores=2)
    assert cpu["cpu_ms_per_step"] == pytest.approx(1e3 * 18.0 / 1000)  # busy: all but idle
    assert cpu["busy_share"] == pytest.approx(18 / 20) and cpu["user_share"] == pytest.approx(12 / 20)
    assert cpu["system_share"] == pytest.approx(3 / 20) and cpu["interrupt_share"] == pytest.approx(2 / 20)
    assert cpu["steal_share"] == pytest.approx(1 / 20) and cpu["cores"] == 2
    assert cpu["process_ms_per_step"] == [pytest.approx(9.0), pytest.approx(8.5)]
    assert steady_cpu(long, {}, 1000, 2) is None and steady_cpu(short, long, 1000, 2) is None
    line = cpu_md([{"strategy": "ddp", "compression": "dgc", "cpu": cpu}, {"strategy": "limit", "compression": "none"}])
    assert "ddp/dgc 18.0 ms (busy 90%: user 60, system 15, interrupts 10, steal 5; ranks' processes 9.0, 8.5 ms)" in line
    assert "2 cores" in line
