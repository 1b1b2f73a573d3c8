"""Bad input through the real ``easgd-train``: exit status 2, exactly one
``easgd-train: error:`` line naming the key, no traceback, no worker started.

The full table of cases runs in-process in tests/unit/cli/test_validation.py; these are one
of each kind: an unknown key (checked before Hydra composes), a value, what the module
built on the meta device cannot do, and a sweep with an unknown group option.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import PY, REPO, base_env, run_cli
from tests.helpers import one_error_line as _one_error_line

CASES = [
    (["+trainer.max_epocs=3"], "trainer.max_epocs: unknown key; did you mean trainer.max_epochs?"),
    (["optim.lr=-1"], "optim.lr must be a number > 0, got -1"),
    (["model=gpt_tiny", "model.builder=tests.unit.cli.test_validation:two_optimizers", "strategy=sync_easgd"],
     "model=gpt: configure_optimizers returns 2 optimizers; strategy=sync_easgd drives exactly 1"),
    # issue 31 item 5: a traceback (TypeError; an embedding index error in every worker), a
    # failure after the workers started, and Hydra's 3 lines before the clear one
    (["faults.slow_ms=abc"], "faults.slow_ms must be a number >= 0 or null, got 'abc'"),
    (["model=gpt_tiny"], "model=gpt: a language model needs token data with a vocabulary (data=text"),
    (["strategy=pipeline_3d", "model=gpt_tiny", "data=text", "trainer.precision=64-true"],
     "trainer.precision: strategy=pipeline_3d runs in fp32: set trainer.precision=32-true, got 64-true"),
    (["model._target_=nonexistent.mod.fn"], "model._target_: cannot import 'nonexistent.mod.fn'"),
    (["faults.crash_at_step=2"], "faults.crash_at_step: set faults.crash_rank too"),
    (["strategy=async_easgd", "trainer.devices=3", "faults.crash_rank=2", "faults.crash_at_step=2"],
     "faults.crash_rank: rank 2 is strategy=async_easgd's parameter server, which never takes a training step"),
    (["strategy=async_sgd", "trainer.devices=5", "strategy.servers=3"],
     "strategy.servers=3: async_sgd needs at most as many servers as workers; 5 processes give 2 workers"),
]


def _sweep(sweep: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "easgd_lightning.cli.train", "-m", *(overrides or ("strategy=ddp,bogus",)), "logger=none",
         f"hydra.sweep.dir={sweep}"],
        env=base_env(), cwd=REPO, capture_output=True, text=True, timeout=120,
    )


_LONG_NAME = "a" * 300
_LONG_PATH = "/tmp/" + "/".join(["d" * 200] * 21)  # 4225 bytes, every name within NAME_MAX

#: run directories that cannot be used (issue 31 item 5: each was a Hydra traceback, or for
#: an empty one a run writing into the current directory): {id: (value, the line's start)};
#: ``{tmp}`` is the test's directory
RUN_DIRS = {
    "empty": ("", "hydra.run.dir: is empty; give the run a directory of its own"),
    "immutable": ("{tmp}/immutable", "hydra.run.dir={tmp}/immutable: no file can be created in it"),
    "proc": ("/proc/easgd-run", "hydra.run.dir=/proc/easgd-run: cannot be created"),
    "a file": ("{tmp}/afile", "hydra.run.dir={tmp}/afile: is a file, not a directory"),
    "parent a file": ("{tmp}/afile/run", "hydra.run.dir={tmp}/afile/run: cannot be created (Not a directory)"),
    "300-char name": ("{tmp}/" + _LONG_NAME, "hydra.run.dir: the name aaaaaaaaaaaaaaaaaaaaaaaa... in it is 300 bytes"),
    "path over 4096": (_LONG_PATH, "hydra.run.dir: the path is 4225 bytes long; Linux allows at most 4095"),
}


def _chattr(flag: str, path: Path) -> bool:
    try:
        return subprocess.run(["chattr", flag, str(path)], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict:
    """Every command of this file: {case id or "sweep": (its directory, the CompletedProcess)};
    each test checks its own as when they ran one after the other. The command itself (a
    fresh ``python -m easgd_lightning.cli.train``: the first case and both sweeps, side by
    side in threads) and the rest forked from the session's CLI server (the same ``main()``,
    argv, environment and directory; one after the other: the server takes one request at a
    time), while the fresh ones import."""
    root = tmp_path_factory.mktemp("bad_input")
    dirs = {" ".join(o): root / f"case{i}" / "run" for i, (o, _) in enumerate(CASES)}
    jobs = {key: (lambda run=run, o=o, i=i: run_cli([f"hydra.run.dir={run}", "logger=none", *o], check=False,
                                                      timeout=120, fresh=i == 0))
            for i, ((key, run), (o, _)) in enumerate(zip(dirs.items(), CASES))}
    fresh = {next(iter(dirs)), "sweep", "sweep lr"}
    dirs["sweep"] = root / "sweep"
    jobs["sweep"] = lambda: _sweep(dirs["sweep"])
    dirs["sweep lr"] = root / "sweep_lr"  # the first job is good, the second is not
    jobs["sweep lr"] = lambda: _sweep(dirs["sweep lr"], "optim.lr=0.1,-1", "trainer.max_epochs=1")
    tmp = root / "dirs"
    tmp.mkdir()
    (tmp / "afile").write_text("a file\n")
    (tmp / "immutable").mkdir()
    immutable = _chattr("+i", tmp / "immutable")
    for key, (value, _) in RUN_DIRS.items():
        if key == "immutable" and not immutable:
            continue
        arg = f"hydra.run.dir={value.format(tmp=tmp)}"
        dirs[f"dir {key}"] = tmp
        jobs[f"dir {key}"] = lambda arg=arg: run_cli(["logger=none", arg], check=False, timeout=120, cwd=root)
    try:
        with ThreadPoolExecutor(3) as pool:
            futures = {key: pool.submit(jobs[key]) for key in fresh}
            done = {key: job() for key, job in jobs.items() if key not in fresh}
            done.update({key: f.result() for key, f in futures.items()})
            return {key: (dirs[key], done[key]) for key in jobs}
    finally:
        if immutable:
            _chattr("-i", tmp / "immutable")


@pytest.mark.parametrize("overrides,expected", CASES, ids=[" ".join(o) for o, _ in CASES])
def test_exit_2_one_line_no_worker(answers: dict, overrides: list[str], expected: str) -> None:
    run, proc = answers[" ".join(overrides)]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert expected in _one_error_line(proc.stderr)
    assert not (run / "ranks").exists()  # no worker started
    summary = run / "summary.json"  # value errors are recorded; Hydra-level ones stop before a run dir
    assert not summary.exists() or json.loads(summary.read_text())["status"] == "failed"


def test_sweep_with_one_bad_job_starts_none(answers: dict) -> None:
    sweep, proc = answers["sweep"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "strategy=bogus: no such option" in _one_error_line(proc.stderr)
    assert not sweep.exists()  # not even the valid job ran


def test_one_bad_job_stops_the_sweep_before_the_good_one_trains(answers: dict) -> None:
    """``-m optim.lr=0.1,-1``: every job's values are checked before the first job starts
    (the good job used to train first)."""
    sweep, proc = answers["sweep lr"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_error_line(proc.stderr)
    assert "optim.lr must be a number > 0, got -1 (sweep job 1: optim.lr=-1 trainer.max_epochs=1" in line
    assert not sweep.exists()  # no job ran, not even the good one


def test_target_that_cannot_be_imported_is_one_line_without_hydras(answers: dict) -> None:
    _, proc = answers["model._target_=nonexistent.mod.fn"]
    assert "Error getting object" not in proc.stdout + proc.stderr
    assert "Are you sure that module" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("key", list(RUN_DIRS))
def test_unusable_run_directory_is_one_line(answers: dict, key: str) -> None:
    if f"dir {key}" not in answers:
        pytest.skip("chattr +i is not possible here (needs CAP_LINUX_IMMUTABLE and a file system with it)")
    tmp, proc = answers[f"dir {key}"]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert _one_error_line(proc.stderr).startswith("easgd-train: error: " + RUN_DIRS[key][1].format(tmp=tmp))
    assert "Traceback" not in proc.stdout
    assert not (tmp.parent / "summary.json").exists() and not (tmp.parent / "ranks").exists()  # the cwd
    assert not (tmp / "afile").is_dir() and (tmp / "afile").read_text() == "a file\n"
