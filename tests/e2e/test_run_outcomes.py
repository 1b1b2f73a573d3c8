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


def test_refused_run_writes_nothing_and_an_interrupt_keeps_the_finished_epochs(tmp_path: Path) -> None:
    run_dir = tmp_path / "D"
    live = Run(run_dir, ["seed=1", "trainer.max_epochs=400", "faults.slow_rank=0", "faults.slow_ms=100",
                         "timeout_s=60"])
    try:
        live.worker_pids  # noqa: B018 - the live run holds the directory
        live.wait_for("checkpoints/epoch001.ckpt")  # two epochs finished
        hydra_files = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
        logs = {p.name: p.read_bytes() for p in run_dir.glob("*.log")}

        # item 2: the second run is refused and writes nothing (Hydra used to replace .hydra/)
        second = run_cli([f"hydra.run.dir={run_dir}", *COMMON, "seed=2", "trainer.max_epochs=3"], check=False,
                         timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        assert "is in use by another live run" in one_error_line(second.stderr)
        assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == hydra_files
        assert "seed: 1" in (run_dir / ".hydra" / "config.yaml").read_text()
        for name, before in logs.items():  # the live run's log only grew, by its own lines
            now = (run_dir / name).read_bytes()
            assert now.startswith(before) and b"in use by another live run" not in now

        # item 4: resuming the 2-epoch checkpoint with trainer.max_epochs=1 would train nothing
        two = run_dir / "checkpoints" / "epoch001.ckpt"
        nothing = run_cli([f"hydra.run.dir={tmp_path / 'nothing'}", *COMMON, f"checkpoint.resume={two}",
                           "trainer.max_epochs=1"], check=False, timeout=120)
        assert nothing.returncode == 2, nothing.stderr[-3000:]
        assert one_error_line(nothing.stderr) == (
            f"easgd-train: error: checkpoint.resume: {two} has finished 2 epochs and trainer.max_epochs=1: "
            "nothing would be trained; set trainer.max_epochs above 2")
        assert not (tmp_path / "nothing" / "ranks").exists()

        # SIGINT in the middle of an epoch (0.8 s into one of 2.3 s)
        seen = _newest_epoch_ckpt(run_dir)
        deadline = time.monotonic() + 60
        while _newest_epoch_ckpt(run_dir) == seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _newest_epoch_ckpt(run_dir) != seen, live.output()
        time.sleep(0.8)
        live.proc.send_signal(signal.SIGINT)
        live.mark_fault()
        code, _ = live.wait(90)
    finally:
        if live.proc.poll() is None:
            live.kill_all()
    output = live.log.read_text(errors="replace")
    assert code == 130, output
    assert "received SIGINT: stopping the workers" in output
    assert "a worker failed" not in output  # it was an interrupt, and the log says so
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"] == "interrupted by SIGINT"
    history = summary["val_history"]
    assert len(history) >= 3 and summary["val_acc"] == history[-1]["val_acc"] is not None
    finished = history[-1]["step"]
    assert finished == len(history) * STEPS_PER_EPOCH, history
    assert summary["steps_per_rank"] == [finished, finished]  # whole epochs, not the interrupted one

    # the SIGINT checkpoint is mid-epoch: the resume says once that it is inexact, and why
    last = run_dir / "checkpoints" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=False)
    assert not state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"], "not mid-epoch"
    resumed_dir = tmp_path / "resumed"
    resumed = run_cli([f"hydra.run.dir={resumed_dir}", *COMMON, f"checkpoint.resume={last}",
                       f"trainer.max_epochs={len(history) + 1}"], check=False, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = [ln for ln in (resumed.stdout + resumed.stderr).splitlines() if "the resume is inexact" in ln]
    assert len(said) == 1 and f"in the middle of epoch {len(history)}" in said[0], said
    resume = json.loads((resumed_dir / "summary.json").read_text())["resume"]
    assert resume["exact"] is False and resume["mid_epoch"] is True and resume["epochs_done"] == len(history)
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
    assert f"exploded: above loss_explosion_factor=10000 x max(|first loss" in summary["error"]
    assert f"easgd-train: run diverged: diverged at step {step}" in proc.stderr
