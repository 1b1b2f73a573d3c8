"""A real single-machine SLURM cluster (``scripts/slurm_local.py``: munged, slurmctld and
slurmd with a ``slurm.conf`` for this machine), and a sweep through the real CLI:

    easgd-train -m hydra/launcher=slurm strategy=local_sgd,ddp,sync_easgd ...

One SLURM job array, one job per strategy, each job 2 tasks, each task one rank
(``SLURM_PROCID`` / ``SLURM_NTASKS``). The first job is killed with ``scancel`` as soon as
it runs: it is recorded as failed (``summary.json`` naming the job and its state), the
sweep goes on, the other two jobs write their summaries, ``easgd-train`` exits 1 naming
the failed job, ``easgd-report`` builds the table from all three, and ``squeue`` is empty
at the end. Skipped, with the reason, where slurm-wlm and munge cannot be installed
(``apt-get``, as root) or the daemons cannot start. ``slurm_gpu`` is checked as far as a
machine without GPUs allows: the sbatch script submitit writes from it.

``ft=torchft`` on SLURM (easgd_lightning/ft/external.py): one job of 2 tasks, one worker each;
task 0 serves the lighthouse; the worker of task 1 is SIGKILLed from outside mid-run and its
task starts it again; the job ends ``ok`` with the death (signal, time) and restart recorded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import PY, REPO, base_env, compose, pid_alive

sys.path.insert(0, str(REPO / "scripts"))
import slurm_local  # noqa: E402  (scripts/ is not a package: the user's entry point)

pytestmark = pytest.mark.slow

SWEEP = ("local_sgd", "ddp", "sync_easgd")  # job 0 (local_sgd) is the one cancelled
SHORT = [
    "trainer.devices=2", "trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2",
    "checkpoint.enabled=false", "logger=csv", "trainer.enable_progress_bar=false",
]


@pytest.fixture(scope="module")
def slurm():
    """The local cluster for this module; stopped (jobs cancelled, daemons ended, state
    removed) at the end, also on Ctrl-C (KeyboardInterrupt) and SIGTERM (turned into one)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="the slurm extra is not installed (make venv installs .[dev,slurm])")
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    cluster = slurm_local.LocalSlurm(install=True, ready_timeout_s=60.0)
    try:
        try:
            cluster.up()
        except slurm_local.SlurmUnavailable as err:
            cluster.down()
            pytest.skip(f"no local SLURM cluster: {err}")
        yield cluster
    finally:
        cluster.down()
        signal.signal(signal.SIGTERM, previous)


def _cancel_first_job_when_running(cluster, sweep_dir: Path, done: threading.Event, seen: dict) -> None:
    """scancel array task 0 as soon as squeue shows it RUNNING (watching from submission)."""
    while not done.is_set():
        for jid, state in cluster.queue():
            if jid.endswith("_0") and state == "RUNNING":
                seen["cancelled"] = jid
                cluster.run("scancel", jid)
                return
        time.sleep(0.3)


@pytest.fixture(scope="module")
def sweep(slurm, tmp_path_factory):
    sweep_dir = tmp_path_factory.mktemp("slurm") / "sweep"
    done, seen = threading.Event(), {}
    watcher = threading.Thread(target=_cancel_first_job_when_running, args=(slurm, sweep_dir, done, seen))
    watcher.start()
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [PY, "-m", "easgd_lightning.cli.train", "-m", "hydra/launcher=slurm", f"strategy={','.join(SWEEP)}",
             *SHORT, f"hydra.sweep.dir={sweep_dir}"],
            env=slurm.env(base_env()), cwd=REPO, capture_output=True, text=True, timeout=300,
        )
    finally:
        done.set()
        watcher.join()
    print(f"sweep of {len(SWEEP)} SLURM jobs: {time.monotonic() - started:.1f}s, cancelled {seen.get('cancelled')}")
    return sweep_dir, proc, seen, slurm.queue()


def _summaries(sweep_dir: Path) -> dict[str, dict]:
    out = {}
    for path in sweep_dir.glob("*/summary.json"):
        s = json.loads(path.read_text())
        out[s["strategy"]] = s
    return out


def test_sweep_on_slurm_goes_on_past_a_cancelled_job(sweep) -> None:
    sweep_dir, proc, seen, queue_after = sweep
    assert seen.get("cancelled", "").endswith("_0"), (seen, proc.stderr[-3000:])
    summaries = _summaries(sweep_dir)
    assert sorted(summaries) == sorted(SWEEP), (sorted(summaries), proc.stderr[-4000:])
    killed = summaries["local_sgd"]
    assert killed["status"] == "failed"
    assert f"SLURM job {seen['cancelled']} ended CANCELLED" in killed["error"], killed["error"]
    for name in ("ddp", "sync_easgd"):
        s = summaries[name]
        assert s["status"] == "ok", s.get("error")
        # each SLURM task was one rank of the job: two ranks, both trained 4 steps
        assert s["world_size"] == 2 and s["steps_per_rank"] == [4, 4]
        assert s["run_id"].startswith("slurm-")
        assert s["config"]["strategy"]["name"] == name
        assert sum(s["comm"]["bytes_sent"]) > 0  # the ranks really exchanged over gloo
    # the sweep's exit status names the failed job, as a local sweep does
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "1 of 3 sweep jobs failed" in proc.stderr and "CANCELLED" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert queue_after == [], queue_after


def test_report_built_from_the_slurm_sweep(sweep) -> None:
    sweep_dir = sweep[0]
    proc = subprocess.run([PY, "-m", "easgd_lightning.cli.report", str(sweep_dir)], env=base_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (sweep_dir / "report.md").read_text()
    for name in SWEEP:
        assert name in text


def test_each_task_was_one_rank(sweep) -> None:
    """submitit's per-task logs: task k of each finished job ran as global rank k of 2."""
    sweep_dir = sweep[0]
    logs = sorted((sweep_dir / ".submitit").glob("*_[12]/*_[12]_[01]_log.out"))
    assert len(logs) == 4, logs
    for log in logs:
        task = int(log.name.split("_")[2])
        assert f"global_rank={task}(2)" in log.read_text()


def test_slurm_gpu_config_renders_a_gpu_job() -> None:
    """No GPU node here: the sbatch script submitit writes from ``hydra/launcher=slurm_gpu``
    (not submitted) asks for one GPU and one task per rank, on trainer.num_nodes nodes."""
    pytest.importorskip("submitit")
    from omegaconf import OmegaConf

    from hydra_plugins.easgd_lightning_slurm.launcher import SlurmLauncher

    cfg = compose(["recipe=imagenet/resnet50_gpu", "hydra/launcher=slurm_gpu", "trainer.num_nodes=2",
                   "hydra.sweep.dir=/tmp/x"], hydra_config=True)
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    params.pop("_target_")
    executor = SlurmLauncher(**params)._executor()
    script = executor._executor._make_submission_file_text("python -m x", "uid")  # noqa: SLF001
    assert f"#SBATCH --gpus-per-node={cfg.trainer.devices}" in script
    assert f"#SBATCH --ntasks-per-node={cfg.trainer.devices}" in script
    assert "#SBATCH --nodes=2" in script and "#SBATCH --cpus-per-task=10" in script


# ------------------------------------------------------------------------------ ft=torchft
FT_JOB = ["ft=torchft", "strategy=sync_easgd", "trainer.devices=2", "trainer.max_epochs=25", "faults.slow_rank=0",
          "faults.slow_ms=20", "logger=none", "trainer.enable_progress_bar=false", "data.num_workers=0",
          "checkpoint.enabled=false"]


def _job_file(sweep_dir: Path, name: str) -> Path | None:
    found = sorted(sweep_dir.glob(f"*/ranks/ft/{name}"))
    return found[0] if found else None


def test_ft_job_restarts_a_killed_worker(slurm, tmp_path) -> None:
    """Task 1's worker SIGKILLed a moment after both committed their first exchange: task 1
    starts it again and it rejoins from worker 0 -- or, on a machine too slow for the fresh
    interpreter to start before worker 0 ends (worker 0 is paced at about 30 ms a step, 575
    steps), ends ``ended_before_rejoin``; either way the job is ``ok``, the death is recorded
    with its signal and time (the task saw it), task 0 served the lighthouse and stopped it."""
    sweep_dir = tmp_path / "ft"
    log = tmp_path / "ft.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen([PY, "-m", "easgd_lightning.cli.train", "-m", "hydra/launcher=slurm", *FT_JOB,
                                 f"hydra.sweep.dir={sweep_dir}"], env=slurm.env(base_env()), cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not (_job_file(sweep_dir, "rank0.json") and _job_file(sweep_dir, "rank1.json")):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(0.5)
        victim = json.loads(_job_file(sweep_dir, "rank1.json").read_text())["pid"]
        lighthouse = json.loads(_job_file(sweep_dir, "lighthouse.json").read_text())
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    job = _job_file(sweep_dir, "task0.json").parents[2]
    s = json.loads((job / "summary.json").read_text())
    ft = s["ft"]
    print(f"ft=torchft SLURM job, a worker killed: {time.monotonic() - started:.1f}s, rejoins {ft['rejoins']}, "
          f"lost {ft['lost_ranks']}")
    assert code == 0, log.read_text()[-3000:]
    assert s["status"] == "ok", s["error"]
    assert s["run_id"].startswith("slurm-") and s["world_size"] == 2
    assert ft["restarts"] == [0, 1]
    (death,) = ft["deaths"]
    assert death["rank"] == 1 and death["signal"] == "SIGKILL" and death["t_s"] > 0
    assert ft["lighthouse"] == lighthouse["address"]  # served by task 0 ...
    assert not pid_alive(lighthouse["pid"])  # ... and stopped by it at the end
    if ft["rejoins"]:
        (rejoin,) = ft["rejoins"]
        assert rejoin["rank"] == 1 and rejoin["recovery_bytes"] > 0 and rejoin["recovery_s"] > 0
        assert ft["finished_ranks"] == [0, 1] and s["steps_per_rank"] == [575, 575]
        reports = [json.loads((job / "ranks" / f"rank{r}.json").read_text()) for r in range(2)]
        assert reports[0]["val_loss"] == reports[1]["val_loss"]  # the same model
    else:
        assert ft["finished_ranks"] == [0] and ft["lost_ranks"] == ft["ended_before_rejoin"] == [1]
    assert not pid_alive(victim)
    deadline = time.monotonic() + 30  # slurmd reports the job done a moment after its tasks ended
    while slurm.queue() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurm.queue() == []
