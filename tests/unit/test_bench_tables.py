"""bench/_tables.add_efficiency: limit step time / row step time, over one window only."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from _tables import add_efficiency  # noqa: E402


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
