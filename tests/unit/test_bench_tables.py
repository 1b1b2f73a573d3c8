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
