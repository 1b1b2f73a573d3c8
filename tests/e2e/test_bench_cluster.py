"""End-to-end: ``bench/cluster.py --quick`` on an emulated two-host network.

Runs the real harness in a subprocess (network namespaces, a bridge, ``tc``-shaped links,
two ``easgd-train`` processes over gloo), then checks the table it wrote and that nothing
it created is left behind. Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and a kernel that
permits network namespaces; skipped, with the reason, elsewhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "cluster.py"


def _load_cluster_module():
    spec = importlib.util.spec_from_file_location("bench_cluster", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_cluster"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


cluster = _load_cluster_module()


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
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--quick", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        # Generous: the machine may be shared; --quick takes about a minute alone.
        stdout, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the harness removes its namespaces on SIGTERM
        stdout, stderr = proc.communicate(timeout=120)
        pytest.fail(f"bench/cluster.py --quick timed out:\n{stderr[-4000:]}")
    print(stdout[-4000:])
    print(stderr[-4000:], file=sys.stderr)
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


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_mid_run_removes_everything(
    netns_ok: None, tmp_path: Path, sig: signal.Signals
) -> None:
    """Ctrl-C or SIGTERM while the ranks train: exit 128+N, no namespace or process left."""
    before_veth = _root_veths()
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--quick", "--steps", "100000", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline"),
    )
    prefix = f"easgd-bench-{proc.pid}-"
    try:
        log = tmp_path / "cluster_runs" / "ddp__none" / "logs" / "rank0.log"
        for _ in range(600):  # up to 60 s for the network and the first rank to start
            if log.exists() and any(n.startswith(prefix) for n in _netns_names()):
                break
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            time.sleep(0.1)
        else:
            pytest.fail("the emulated cluster did not come up within 60 s")
        time.sleep(3.0)  # let the ranks get going
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + sig, stderr[-4000:]
    assert "cleaned up" in stderr
    assert not {n for n in _netns_names() if n.startswith(prefix)}
    assert _root_veths() <= before_veth
    ps = subprocess.run(["ps", "-eo", "args"], check=False, capture_output=True, text=True)
    assert str(tmp_path) not in ps.stdout, "a training process of the run is still alive"


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


# --------------------------------------------------------------- pure helpers (no netns)


def test_parse_configs_with_row_overrides() -> None:
    got = cluster.parse_configs(
        "ddp/none, ddp/dgc;compression.warmup_ratio_steps=0;optim.momentum=0,"
    )
    assert [c.key for c in got] == [("ddp", "none"), ("ddp", "dgc")]
    assert got[1].overrides == ("compression.warmup_ratio_steps=0", "optim.momentum=0")
    assert "=" not in got[1].slug  # it becomes hydra.run.dir
    assert cluster.parse_configs("ddp/none,ddp/none") == [cluster.BenchConfig("ddp", "none")]
    for bad in ("ddp", "ddp/none/x", "ddp/dgc;warmup", ""):
        with pytest.raises(ValueError, match="--configs"):
            cluster.parse_configs(bad)


def test_merge_overrides_later_wins_and_harness_keys_fixed() -> None:
    merged = cluster.merge_overrides(["logger=none", "a=1"], ["a=2", "+b=3"], ["b=4"])
    assert merged == ["logger=none", "a=2", "b=4"]
    cmd = cluster.train_command(
        "ddp", "none", 4, 7, Path("/tmp/x"), ["model=mlp"], ["logger=csv", "strategy=evil"]
    )
    assert cmd[0].endswith("easgd-train")
    assert "logger=csv" in cmd and "logger=none" not in cmd
    assert "strategy=ddp" in cmd and "strategy=evil" not in cmd
    assert {"trainer.devices=1", "trainer.num_nodes=4", "trainer.max_steps=7"} <= set(cmd)


def test_row_from_summary_and_ratios() -> None:
    def summary(wall: float, steps: list, sent: list, frac: float, loss: float) -> dict:
        return {
            "steps_per_rank": steps,
            "wall_time_s": wall,
            "samples_per_s": sum(s or 0 for s in steps) * 32 / wall,
            "train_loss": loss,
            "comm": {"bytes_sent": sent, "time_fraction": frac},
        }

    base = cluster.row_from_summary(summary(10.0, [100, 100], [4000, 4000], 0.5, 1.0))
    assert base["step_time_s"] == pytest.approx(0.1)
    assert base["bytes_per_step_per_worker"] == pytest.approx(40.0)
    # A parameter server (rank 0, no steps) is charged to the workers' steps.
    ps = cluster.row_from_summary(summary(5.0, [0, 50, 150], [3000, 500, 500], 0.25, 2.0))
    assert ps["step_time_s"] == pytest.approx(5.0 / 100)
    assert ps["bytes_per_step_per_worker"] == pytest.approx(4000 / 200)
    failed_rank = cluster.row_from_summary(summary(5.0, [10, None], [1, 0], 0.1, 1.0))
    assert failed_rank["steps_per_rank"] == [10, 0]

    rows = [
        {"strategy": "sync_easgd", "compression": "none", "status": "ok", **ps},
        {"strategy": "ddp", "compression": "none", "status": "ok", **base},
        {"strategy": "ddp", "compression": "dgc", "status": "failed (rc=[1])"},
    ]
    cluster.build_table(rows)
    assert all(v == pytest.approx(1.0) for v in rows[1]["ratio"].values())
    assert rows[0]["ratio"]["step_time_s"] == pytest.approx(0.5)
    assert rows[0]["ratio"]["bytes_per_step_per_worker"] == pytest.approx(0.5)
    assert rows[0]["ratio"]["final_loss"] == pytest.approx(2.0)
    assert all(v is None for v in rows[2]["ratio"].values())
    md = cluster.render_markdown(
        rows,
        {
            "workers": 2,
            "link": {"rate_mbit": 1000.0, "latency_ms": 0.1, "latency_emulated": False},
            "workload": [],
            "extra": [],
            "steps": 100,
            "warmup_steps": 0,
            "machine": {"cpus": 2, "platform": "linux"},
            "date": "today",
            "command": "bench/cluster.py",
        },
    )
    assert "NOT emulated" in md and md.count("\n| ") == 4  # header + 3 rows


def test_steady_figures_subtract_the_short_run() -> None:
    def summary(wall: float, steps: list, sent: list, comm_time: list, loss: float) -> dict:
        return {
            "steps_per_rank": steps,
            "wall_time_s": wall,
            "samples_per_s": sum(steps) * 32 / wall,
            "train_loss": loss,
            "comm": {"bytes_sent": sent, "time_s": comm_time, "time_fraction": 0.9},
        }

    # A first step that costs 5 s and 1000 dense bytes, then 1 s and 10 bytes per step.
    short = summary(5.0 + 1.0, [2, 2], [1010, 1010], [4.0, 4.0], 2.0)
    long = summary(5.0 + 19.0, [20, 20], [1000 + 19 * 10] * 2, [4.0 + 9.0, 4.0 + 9.0], 1.5)
    got = cluster.steady_figures(long, short)
    assert got["step_time_s"] == pytest.approx(1.0)
    assert got["bytes_per_step_per_worker"] == pytest.approx(10.0)
    assert got["samples_per_s"] == pytest.approx(2 * 32 * 18 / 18.0)
    assert got["comm_share"] == pytest.approx(0.5)
    assert got["final_loss"] == 1.5
    whole = cluster.row_from_summary(long)
    assert whole["step_time_s"] == pytest.approx(24.0 / 20)  # what the first step distorts
    # No positive difference: no steady figures (the caller keeps the whole run).
    assert cluster.steady_figures(short, short) is None
    assert cluster.steady_figures(long, summary(1.0, [2, 2, 2], [0] * 3, [0.0] * 3, 1)) is None


def test_tbf_params_scale_with_rate() -> None:
    slow, fast = cluster.tbf_params(1.0), cluster.tbf_params(1000.0)
    assert slow["rate_kbit"] == 1000 and fast["rate_kbit"] == 1_000_000
    assert slow["burst_bytes"] >= 2 * 1500  # at least two full frames
    assert fast["burst_bytes"] == 250_000  # 2 ms at 125 MB/s
    assert slow["limit_bytes"] >= 2 * 1024 * 1024  # above tcp_limit_output_bytes
    with pytest.raises(ValueError, match="--rate-mbit"):
        cluster.LinkSpec(0.0, 0.1)
    with pytest.raises(ValueError, match="--latency-ms"):
        cluster.LinkSpec(10.0, -1.0)
