"""bench/collective_floor.py: its statistics, and a real two-process run on loopback."""

from __future__ import annotations

import json
import socket

from bench.collective_floor import main, summarize


def test_summarize_reports_median_mean_and_p90():
    times = [1.0, 2.0, 3.0, 4.0, 100.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    s = summarize(times)
    assert s == {"median_ms": 5.5, "mean_ms": 14.5, "p90_ms": 100.0, "calls": 10}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_loopback_run_times_every_call_after_the_warmup(tmp_path, capsys):
    rc = main(["--loopback", "--repeats", "9", "--warmup", "3", "--compute-ms", "1", "--sizes", "40,4096",
               "--port", str(_free_port()), "--timeout-s", "60", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "floor.json").read_text())
    assert [r["bytes"] for r in rows] == [40, 4096]
    assert all(r["calls"] == 6 and 0 < r["median_ms"] <= r["p90_ms"] and r["cpu_ms"] >= 0 for r in rows)
    out = capsys.readouterr().out
    assert "| 40 |" in out and "Efficiency bound" in out
