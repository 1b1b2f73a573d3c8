"""The launcher's pure parts: which failure came first, return codes, the run-directory
lock, run ids in rank reports, sweep failures, and atomic writes cleaning up."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from easgd_lightning.cli import launch
from tests.helpers import REPO, base_env


def test_first_failure_is_the_earliest_cause() -> None:
    crash = {"rank": 1, "t_s": 10.0, "exitcode": 17, "consequence": False}
    peer = {"rank": 0, "t_s": 10.4, "exitcode": 1, "consequence": True}
    assert launch.first_failure([peer, crash]) == crash
    # seen first, but a consequence of a lost peer: within the tie window the cause wins
    peer_first = {"rank": 0, "t_s": 9.9, "exitcode": 1, "consequence": True}
    assert launch.first_failure([peer_first, crash]) == crash
    # outside the window the order of events decides
    early_peer = {"rank": 0, "t_s": 1.0, "exitcode": 1, "consequence": True}
    assert launch.first_failure([crash, early_peer]) == early_peer
    # a frozen rank is dated from when it was first seen stopped
    stopped = {"rank": 2, "t_s": 3.0, "state": "stopped", "consequence": False}
    timed_out = {"rank": 0, "t_s": 33.0, "exitcode": 1, "consequence": True}
    assert launch.first_failure([timed_out, stopped]) == stopped
    assert launch.first_failure([]) is None


def test_ranks_declared_lost_do_not_fail_the_run_and_say_why() -> None:
    """A rank the run declared lost (the parameter server dropped it) is left out of the
    first failure and of the failed ranks; ``ft.lost_ranks`` says why from what the launcher
    saw: a signal from outside, a non-zero exit, frozen and killed, running and killed."""
    out = launch.LaunchOutcome(exit_codes=[-9, 17, -9, -9, 0, 1], started=100.0)
    out.failures = [
        {"rank": 0, "t_s": 1.0, "signal": "SIGKILL", "consequence": False},
        {"rank": 1, "t_s": 2.0, "exitcode": 17, "consequence": False},
        {"rank": 2, "t_s": 3.0, "state": "stopped", "consequence": False},
        {"rank": 3, "t_s": 4.0, "state": "lost", "consequence": False},
        {"rank": 5, "t_s": 5.0, "exitcode": 1, "consequence": False},
    ]
    out.killed_ranks = [2, 3]
    declared = {"cause": "connection lost", "updates": 7, "worker_step": 3}
    out.lost = {r: {**declared, "at": 101.5 + r} for r in (0, 1, 2, 3)}
    assert out.failed_ranks == [5] and out.first_failure["rank"] == 5
    records = launch.lost_rank_records(out)
    assert [(r["rank"], r["why"]) for r in records] == [(0, "killed"), (1, "crashed"), (2, "stopped"),
                                                          (3, "unresponsive")]
    assert records[0] == {"rank": 0, "why": "killed", "t_s": 1.5, "exit": {"signal": "SIGKILL"},
                          "detected": "connection lost", "updates": 7, "worker_step": 3}
    assert records[1]["exit"] == {"exitcode": 17}
    out.exit_codes[5] = 143  # stopped on SIGTERM, sent to it alone (a preempted worker)
    out.lost[5] = {**declared, "at": 110.0}
    assert out.failed_ranks == [] and out.first_failure is None
    assert launch.lost_rank_records(out)[-1]["why"] == "terminated"


def test_the_summary_excuses_only_lost_ranks() -> None:
    from easgd_lightning.cli.summary import build_summary

    ok = {"status": "ok", "role": "worker", "steps": 3, "wall_time_s": 1.0, "comm": {"time_s": 0.1}}
    reports = [dict(ok), None, dict(ok, role="server")]
    lost = build_summary({}, reports, lost=[1])
    assert lost["status"] == "ok" and lost["roles"] == ["worker", "lost", "server"] and lost["failed_ranks"] == [1]
    failed = build_summary({}, reports)
    assert failed["status"] == "failed" and failed["roles"][1] == "failed"


def test_first_failure_from_rank_reports_under_an_external_launcher() -> None:
    """torchrun / SLURM: only the ranks' own reports (failed_at is wall-clock time)."""
    ok = {"status": "ok"}
    own = {"status": "failed", "error": "ValueError: bad batch", "signal": None, "peer_error": False,
           "failed_at": 1010.0}
    peer = {"status": "failed", "error": "DistBackendError: connection closed", "signal": None,
            "peer_error": True, "failed_at": 1009.5}
    stopped = {"status": "failed", "error": "interrupted by SIGTERM", "signal": "SIGTERM", "peer_error": False,
               "failed_at": 1011.0}
    of = launch.first_failure_of_reports
    assert of([ok, ok], 1000.0) is None
    # a rank's own error beats a lost peer seen just before it, and a missing report
    assert of([peer, own, None], 1000.0) == {"rank": 1, "t_s": 10.0, "exitcode": 1,
                                             "error": "ValueError: bad batch", "consequence": False}
    # without one, the rank that left no report died first (signalled ranks were stopped after it)
    lost = of([stopped, None, peer], 1000.0)
    assert lost["rank"] == 1 and lost["state"] == "lost" and lost["t_s"] is None
    assert launch.failure_message(lost, None) == (
        "rank 1 failed first: it ended without a report (SIGKILL, os._exit, or a lost node)")
    # only signals and peer errors: the earliest (a SIGTERM to one rank, its peer stopping)
    assert of([ok, stopped, dict(peer, failed_at=1012.0)], 1000.0)["rank"] == 1
    assert of([ok, stopped], 1000.0)["exitcode"] == 143


#: what torch 2.14's gloo raised in a rank whose peer had died (a plain RuntimeError), and the
#: same error after a future's callback re-raised it (comm/ops.all_reduce_async)
GLOO_PEER_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by "
                    "peer [127.0.0.1]:60113. This is typically caused by a remote worker crashing.")
CALLBACK_WRAPPED = f"Got the following error when running the callback: RuntimeError: {GLOO_PEER_CLOSED}\n\nAt:\n"


def test_peer_loss_is_told_from_a_ranks_own_error() -> None:
    import torch.distributed as dist

    assert launch.is_peer_loss(RuntimeError(GLOO_PEER_CLOSED))
    assert launch.is_peer_loss(RuntimeError(CALLBACK_WRAPPED))
    assert launch.is_peer_loss(dist.DistNetworkError("anything"))  # torch.distributed's own errors
    try:  # raised while handling a lost peer: still a consequence
        try:
            raise RuntimeError(GLOO_PEER_CLOSED)
        except RuntimeError as inner:
            raise ValueError("while syncing metrics") from inner
    except ValueError as outer:
        assert launch.is_peer_loss(outer)
    assert not launch.is_peer_loss(ValueError("bad batch"))
    assert not launch.is_peer_loss(RuntimeError("CUDA out of memory"))
    assert not launch.is_peer_loss(None)


def test_returncodes_and_the_failure_line() -> None:
    assert launch.describe_returncode(0) == {"exitcode": 0}
    assert launch.describe_returncode(17) == {"exitcode": 17}
    assert launch.describe_returncode(-9) == {"signal": "SIGKILL"}
    assert launch.describe_returncode(-15) == {"signal": "SIGTERM"}
    line = launch.failure_message({"rank": 1, "t_s": 12.34, "signal": "SIGKILL"}, [1, -9])
    assert line == "rank 1 failed first: killed by SIGKILL at 12.3s; worker exit codes [1, -9]"
    line = launch.failure_message({"rank": 1, "t_s": 3.0, "state": "stopped", "error": "process stopped for 20s"},
                                  [1, -9])
    assert line == "rank 1 stopped answering (process stopped at 3.0s, killed after timeout_s); worker exit codes [1, -9]"
    assert launch.stop_grace_s(300) == 30 and launch.stop_grace_s(5) == 5


_HOLD = """
import sys, time
from pathlib import Path
from easgd_lightning.cli import launch
launch.claim_run_dir(Path(sys.argv[1]), "holder-run")
print("held", flush=True)
time.sleep(60)
"""


def test_a_live_run_owns_its_directory_and_a_dead_one_does_not(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], env=base_env(), cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert launch.held_by_another_run(tmp_path)
        with pytest.raises(launch.RunDirInUse, match=rf"pid {holder.pid} .*run id holder-run"):
            launch.claim_run_dir(tmp_path, "second-run")
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # killed without cleanup: the kernel dropped its lock, the directory is free again
    assert not launch.held_by_another_run(tmp_path)
    launch.claim_run_dir(tmp_path, "third-run")
    try:
        assert json.loads((tmp_path / "run.lock").read_text())["run_id"] == "third-run"
        assert not launch.held_by_another_run(tmp_path)  # held by this very process
    finally:
        launch.release_run_dir(tmp_path)
    assert not (tmp_path / "run.lock").exists()


def test_reports_of_another_run_are_ignored(tmp_path: Path) -> None:
    from easgd_lightning.cli.worker import rank_file, read_rank_reports

    rank_file(tmp_path, 0).parent.mkdir(parents=True)
    rank_file(tmp_path, 0).write_text(json.dumps({"rank": 0, "status": "ok", "run_id": "mine"}))
    rank_file(tmp_path, 1).write_text(json.dumps({"rank": 1, "status": "ok", "run_id": "other"}))
    assert [r and r["rank"] for r in read_rank_reports(tmp_path, 2, "mine")] == [0, None]
    assert [r["rank"] for r in read_rank_reports(tmp_path, 2)] == [0, 1]


def test_a_sweep_names_its_failed_jobs(tmp_path: Path) -> None:
    from easgd_lightning.cli.train import _failed_sweep_jobs

    jobs = []
    for i, (status, error) in enumerate([("ok", None), ("failed", "rank 1 failed first: exit code 17"), (None, None)]):
        job = tmp_path / f"{i}_job"
        job.mkdir()
        if status:
            (job / "summary.json").write_text(json.dumps({"status": status, "error": error}))
        jobs.append(job)
    assert _failed_sweep_jobs(jobs) == ["1_job: rank 1 failed first: exit code 17", "2_job: no summary.json"]


def test_an_atomic_write_leaves_no_temporary_file_when_it_fails(tmp_path: Path) -> None:
    from easgd_lightning.utils.atomic import _atomic_write

    def fail(fh) -> None:
        fh.write(b"partial")
        raise KeyboardInterrupt  # any exception, even one that is not an Exception

    with pytest.raises(KeyboardInterrupt):
        _atomic_write(tmp_path / "center.ckpt", fail)
    assert list(tmp_path.iterdir()) == []


def test_stray_temporary_files_are_removed(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    stray = tmp_path / "checkpoints" / ".center.ckpt.abc123.tmp"
    stray.write_bytes(b"x")
    keep = tmp_path / "checkpoints" / "center.ckpt"
    keep.write_bytes(b"y")
    assert launch.remove_stray_temp_files(tmp_path) == [stray]
    assert keep.exists() and not stray.exists()


def test_launcher_signals_are_recorded_not_raised() -> None:
    # what was installed before (default_int_handler; SIG_IGN when pytest itself runs as a
    # background job of a non-interactive shell, which starts it with SIGINT ignored)
    before = signal.getsignal(signal.SIGINT)
    with launch.LauncherSignals() as signals:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)
        time.sleep(0.01)
    assert signals.received == [signal.SIGINT, signal.SIGTERM] and signals.first == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before  # restored


def test_start_method_fork_for_cpu_spawn_for_gpu() -> None:
    from omegaconf import OmegaConf

    def cfg(method: str | None, accelerator: str, strategy: str = "ddp"):
        c = {"trainer": {"accelerator": accelerator}, "strategy": {"name": strategy}}
        if method is not None:
            c["launcher"] = {"start_method": method}
        return OmegaConf.create(c)

    assert launch.resolve_start_method(cfg("auto", "cpu")) == "fork"  # Linux
    assert launch.resolve_start_method(cfg(None, "cpu")) == "fork"  # a config from before the key
    assert launch.resolve_start_method(cfg("auto", "gpu")) == "spawn"  # CUDA cannot be forked
    assert launch.resolve_start_method(cfg("spawn", "cpu")) == "spawn"
    assert launch.resolve_start_method(cfg("fork", "cpu")) == "fork"
    with pytest.raises(ValueError, match=r"^launcher.start_method=fork cannot start GPU ranks"):
        launch.resolve_start_method(cfg("fork", "cuda"))
    with pytest.raises(ValueError, match=r"^launcher.start_method must be one of \['auto', 'fork', 'spawn'\], got 'thread'"):
        launch.resolve_start_method(cfg("thread", "cpu"))
    # the fork server imports DeepSpeed once for pipeline_3d, not once per rank
    assert "easgd_lightning.parallel.engine" in launch.preload_modules(cfg("auto", "cpu", "pipeline_3d"))
    assert "easgd_lightning.parallel.engine" not in launch.preload_modules(cfg("auto", "cpu"))
