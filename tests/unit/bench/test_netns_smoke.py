"""bench/netns_smoke.py and the smoke mode's CPU shares: a real one-rank gloo run on
loopback, and the shares computed from a /proc/stat window."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from bench._runs import smoke_cpu_shares
from easgd_lightning.utils.cputime import CPU_FIELDS, cpu_spent
from easgd_lightning.utils.rank_env import clean_env, rank_env


def _host(**kw: float) -> dict:
    return {k: float(kw.get(k, 0.0)) for k in CPU_FIELDS}


def test_cpu_shares_split_the_cores_time_into_busy_kernel_and_user():
    # 10 s of core time: 2 user, 1 system, 0.5 softirq, 0.5 steal, 5 idle, 1 iowait
    shares = smoke_cpu_shares({"host": _host(user=2, system=1, softirq=0.5, steal=0.5, idle=5, iowait=1)})
    assert shares == pytest.approx({"busy_share": 0.4, "kernel_share": 0.2, "user_share": 0.2})
    assert smoke_cpu_shares(None) is None and smoke_cpu_shares({"host": None}) is None


def test_timed_windows_add_up_kind_by_kind():
    def reading(process_s: float, wall_s: float, **kw: float) -> dict:
        return {"host": _host(**kw), "process_s": process_s, "wall_s": wall_s}

    # two windows with a gap between them: (user 1, idle 2) and (user 3, irq 1)
    spans = [(reading(0.0, 0.0), reading(0.5, 1.0, user=1, idle=2)),
             (reading(9.0, 5.0, user=50, idle=50), reading(9.25, 7.0, user=53, idle=50, irq=1))]
    total = cpu_spent(spans)
    assert total["host"] == _host(user=4, idle=2, irq=1)
    assert total["process_s"] == 0.75 and total["wall_s"] == 3.0
    assert cpu_spent([])["process_s"] == 0.0


def test_one_rank_smoke_checks_its_sum_and_records_its_cpu(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = rank_env(clean_env(), 0, 1, port)
    proc = subprocess.run([sys.executable, "-m", "bench.netns_smoke", "--mbytes", "0.4", "--repeats", "2",
                           "--out", str(tmp_path), "--timeout-s", "60"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=os.getcwd())
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "rank0.json").read_text())
    assert res["bytes"] == 400_000 and len(res["times_s"]) == 2
    cpu = res["cpu"]
    assert cpu["wall_s"] == pytest.approx(sum(res["times_s"]), rel=0.5, abs=0.05)
    assert set(cpu["host"]) == set(CPU_FIELDS) and all(v >= 0 for v in cpu["host"].values())
