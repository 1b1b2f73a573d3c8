"""What ``hydra/launcher=slurm`` adds to Hydra's submitit launcher: job states without
accounting, and a sweep that goes on past a job SLURM ended.

The plugin (hydra-submitit-launcher 1.2) waits for each job with ``job.results()``, which
asks ``sacct`` for the job's state: on a cluster without slurmdbd ``sacct`` has no answer,
so a job cancelled (``scancel``), preempted, timed out or killed by a lost node would be
waited for forever, and one that ended without a result would stop the whole sweep with
an exception. :func:`collect` instead watches the result files submitit's tasks write and
the job states ``squeue`` reports (SLURM keeps ended jobs for ``MinJobAge``, 300 s by
default): a job that ended without a result of every task is recorded as failed
(``summary.json`` with status ``failed`` naming the job, its state and its log directory)
and the other jobs go on. The launcher class itself lives in
``hydra_plugins/easgd_lightning_slurm`` (Hydra only loads plugins from that namespace).
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ACTIVE_STATES", "JobOutcome", "collect", "squeue_states"]

log = logging.getLogger("easgd_lightning")

#: States of a job that has not ended yet (squeue's long names).
ACTIVE_STATES = frozenset({
    "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_FED",
    "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD",
})


def squeue_states(job_ids: Sequence[str], timeout_s: float = 30.0) -> dict[str, str] | None:
    """{job id: state} for the jobs ``squeue`` still knows (every state, array tasks one per
    line); None when ``squeue`` itself fails (controller unreachable)."""
    mains = sorted({jid.split("_")[0] for jid in job_ids})
    try:
        proc = subprocess.run(
            ["squeue", "-h", "-r", "-t", "all", "-o", "%i|%T", "-j", ",".join(mains)],
            capture_output=True, text=True, timeout=timeout_s,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        # every id purged (older than MinJobAge): squeue calls them invalid
        return {} if "Invalid job id" in proc.stderr else None
    states = {}
    for line in proc.stdout.splitlines():
        jid, _, state = line.strip().partition("|")
        if jid:
            states[jid] = state.strip()
    return states


@dataclass
class JobOutcome:
    """How one submitit job ended: ``result`` (task 0's return) or ``error`` (why not)."""

    job_id: str
    result: Any = None
    error: str | None = None
    state: str | None = None


def _results_written(job) -> bool:
    tasks = job._sub_jobs or [job]  # noqa: SLF001 -- submitit's per-task views of a multi-task job
    return all(task.paths.result_pickle.exists() for task in tasks)


def collect(jobs: Sequence, *, poll_s: float = 1.0, result_grace_s: float = 10.0,
            unreachable_s: float = 300.0, exit_s: float = 60.0,
            on_end: Callable[[int, JobOutcome], None] | None = None,
            states: Callable[[Sequence[str]], dict[str, str] | None] = squeue_states) -> list[JobOutcome]:
    """Wait until every job has ended; returns their outcomes in order.

    A job is done when every task wrote its result file (task 0's result is the job's), or
    failed when SLURM no longer lists it as active and its results are still missing
    ``result_grace_s`` later (files written just before the end may take a moment to show
    on a shared file system), or when ``squeue`` has not answered for ``unreachable_s``.
    ``on_end(index, outcome)`` is called as each job ends. A job with its results is then
    given up to ``exit_s`` for SLURM to list it as ended (its tasks still exit after writing
    them), so the sweep does not return with its jobs still running.
    """
    outcomes: dict[int, JobOutcome] = {}
    ended_at: dict[int, float] = {}
    exit_by: dict[int, float] = {}  # jobs with results: when SLURM should have ended them
    last_answer = time.monotonic()

    def finish(i: int, outcome: JobOutcome) -> None:
        outcomes[i] = outcome
        if on_end is not None:
            on_end(i, outcome)

    while len(outcomes) < len(jobs):
        waiting = [i for i in range(len(jobs)) if i not in outcomes]
        for i in waiting:
            if _results_written(jobs[i]):
                finish(i, _read_result(jobs[i]))
                exit_by[i] = time.monotonic() + exit_s
        waiting = [i for i in waiting if i not in outcomes]
        if not waiting:
            break
        now = time.monotonic()
        known = states([jobs[i].job_id for i in waiting])
        if known is None:
            if now - last_answer > unreachable_s:
                for i in waiting:
                    finish(i, JobOutcome(jobs[i].job_id, error=f"squeue did not answer for {unreachable_s:.0f} s"))
                break
        else:
            last_answer = now
            for i in waiting:
                state = known.get(jobs[i].job_id, "PURGED")
                if state.split()[0] in ACTIVE_STATES:
                    ended_at.pop(i, None)
                    continue
                first = ended_at.setdefault(i, now)
                if now - first >= result_grace_s:
                    tasks = jobs[i]._sub_jobs or [jobs[i]]  # noqa: SLF001
                    missing = [t._tasks[0] for t in tasks if not t.paths.result_pickle.exists()]  # noqa: SLF001
                    finish(i, JobOutcome(
                        jobs[i].job_id, state=state,
                        error=f"SLURM job {jobs[i].job_id} ended {state} without a result from task(s) "
                              f"{missing} (logs: {jobs[i].paths.folder})"))
        time.sleep(poll_s)
    _wait_until_ended(jobs, exit_by, states, poll_s)
    return [outcomes[i] for i in range(len(jobs))]


def _wait_until_ended(jobs: Sequence, exit_by: dict[int, float],
                      states: Callable[[Sequence[str]], dict[str, str] | None], poll_s: float) -> None:
    """Poll until SLURM lists none of ``exit_by``'s jobs as active, each job at most until its
    deadline (then a warning: the job is left to SLURM)."""
    pending = dict(exit_by)
    while pending:
        known = states([jobs[i].job_id for i in pending])
        now = time.monotonic()
        for i, deadline in list(pending.items()):
            state = None if known is None else known.get(jobs[i].job_id, "PURGED")
            if state is not None and state.split()[0] not in ACTIVE_STATES:
                del pending[i]
            elif now >= deadline:
                log.warning("SLURM job %s still %s after its tasks wrote their results; left to SLURM",
                            jobs[i].job_id, state or "unknown (squeue did not answer)")
                del pending[i]
        if pending:
            time.sleep(poll_s)


def _read_result(job) -> JobOutcome:
    try:
        return JobOutcome(job.job_id, result=job.results()[0], state="COMPLETED")
    except Exception as err:  # noqa: BLE001 -- a task raised outside the job function
        return JobOutcome(job.job_id, error=f"SLURM job {job.job_id} failed: {type(err).__name__}: "
                                            f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}")


def record_failed_job(job_dir: Path, cfg, message: str) -> None:
    """A failed ``summary.json`` in ``job_dir`` for a job that ended without writing one
    (a summary the job's own ranks wrote is kept)."""
    from easgd_lightning.cli.train import _fail

    if (job_dir / "summary.json").exists():
        return
    job_dir.mkdir(parents=True, exist_ok=True)
    _fail(job_dir, cfg, message)
