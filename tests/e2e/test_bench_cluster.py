"""End-to-end: ``bench/cluster.py --quick`` on an emulated two-host network.

Runs the real harness in a subprocess (network namespaces, a bridge, ``tc``-shaped links,
two ``easgd-train`` processes over gloo), then checks the table it wrote and that nothing
it created is left behind. Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and a kernel that
permits network namespaces; skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "cluster.py"


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def _root_veths() -> set[str]:
    out = subprocess.run(
        ["ip", "-o", "link", "show", "type", "veth"], check=False, capture_output=True, text=True
    )
    return {line.split(":")[1].strip() for line in out.stdout.splitlines() if ":" in line}


def _netns_unavailable() -> str | None:
    """Why this machine cannot run the emulated cluster, or None when it can."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) not installed"
    if os.geteuid() != 0:
        return "not root: creating network namespaces needs root or CAP_NET_ADMIN+CAP_SYS_ADMIN"
    probe = f"easgd-probe-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(
        ["ip", "netns", "add", probe], check=False, capture_output=True, text=True
    )
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


@pytest.fixture(scope="module")
def netns_ok() -> None:
    reason = _netns_unavailable()
    if reason:
        print(f"skipping the emulated-cluster test: {reason}")
        pytest.skip(reason)


@pytest.mark.slow
@pytest.mark.netns
def test_quick_cluster_table_and_cleanup(netns_ok: None, tmp_path: Path) -> None:
    before_veth = _root_veths()
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=400,
    )
    print(proc.stdout[-4000:])
    print(proc.stderr[-4000:], file=sys.stderr)
    assert proc.returncode == 0, f"bench/cluster.py --quick exited {proc.returncode}"

    table = json.loads((tmp_path / "cluster.json").read_text())
    assert (tmp_path / "cluster.md").read_text().count("\n| ") >= 3  # header + 2 rows
    rows = {(r["strategy"], r["compression"]): r for r in table["rows"]}
    assert set(rows) == {("ddp", "none"), ("sync_easgd", "none")}
    for key, row in rows.items():
        assert row["status"] == "ok", key
        assert row["samples_per_s"] > 0, key
        assert row["bytes_per_step_per_worker"] > 0, key
        assert row["step_time_s"] > 0, key
        assert 0.0 <= row["comm_share"] <= 1.0, key
    base = rows[("ddp", "none")]["ratio"]
    for figure, ratio in base.items():
        if rows[("ddp", "none")][figure] not in (None, 0):
            assert ratio == pytest.approx(1.0), figure
    assert table["scenario"]["workers"] == 2

    # Nothing the run created is left: no namespace of its run id, no new veth on the host.
    run_id = table["scenario"]["run_id"]
    assert re.fullmatch(r"easgd-bench-\d+", run_id)
    leftover = {n for n in _netns_names() if n.startswith(run_id + "-")}
    assert not leftover, f"namespaces left behind: {leftover}"
    assert _root_veths() <= before_veth, "veth links appeared in the host namespace"


def test_refuses_without_privileges_exit_2(tmp_path: Path) -> None:
    """Without CAP_NET_ADMIN the harness stops with exit code 2 and says why."""
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: cannot drop capabilities to test the refusal")
        # Stay uid 0 but drop every capability: the script must refuse before building anything.
        cmd = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", *cmd]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2, stderr
    assert "root" in stderr and "CAP_NET_ADMIN" in stderr
    # setpriv execs the script in place, so its pid names the run's namespaces.
    assert not {n for n in _netns_names() if n.startswith(f"easgd-bench-{proc.pid}-")}
