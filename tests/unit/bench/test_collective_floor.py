"""bench/collective_floor.py: its statistics, and a real two-process run on loopback."""

from __future__ import annotations

import json
import socket

import pytest

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


def test_overlap_mode_times_the_all_reduce_the_compute_and_both(tmp_path, capsys):
    """Sync EASGD's overlapped exchange stripped of the framework: each phase timed per step;
    the compute phase lasts its wall-clock length, the overlapped one at least that long, and
    the table states the ring's bound beside it."""
    rc = main(["--loopback", "--mode", "overlap", "--repeats", "8", "--warmup", "2", "--compute-ms", "3",
               "--sizes", "40000", "--port", str(_free_port()), "--timeout-s", "60", "--out", str(tmp_path)])
    assert rc == 0
    (row,) = json.loads((tmp_path / "floor.json").read_text())
    assert row["bytes"] == 40000 and all(row[p]["calls"] == 6 for p in ("allreduce", "compute", "overlapped"))
    assert 3.0 <= row["compute"]["median_ms"] and row["overlapped"]["median_ms"] >= 3.0
    assert 0 < row["allreduce"]["median_ms"]
    out = capsys.readouterr().out
    assert "overlapped all-reduce" in out and "| 40000 |" in out and "bound" in out


def test_hosts_other_than_two_need_the_emulated_overlap_mode(capsys):
    with pytest.raises(SystemExit):
        main(["--loopback", "--mode", "overlap", "--hosts", "8"])
    assert "--hosts" in capsys.readouterr().err
