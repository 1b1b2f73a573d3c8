"""``cli.slurm.collect``: a sweep returns only once SLURM lists its jobs as ended (a job's
tasks still exit after writing their results), and never waits past ``exit_s`` for that."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

from easgd_lightning.cli.slurm import collect


def _job(tmp_path: Path, job_id: str, value: int) -> SimpleNamespace:
    """A finished submitit job as ``collect`` reads it: its result file written."""
    result = tmp_path / f"{job_id}_result.pkl"
    result.write_bytes(b"done")
    return SimpleNamespace(job_id=job_id, _sub_jobs=[], paths=SimpleNamespace(result_pickle=result),
                           results=lambda: [value])


def _squeue(answers: dict[str, list[str]]):
    """A ``states`` callable replaying, per job id, the states squeue gives on each call
    (the last one repeated); the ids asked for on each call are recorded."""
    asked: list[list[str]] = []

    def states(ids):
        asked.append(list(ids))
        return {i: (answers[i].pop(0) if len(answers[i]) > 1 else answers[i][0]) for i in ids}

    return states, asked


def test_returns_once_slurm_lists_the_job_as_ended(tmp_path: Path) -> None:
    jobs = [_job(tmp_path, "7_0", 10), _job(tmp_path, "7_1", 11)]
    states, asked = _squeue({"7_0": ["RUNNING", "COMPLETING", "COMPLETED"], "7_1": ["COMPLETED"]})
    outcomes = collect(jobs, poll_s=0.01, states=states)
    assert [(o.job_id, o.result, o.error) for o in outcomes] == [("7_0", 10, None), ("7_1", 11, None)]
    # both had results at once; 7_0 was asked for until squeue no longer listed it as active
    assert asked == [["7_0", "7_1"], ["7_0"], ["7_0"]]


def test_a_job_that_stays_running_is_left_to_slurm_after_exit_s(tmp_path: Path, caplog) -> None:
    jobs = [_job(tmp_path, "8_0", 1)]
    states, asked = _squeue({"8_0": ["RUNNING"]})
    with caplog.at_level(logging.WARNING, logger="easgd_lightning"):
        outcomes = collect(jobs, poll_s=0.01, exit_s=0.2, states=states)
    assert outcomes[0].result == 1 and outcomes[0].error is None
    assert len(asked) >= 3  # polled until the deadline, not once
    assert "SLURM job 8_0 still RUNNING after its tasks wrote their results" in caplog.text
