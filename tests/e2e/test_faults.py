"""Fault injection through the real CLI (real processes, gloo): a worker that crashes, is
killed (SIGKILL), frozen (SIGSTOP) or terminated (SIGTERM), and SIGTERM / SIGINT to the
launcher, for one strategy of each family. Every case checks: the run ends (bounded by a
subprocess timeout), its exit status, ``summary.json`` (status failed, naming the rank
that failed first and how), an intact loadable ``last.ckpt``, and that no process of the
run is left (by PID, from ``ranks/launch.json``). The launchers are forked from the test
session's CLI server (tests/helpers.py, as ``run_cli``'s runs: the same ``main()`` without a
fresh interpreter's seconds of imports), except in the spawn-path case, where every process
of the run is a fresh interpreter.

Run this file by hand to print the fault table: ``python tests/e2e/test_faults.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import PY, REPO, base_env, free_port, pid_alive, run_cli, start_cli

#: small and quick: digits, the default MLP, one thread per rank
COMMON = ["logger=csv", "trainer.enable_progress_bar=false", "data.num_workers=0"]


class Run:
    """``easgd-train`` started in the background, with handles on its processes: forked from
    the session's CLI server (tests/helpers.py ``start_cli``: the same ``main()``, argv,
    environment and working directory, its own session, a fresh interpreter's signal
    handlers, the launcher's exit status), or with ``fresh=True`` a fresh
    ``python -m easgd_lightning.cli.train``."""

    def __init__(self, run_dir: Path, overrides: list[str], fresh: bool = False) -> None:
        self.run_dir = run_dir
        self.log = run_dir.parent / f"{run_dir.name}.log"
        args = [f"hydra.run.dir={run_dir}", *COMMON, *overrides]
        self.started = time.monotonic()
        self._log_file = None
        if fresh:
            self._log_file = open(self.log, "w")  # noqa: SIM115 - closed in wait()
            self.proc = subprocess.Popen([PY, "-m", "easgd_lightning.cli.train", *args], env=base_env(),
                                         cwd=REPO, stdout=self._log_file, stderr=subprocess.STDOUT)
        else:  # the fork server opens the log for the process's stdout and stderr itself
            self.proc = start_cli(args, base_env(), self.log)

    def wait_for(self, path: str, timeout: float = 120) -> dict | None:
        """Wait until ``run_dir/path`` exists (JSON files are returned parsed)."""
        deadline = time.monotonic() + timeout
        target = self.run_dir / path
        while time.monotonic() < deadline:
            if target.exists():
                if target.suffix == ".json":
                    try:
                        return json.loads(target.read_text())
                    except ValueError:  # being replaced right now: read again
                        pass
                else:
                    return None
            assert self.proc.poll() is None, f"the run ended before {path} appeared:\n{self.output()}"
            time.sleep(0.1)
        raise AssertionError(f"{path} did not appear within {timeout}s:\n{self.output()}")

    @property
    def worker_pids(self) -> list[int]:
        return self.wait_for("ranks/launch.json")["worker_pids"]

    def wait(self, timeout: float) -> tuple[int, float]:
        """(exit status, seconds since the fault) once the launcher ended; kills all on timeout."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"the run did not end within {timeout}s:\n{self.output()}") from None
        finally:
            if self._log_file is not None:
                self._log_file.close()
        return code, time.monotonic() - self.fault_at

    def mark_fault(self) -> None:
        self.fault_at = time.monotonic()

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *self._known_pids()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _known_pids(self) -> list[int]:
        """The ranks and, when they were forked, the fork server (cli/forkserver.py)."""
        try:
            launch = json.loads((self.run_dir / "ranks" / "launch.json").read_text())
        except (OSError, ValueError):
            return []
        return [*launch["worker_pids"], *([launch["fork_server_pid"]] if launch.get("fork_server_pid") else [])]

    def assert_ranks_started_as_promised(self, start_method: str) -> None:
        """Each rank in its own session; forked ones are children of the fork server."""
        launch = self.wait_for("ranks/launch.json")
        assert launch["start_method"] == start_method
        for pid in launch["worker_pids"]:
            assert os.getsid(pid) == pid
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])  # state, ppid, pgrp
            assert ppid == (launch["fork_server_pid"] if start_method == "fork" else self.proc.pid)

    def leftovers(self) -> list[int]:
        """PIDs of this run (launcher, ranks, fork server) still alive shortly after the launcher ended."""
        pids = [self.proc.pid, *self._known_pids()]
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
            time.sleep(0.1)
        return [p for p in pids if pid_alive(p)]

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def output(self) -> str:
        if self._log_file is not None:
            self._log_file.flush()
        return self.log.read_text(errors="replace")[-6000:] if self.log.exists() else ""


def assert_loadable_last_checkpoint(run_dir: Path) -> dict:
    """``last.ckpt`` loads, holds finite weights, and is not older than any epoch file."""
    ckpt_dir = run_dir / "checkpoints"
    last = ckpt_dir / "last.ckpt"
    assert last.is_file(), sorted(p.name for p in ckpt_dir.iterdir()) if ckpt_dir.exists() else "no checkpoints"
    state = torch.load(last, map_location="cpu", weights_only=False)
    weights = state["state_dict"]
    assert weights and all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())
    for epoch_file in ckpt_dir.glob("epoch*.ckpt"):
        other = torch.load(epoch_file, map_location="cpu", weights_only=False)
        assert (state["epoch"], state["global_step"]) >= (other["epoch"], other["global_step"]), epoch_file
    assert not list(ckpt_dir.glob(".*.tmp"))
    return state


# ---------------------------------------------------------------------------- the cases
TIMEOUT_S = 20  # timeout_s of the runs: collectives and stragglers
#: timeout_s of the cases that wait out one whole timeout_s after the fault (a frozen rank is
#: killed after it; a torchrun-style survivor waits that long for the dead rank's report): short,
#: so these tests do not sit idle, and still far above what one collective of these small runs
#: takes or how far apart two ranks forked at the same moment start (every collective would
#: fail at it otherwise, before the fault)
SHORT_TIMEOUT_S = 6
MARGIN_S = 60  # what a bounded exit may add on a loaded 2-core machine (process exits, teardown)


_RUNS: list[Run] = []  # every run a test started; a failed check must not leave it running


@pytest.fixture(autouse=True)
def _end_every_run():
    """After each test, SIGKILL whatever of its runs is still alive (a check that failed
    before the run ended would otherwise leave a 400-epoch run on the machine)."""
    yield
    while _RUNS:
        run = _RUNS.pop()
        if run.proc.poll() is None:
            run.kill_all()


def _start(tmp_path: Path, name: str, overrides: list[str], timeout_s: float = TIMEOUT_S,
           fresh: bool = False) -> Run:
    run_dir = tmp_path / name
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    run = Run(run_dir, [f"timeout_s={timeout_s}", *overrides], fresh=fresh)
    _RUNS.append(run)
    return run


def _ended_clean(run: Run, code: int, took: float, s: dict) -> dict:
    """After a failed rank's checks: the last checkpoint loads and no process of the run
    is left. Returns the case's record."""
    assert_loadable_last_checkpoint(run.run_dir)
    left = run.leftovers()
    assert left == []
    return {"code": code, "took": took, "summary": s, "leftovers": left}


def case_worker_crash(tmp_path: Path, strategy: str, devices: int) -> dict:
    """faults.crash_rank: rank 1 calls os._exit(17) at its 30th step."""
    run = _start(tmp_path, f"crash-{strategy}", [f"strategy={strategy}", f"trainer.devices={devices}",
                                                  "trainer.max_epochs=20", "faults.crash_rank=1",
                                                  "faults.crash_at_step=30"])
    run.worker_pids  # noqa: B018 - wait for the launch
    run.mark_fault()
    code, took = run.wait(TIMEOUT_S + MARGIN_S + 60)
    s = run.summary()
    assert code == 1, run.output()
    assert s["status"] == "failed" and s["first_failure"]["rank"] == 1, s["error"]
    assert s["first_failure"]["exitcode"] == 17 and s["exit_codes"][1] == 17, s["first_failure"]
    assert "rank 1" in s["error"]
    return _ended_clean(run, code, took, s)


def case_worker_signal(tmp_path: Path, strategy: str, devices: int, sig: signal.Signals,
                       start_method: str = "fork") -> dict:
    """SIGKILL / SIGSTOP / SIGTERM to rank 1 once the first epoch checkpoint exists (the ranks
    forked by the launcher's fork server, or spawned: then the launcher too is a fresh
    interpreter, so that one case runs every process of the run as the command does).
    SIGSTOP: the run's timeout_s is SHORT_TIMEOUT_S (the launcher kills the frozen rank after it)."""
    timeout_s = SHORT_TIMEOUT_S if sig == signal.SIGSTOP else TIMEOUT_S
    run = _start(tmp_path, f"{sig.name.lower()}-{strategy}", [f"strategy={strategy}", f"trainer.devices={devices}",
                                                              "trainer.max_epochs=400",
                                                              f"launcher.start_method={start_method}"], timeout_s,
                 fresh=start_method == "spawn")
    pids = run.worker_pids
    run.wait_for("checkpoints/epoch000.ckpt")
    run.assert_ranks_started_as_promised(start_method)
    os.kill(pids[1], sig)
    run.mark_fault()
    code, took = run.wait(timeout_s + MARGIN_S + (timeout_s if sig == signal.SIGSTOP else 0))
    s = run.summary()
    assert code == 1, run.output()
    first = s["first_failure"]
    assert s["status"] == "failed" and first["rank"] == 1, s["error"]
    if sig == signal.SIGSTOP:
        assert first["state"] == "stopped" and "rank 1 stopped answering" in s["error"], s["error"]
        assert f"process stopped for {timeout_s:g}s" in first["error"], first  # the launcher's verdict
        assert timeout_s <= took < timeout_s + MARGIN_S  # bounded: timeout_s plus the time processes take to end
    elif sig == signal.SIGKILL:
        assert first["signal"] == "SIGKILL", first
    else:  # SIGTERM: the rank stops gracefully and says so, exit 128 + 15
        assert first["exitcode"] == 143 and s["exit_codes"][1] == 143, first
        assert "interrupted by SIGTERM" in first["error"]
    return _ended_clean(run, code, took, s)


def case_launcher_signal(tmp_path: Path, strategy: str, devices: int, sig: signal.Signals,
                         check_second_run: bool = False) -> dict:
    """SIGINT / SIGTERM to the launcher: workers stop, last.ckpt and summary written, 128 + N."""
    run = _start(tmp_path, f"launcher-{sig.name.lower()}-{strategy}",
                 [f"strategy={strategy}", f"trainer.devices={devices}", "trainer.max_epochs=400"])
    run.worker_pids  # noqa: B018
    run.wait_for("checkpoints/epoch000.ckpt")
    if check_second_run:  # a second run pointed at the directory of this live one is refused
        second = run_cli([f"hydra.run.dir={run.run_dir}", *COMMON], check=False, timeout=120)  # forked (helpers)
        assert second.returncode == 2, second.stderr[-3000:]
        assert "is in use by another live run" in second.stderr and f"pid {run.proc.pid}" in second.stderr
        assert not (run.run_dir / "summary.json").exists()  # it wrote nothing there
    run.proc.send_signal(sig)
    run.mark_fault()
    code, took = run.wait(TIMEOUT_S + MARGIN_S)
    s = run.summary()
    assert code == 128 + sig.value, run.output()
    assert s["status"] == "failed" and s["error"] == f"interrupted by {sig.name}", s["error"]
    assert s["interrupted_by"] == sig.name
    state = assert_loadable_last_checkpoint(run.run_dir)
    assert state["epoch"] >= 1 or state["global_step"] > 0
    left = run.leftovers()
    assert left == []
    # the workers did not train on: far fewer steps than 400 epochs
    assert state["epoch"] < 400
    return {"code": code, "took": took, "summary": s, "leftovers": left}


def case_failed_sweep_job(tmp_path: Path) -> dict:
    """A sweep whose second job crashes (the first stops at step 2, before the crash at step 3):
    both jobs run, the sweep exits 1 naming the failed one."""
    sweep = tmp_path / "sweep"
    started = time.monotonic()
    proc = run_cli(  # forked from the session's CLI server, as the multirun of test_cli_foundation
        ["-m", f"hydra.sweep.dir={sweep}", *COMMON, "trainer.max_epochs=1", "checkpoint.enabled=false",
         "faults.crash_rank=1", "faults.crash_at_step=3", "trainer.limit_train_batches=2,null"],  # job 0: 2 steps
        check=False, timeout=600,
    )
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and (p / "summary.json").exists())
    statuses = [json.loads((j / "summary.json").read_text())["status"] for j in jobs]
    assert statuses == ["ok", "failed"], statuses  # the failure did not stop the other job
    line = [ln for ln in proc.stderr.splitlines() if "sweep jobs failed" in ln]
    assert line and line[0].startswith("easgd-train: 1 of 2 sweep jobs failed: 1_") and "rank 1" in line[0], line
    return {"code": proc.returncode, "took": took, "summary": json.loads((jobs[1] / "summary.json").read_text())}


# One fault per test, one strategy of each family across them: (fault, strategy).
@pytest.mark.slow
def test_frozen_worker_ends_the_run_within_timeout_naming_it_ddp(tmp_path: Path) -> None:
    case_worker_signal(tmp_path, "ddp", 2, signal.SIGSTOP)


@pytest.mark.slow
def test_crashed_worker_is_named_with_its_exit_code_sync_easgd(tmp_path: Path) -> None:
    case_worker_crash(tmp_path, "sync_easgd", 2)


@pytest.mark.slow
def test_killed_worker_is_named_with_its_signal_local_sgd(tmp_path: Path) -> None:
    case_worker_signal(tmp_path, "local_sgd", 2, signal.SIGKILL)


@pytest.mark.slow
def test_sigterm_to_a_worker_stops_every_rank_and_exits_nonzero_ddp(tmp_path: Path) -> None:
    case_worker_signal(tmp_path, "ddp", 2, signal.SIGTERM, start_method="spawn")  # the spawn path's fault case


@pytest.mark.slow
def test_sigint_to_the_launcher_sync_easgd(tmp_path: Path) -> None:
    case_launcher_signal(tmp_path, "sync_easgd", 2, signal.SIGINT, check_second_run=True)


@pytest.mark.slow
def test_sigterm_to_the_launcher_async_easgd(tmp_path: Path) -> None:
    case_launcher_signal(tmp_path, "async_easgd", 3, signal.SIGTERM)


@pytest.mark.slow
def test_a_sweep_with_a_failed_job_exits_1_naming_it(tmp_path: Path) -> None:
    case_failed_sweep_job(tmp_path)


# ---------------------------------------------------------------------------- torchrun-style
def _start_external_ranks(run_dir: Path, world: int, overrides: list[str]) -> list:
    """``easgd-train`` once per rank with torchrun's environment (RANK, WORLD_SIZE, MASTER_*):
    each process is one rank (cli/train.py ``_train_as_rank``), no local launcher."""
    port = free_port()
    run_dir.mkdir(parents=True)
    return [  # forked from the session's CLI server (tests/helpers.py), as run_cli's runs
        start_cli([f"hydra.run.dir={run_dir}", *COMMON, *overrides],
                  base_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), NODE_RANK="0",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                  run_dir / f"rank{r}.log")
        for r in range(world)
    ]


def case_external_crash(tmp_path: Path, crash_rank: int) -> dict:
    """Two ranks started torchrun-style; ``crash_rank`` calls os._exit(17) at its 3rd step (the
    survivor waits timeout_s, SHORT_TIMEOUT_S here, for the dead rank's report)."""
    run_dir = tmp_path / f"external-rank{crash_rank}-dies"
    procs = _start_external_ranks(run_dir, 2, [
        "strategy=ddp", "trainer.devices=2", "trainer.max_epochs=3", f"timeout_s={SHORT_TIMEOUT_S}",
        "checkpoint.enabled=false", f"faults.crash_rank={crash_rank}", "faults.crash_at_step=3"])
    deadline = time.monotonic() + SHORT_TIMEOUT_S + MARGIN_S + 60
    crashed_at = None
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if crashed_at is None and procs[crash_rank].poll() is not None:
            crashed_at = time.monotonic()
        time.sleep(0.05)
    if any(p.poll() is None for p in procs):
        for q in procs:
            q.kill()
        raise AssertionError("the ranks did not end")
    took = time.monotonic() - (crashed_at or time.monotonic())  # from the crash to the last exit
    codes = [p.returncode for p in procs]
    survivor = 1 - crash_rank
    logs = {r: (run_dir / f"rank{r}.log").read_text()[-3000:] for r in range(2)}
    assert codes[crash_rank] == 17 and codes[survivor] != 0, (codes, logs)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "failed", s
    assert s["first_failure"]["rank"] == crash_rank and s["first_failure"]["state"] == "lost", s["first_failure"]
    assert s["error"].startswith(f"rank {crash_rank} failed first: it ended without a report"), s["error"]
    assert str(crash_rank) not in s["rank_errors"]  # no report from the dead rank
    mine = json.loads((run_dir / "ranks" / f"rank{survivor}.json").read_text())
    assert mine["status"] == "failed" and mine["peer_error"], mine
    left = [p.pid for p in procs if pid_alive(p.pid)]
    assert left == []
    return {"code": codes[survivor], "took": took, "summary": {**s, "exit_codes": codes}, "leftovers": left}


@pytest.mark.slow
@pytest.mark.parametrize("crash_rank", [1, 0], ids=["rank1-dies", "rank0-dies"])
def test_external_launch_names_the_first_failure(tmp_path: Path, crash_rank: int) -> None:
    """Under torchrun / SLURM the ranks themselves write the summary: a rank that dies
    without a word (os._exit) is named first failure, by rank 0 or, when rank 0 is the one
    that died, by the surviving rank; the survivor's own error is a lost peer."""
    case_external_crash(tmp_path, crash_rank)


if __name__ == "__main__":  # the fault table (a case whose checks fail prints FAIL and why)
    import tempfile
    import traceback

    which = sys.argv[1:] or ["all"]
    print("| fault | strategy | time to exit | exit status | summary status | rank exit codes | leftover PIDs "
          "| first_failure | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        cases = {  # name: (fault, strategy, run)
            "sigstop-ddp": ("SIGSTOP of rank 1", "ddp", lambda: case_worker_signal(Path(tmp), "ddp", 2, signal.SIGSTOP)),
            "crash-sync_easgd": ("crash of rank 1 (os._exit(17))", "sync_easgd",
                                 lambda: case_worker_crash(Path(tmp), "sync_easgd", 2)),
            "sigkill-local_sgd": ("SIGKILL of rank 1", "local_sgd",
                                  lambda: case_worker_signal(Path(tmp), "local_sgd", 2, signal.SIGKILL)),
            "sigterm-worker-ddp": ("SIGTERM of rank 1 (ranks spawned)", "ddp",
                                   lambda: case_worker_signal(Path(tmp), "ddp", 2, signal.SIGTERM, "spawn")),
            "launcher-sigint-sync_easgd": ("SIGINT of the launcher", "sync_easgd",
                                           lambda: case_launcher_signal(Path(tmp), "sync_easgd", 2, signal.SIGINT,
                                                                        check_second_run=True)),
            "launcher-sigterm-async_easgd": ("SIGTERM of the launcher", "async_easgd (3 processes)",
                                             lambda: case_launcher_signal(Path(tmp), "async_easgd", 3, signal.SIGTERM)),
            "sweep-job-crash": ("crash in 1 of 2 sweep jobs", "ddp", lambda: case_failed_sweep_job(Path(tmp))),
            "external-rank1-dies": ("torchrun-style: rank 1 os._exit(17) (exit status: the survivor's)", "ddp",
                                    lambda: case_external_crash(Path(tmp), 1)),
            "external-rank0-dies": ("torchrun-style: rank 0 os._exit(17) (exit status: the survivor's)", "ddp",
                                    lambda: case_external_crash(Path(tmp), 0)),
        }
        for name, (fault, strategy, fn) in cases.items():
            if "all" not in which and name not in which:
                continue
            try:
                r = fn()
            except BaseException as err:  # noqa: BLE001 - the table goes on
                traceback.print_exc(file=sys.stderr)
                print(f"| {fault} | {strategy} | FAIL | | | | | | {type(err).__name__}: "
                      f"{str(err).splitlines()[0][:200] if str(err) else ''} |", flush=True)
                continue
            s = r["summary"]
            print(f"| {fault} | {strategy} | {r['took']:.1f} s | {r['code']} | {s.get('status')} | "
                  f"{s.get('exit_codes')} | {r.get('leftovers', 'n/a')} | {s.get('first_failure')} | "
                  f"{s['error']} |", flush=True)
