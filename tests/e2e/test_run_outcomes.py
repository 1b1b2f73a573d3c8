"""What a run says about itself (issue 31 items 2 and 4), through the real ``easgd-train``:

* a run refused because its directory is held by a live run writes nothing there (Hydra's
  ``.hydra/`` included: the lock is checked before Hydra runs);
* a resume that would train nothing is refused in one line before launch;
* SIGINT: the log says it was an interrupt (not that a worker failed), and the summary keeps
  what the finished epochs measured (``steps_per_rank``, ``val_acc``, ``val_history``);
* a resume from the mid-epoch checkpoint that SIGINT wrote says in one log line, and in
  ``summary.json`` ``resume``, that it is inexact and why;
* a loss that explodes (``optim.lr=1e6``) ends the run ``status: diverged`` naming the step.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.test_faults import COMMON, Run
from tests.helpers import one_error_line, run_cli

pytestmark = pytest.mark.slow

STEPS_PER_EPOCH = 23  # digits: 1437 training samples / (2 ranks x batch 32), rounded up


def _newest_epoch_ckpt(run_dir: Path) -> Path | None:
    ckpts = sorted((run_dir / "checkpoints").glob("epoch*.ckpt"))
    return ckpts[-1] if ckpts else None


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict:
    """One live run (2 ranks, 2.3 s epochs) and what is tried against it, each observation
    recorded for the tests below (none asserted here, so each test fails on its own):

    * once two epochs finished: a second run into its directory (seed 2, 3 epochs), and a
      resume of its 2-epoch checkpoint with ``trainer.max_epochs=1``;
    * 0.8 s into a later epoch: SIGINT to the launcher; then a resume of the ``last.ckpt``
      that SIGINT wrote, one epoch beyond it.
    """
    tmp_path = tmp_path_factory.mktemp("interrupted")
    run_dir = tmp_path / "D"
    seen: dict = {"run_dir": run_dir, "tmp": tmp_path}
    live = Run(run_dir, ["seed=1", "trainer.max_epochs=400", "faults.slow_rank=0", "faults.slow_ms=100",
                         "timeout_s=60"])
    try:
        live.worker_pids  # noqa: B018 - the live run holds the directory
        live.wait_for("checkpoints/epoch001.ckpt")  # two epochs finished
        seen["hydra_before"] = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
        seen["logs_before"] = {p.name: p.read_bytes() for p in run_dir.glob("*.log")}
        seen["second"] = run_cli([f"hydra.run.dir={run_dir}", *COMMON, "seed=2", "trainer.max_epochs=3"],
                                 check=False, timeout=120)
        seen["hydra_after"] = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
        seen["logs_after"] = {p.name: (run_dir / p.name).read_bytes() for p in run_dir.glob("*.log")}
        seen["two"] = two = run_dir / "checkpoints" / "epoch001.ckpt"
        seen["nothing"] = run_cli([f"hydra.run.dir={tmp_path / 'nothing'}", *COMMON, f"checkpoint.resume={two}",
                                   "trainer.max_epochs=1"], check=False, timeout=120)
        newest = _newest_epoch_ckpt(run_dir)  # SIGINT in the middle of an epoch (0.8 s into one of 2.3 s)
        deadline = time.monotonic() + 60
        while _newest_epoch_ckpt(run_dir) == newest and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.8)
        live.proc.send_signal(signal.SIGINT)
        live.mark_fault()
        seen["code"], _ = live.wait(90)
    finally:
        if live.proc.poll() is None:
            live.kill_all()
    seen["output"] = live.log.read_text(errors="replace")
    seen["summary"] = json.loads((run_dir / "summary.json").read_text())
    last = run_dir / "checkpoints" / "last.ckpt"
    seen["last_state"] = torch.load(last, map_location="cpu", weights_only=False)
    epochs = len(seen["summary"]["val_history"]) or seen["last_state"]["epoch"]
    seen["resumed_dir"] = tmp_path / "resumed"
    seen["resumed"] = run_cli([f"hydra.run.dir={seen['resumed_dir']}", *COMMON, f"checkpoint.resume={last}",
                               f"trainer.max_epochs={epochs + 1}"], check=False, timeout=240)
    return seen


def test_a_refused_run_writes_nothing_into_the_live_runs_directory(interrupted: dict) -> None:
    """Item 2: Hydra used to replace .hydra/config.yaml and overrides.yaml (seed 2) first."""
    second = interrupted["second"]
    assert second.returncode == 2, second.stderr[-3000:]
    assert "is in use by another live run" in one_error_line(second.stderr)
    assert interrupted["hydra_after"] == interrupted["hydra_before"]
    assert b"seed: 1" in interrupted["hydra_after"]["config.yaml"]
    for name, before in interrupted["logs_before"].items():  # the live run's log grew by its own lines only
        after = interrupted["logs_after"][name]
        assert after.startswith(before) and b"in use by another live run" not in after


def test_a_resume_that_would_train_nothing_is_refused_in_one_line(interrupted: dict) -> None:
    nothing, two = interrupted["nothing"], interrupted["two"]
    assert nothing.returncode == 2, nothing.stderr[-3000:]
    assert one_error_line(nothing.stderr) == (
        f"easgd-train: error: checkpoint.resume: {two} has finished 2 epochs and trainer.max_epochs=1: "
        "nothing would be trained; set trainer.max_epochs above 2")
    assert not (interrupted["tmp"] / "nothing" / "ranks").exists()


def test_after_sigint_the_log_says_interrupt(interrupted: dict, tmp_path: Path) -> None:
    """The ranks stop seconds apart (async_easgd: worker 1 sleeps 20 s before each step, so
    it notices the stop long after worker 0): the launcher used to log "a worker failed;
    the others get up to 300s" for the first rank that stopped."""
    output = interrupted["output"]
    assert interrupted["code"] == 130, output[-3000:]
    assert "received SIGINT: stopping the workers" in output and "a worker failed" not in output
    run = Run(tmp_path / "async", ["strategy=async_easgd", "trainer.devices=3", "trainer.max_epochs=400",
                                   "faults.slow_rank=1", "faults.slow_ms=20000", "timeout_s=60"])
    try:
        run.wait_for("checkpoints/epoch000.ckpt")  # worker 0 trains on while worker 1 sleeps
        run.proc.send_signal(signal.SIGINT)
        run.mark_fault()
        code, took = run.wait(90)
    finally:
        if run.proc.poll() is None:
            run.kill_all()
    output = run.log.read_text(errors="replace")
    assert code == 130, output[-3000:]
    assert "received SIGINT: stopping the workers" in output
    assert "a worker failed" not in output  # it was an interrupt, and the log says so once
    assert json.loads((run.run_dir / "summary.json").read_text())["error"] == "interrupted by SIGINT"


def test_an_interrupted_summary_keeps_the_finished_epochs(interrupted: dict) -> None:
    summary = interrupted["summary"]
    assert summary["status"] == "failed" and summary["error"] == "interrupted by SIGINT"
    history = summary["val_history"]
    assert len(history) >= 3, summary
    assert summary["val_acc"] == history[-1]["val_acc"] and summary["val_acc"] is not None
    finished = history[-1]["step"]
    assert finished == len(history) * STEPS_PER_EPOCH, history
    assert summary["steps_per_rank"] == [finished, finished]  # whole epochs, not the interrupted one


def test_a_mid_epoch_resume_says_once_that_it_is_inexact_and_why(interrupted: dict) -> None:
    state = interrupted["last_state"]
    assert not state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"], "not mid-epoch"
    resumed = interrupted["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = [ln for ln in (resumed.stdout + resumed.stderr).splitlines() if "the resume is inexact" in ln]
    assert len(said) == 1 and f"in the middle of epoch {state['epoch']}" in said[0], said
    resume = json.loads((interrupted["resumed_dir"] / "summary.json").read_text())["resume"]
    assert resume["exact"] is False and resume["mid_epoch"] is True and resume["epochs_done"] == state["epoch"]
    assert "no resumable position" in resume["inexact_because"]


def test_exploding_loss_ends_the_run_diverged_naming_the_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "lr"
    proc = run_cli([f"hydra.run.dir={run_dir}", *COMMON, "optim.lr=1e6", "trainer.max_epochs=2",
                    "checkpoint.enabled=false", "timeout_s=60"], check=False, timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged", summary["error"]
    assert summary["error"].startswith("diverged at step "), summary["error"]
    step = int(summary["error"].split()[3])
    assert 2 <= step <= 5  # the second step's loss is already far above 1e4 x the first's
    assert "exploded: above loss_explosion_factor=10000 x max(|first loss" in summary["error"]
    assert f"easgd-train: run diverged: diverged at step {step}" in proc.stderr
