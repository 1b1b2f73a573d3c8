"""Test helpers shared by the test files and the table scripts (``python -m tests.feature_matrix``):
compose the config as ``easgd-train`` does, read the CLI's one error line, run the real CLI
and real multi-process scripts in subprocesses. (The tiers, markers by directory, live in
tests/conftest.py; this module is importable outside pytest too.)"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from easgd_lightning.utils.rank_env import clean_env, free_port, rank_env

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


#: ``pl.Trainer`` options of a test run that writes and shows nothing of its own (no
#: checkpoints, progress bar, model summary or sanity validation) and takes its data as
#: given (no distributed sampler)
QUIET_TRAINER = dict(
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
    use_distributed_sampler=False,
)


def base_env(**extra: str) -> dict[str, str]:
    """The environment a test's subprocess runs in: no rendezvous variables, this checkout
    first on PYTHONPATH, W&B offline (:func:`easgd_lightning.utils.rank_env.clean_env`)."""
    return clean_env(repo=REPO, WANDB_MODE="offline", **extra)


def run_cli(args: list[str], *, timeout: float = 300, check: bool = True, cwd: Path | None = None,
            fresh: bool = False):
    """Run ``easgd-train ARGS``; returns the CompletedProcess.

    The process is forked from the session's :func:`cli_server`, which has imported what
    ``python -m easgd_lightning.cli.train`` imports, and runs the same ``main()`` with the
    same argv, environment and working directory (a process of its own, in its own session,
    starting its own ranks); ``fresh=True`` (or ``EASGD_TEST_SPAWN_CLI=1``): a fresh
    ``python -m easgd_lightning.cli.train``, for the checks of the command itself.
    """
    server = None if fresh else cli_server()
    if server is not None:
        proc = _run_forked_cli(server, args, cwd or REPO, timeout)
    else:
        cmd = [PY, "-m", "easgd_lightning.cli.train", *args]
        proc = subprocess.run(cmd, env=base_env(), cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"easgd-train failed ({proc.returncode}):\n{' '.join(args)}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def train_summary(run_dir: Path, *overrides: str, timeout: float = 300) -> dict:
    """Train through the CLI into ``run_dir`` and return its summary.json."""
    run_cli(
        [f"hydra.run.dir={run_dir}", "logger=csv", "trainer.enable_progress_bar=false", *overrides],
        timeout=timeout,
    )
    return json.loads((run_dir / "summary.json").read_text())


def compose(overrides: list[str], *, hydra_config: bool = False):
    """The config ``easgd-train`` would build from ``overrides`` (Hydra's compose over the
    config tree of :mod:`easgd_lightning.config_tree`, the recipe resolvers registered),
    without checking it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from easgd_lightning.cli.train import CONF_DIR  # also registers the recipe resolvers

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=list(overrides), return_hydra_config=hydra_config)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(pred: Callable[[], bool], timeout: float, what: str, *, poll_s: float = 0.1) -> None:
    """Return once ``pred()`` holds, checking every ``poll_s`` seconds; after ``timeout``
    seconds raise AssertionError naming ``what`` was waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def one_error_line(stderr: str) -> str:
    """The CLI's refusal: exactly one ``easgd-train: error:`` line and no traceback."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith("easgd-train: error:")]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


_script_server = None
_tmp: Path | None = None


def _session_tmp() -> Path:
    """A directory for the forked ranks' output files, removed when the session ends."""
    global _tmp
    if _tmp is None:
        _tmp = Path(tempfile.mkdtemp(prefix="easgd-test-ranks-"))
        atexit.register(shutil.rmtree, _tmp, True)
    return _tmp


def script_server():
    """The test session's fork server for rank scripts (cli/forkserver.py, a fresh interpreter
    that imports torch, Lightning, DeepSpeed and the package once): each rank of
    :func:`start_ranks` is forked from it instead of paying those imports itself.
    ``EASGD_TEST_SPAWN_RANKS=1``: a fresh interpreter per rank instead."""
    global _script_server
    if os.environ.get("EASGD_TEST_SPAWN_RANKS") == "1" or not sys.platform.startswith("linux"):
        return None
    if _script_server is None or not _script_server.alive():
        from easgd_lightning.cli import forkserver

        _script_server = forkserver.spawn_server(
            (*forkserver.WORKER_MODULES, "easgd_lightning.parallel.engine"), env=base_env())
        atexit.register(_script_server.close)
    return _script_server


_cli_server = None


def cli_server():
    """The test session's fork server for ``easgd-train`` runs (:func:`run_cli`): a fresh
    interpreter that has imported ``easgd_lightning.cli.train`` and what its validation and
    its ranks import later (Lightning, the data modules: the package imports them lazily, so
    a forked run would import them again, seconds each). None with ``EASGD_TEST_SPAWN_CLI=1``
    (a fresh interpreter per run)."""
    global _cli_server
    if os.environ.get("EASGD_TEST_SPAWN_CLI") == "1" or not sys.platform.startswith("linux"):
        return None
    if _cli_server is None or not _cli_server.alive():
        from easgd_lightning.cli import forkserver

        modules = ("easgd_lightning.cli.train", "easgd_lightning.cli.overrides", "easgd_lightning.cli.validate",
                   "easgd_lightning.data", *forkserver.WORKER_MODULES)
        _cli_server = forkserver.spawn_server(tuple(dict.fromkeys(modules)), env=base_env())
        atexit.register(_cli_server.close)
    return _cli_server


def run_train_main(args: list[str]) -> None:
    """A forked ``easgd-train``'s entry (:func:`run_cli`): ``main()`` with the command's argv."""
    from easgd_lightning.cli import train

    sys.argv = [train.__file__, *args]  # as ``python -m easgd_lightning.cli.train ARGS`` has it
    train.main()


def start_cli(args: list[str], env: dict[str, str], log: Path, *, cwd: Path = REPO):
    """``easgd-train ARGS`` in the background with ``env``, stdout and stderr into ``log``:
    forked from the session's :func:`cli_server` (a :class:`RankProcess`: ``pid``, ``poll``,
    ``wait``, ``kill``), or a ``subprocess.Popen`` with ``EASGD_TEST_SPAWN_CLI=1``."""
    server = cli_server()
    if server is None:
        return subprocess.Popen([PY, "-m", "easgd_lightning.cli.train", *args], env=env, cwd=cwd,
                                stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    return server.start([str(REPO / "easgd_lightning" / "cli" / "train.py"), *args], env, str(cwd), [],
                        entry="tests.helpers:run_train_main", stdout=str(log), stderr=str(log))


def _start_forked(server, argv: list[str], entry: str, env: dict[str, str], cwd: Path) -> tuple:
    """Fork ``entry(argv[1:])`` from ``server``, its stdout and stderr into files: (process, log dir)."""
    logs = Path(tempfile.mkdtemp(prefix="easgd-test-run-"))
    proc = server.start(argv, env, str(cwd), [], entry=entry, stdout=str(logs / "stdout"),
                        stderr=str(logs / "stderr"))
    return proc, logs


def _finish_forked(proc, logs: Path, timeout: float, cmd: list[str]) -> subprocess.CompletedProcess:
    """Wait for a process of :func:`_start_forked` as ``subprocess.run(cmd, capture_output=True,
    text=True, timeout=timeout)`` would; on timeout its whole process group (its own session,
    with what it started) gets SIGKILL first."""
    out, err = logs / "stdout", logs / "stderr"
    try:
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(30)
            raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(errors="replace"),
                                            err.read_text(errors="replace")) from None
        return subprocess.CompletedProcess(cmd, code, out.read_text(errors="replace"), err.read_text(errors="replace"))
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def _run_forked(server, argv: list[str], entry: str, env: dict[str, str], cwd: Path, timeout: float,
                cmd: list[str]) -> subprocess.CompletedProcess:
    """Fork ``entry(argv[1:])`` from ``server`` and wait for it (:func:`_finish_forked`)."""
    proc, logs = _start_forked(server, argv, entry, env, cwd)
    return _finish_forked(proc, logs, timeout, cmd)


def _run_forked_cli(server, args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return _run_forked(server, [str(REPO / "easgd_lightning" / "cli" / "train.py"), *args],
                       "tests.helpers:run_train_main", base_env(), cwd, timeout,
                       [PY, "-m", "easgd_lightning.cli.train", *args])


def run_python(script: Path, args: list[str], *, timeout: float, cwd: Path | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` (output captured as text), forked from the session's
    :func:`script_server` (or spawned with ``EASGD_TEST_SPAWN_RANKS=1``). The processes the
    script starts itself (Lightning's launcher: the other ranks) are fresh interpreters."""
    cmd = [PY, str(script), *args]
    env = base_env() if env is None else env
    server = script_server()
    if server is None:
        return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return _run_forked(server, [str(script), *args], "tests.helpers:run_script", env, cwd or Path.cwd(),
                       timeout, cmd)


def run_pythons(runs: list[tuple[Path, list[str], Path]], *, timeout: float) -> list[subprocess.CompletedProcess]:
    """:func:`run_python` of each ``(script, args, cwd)``, all started at once, then waited for
    in turn (from this thread: the fork server has one reader); their results in order. For
    runs whose own start leaves a core idle (Lightning's launcher starts the other ranks as
    fresh interpreters, one core busy importing each, while rank 0 waits for them)."""
    server = script_server()
    env = base_env()
    results: list[subprocess.CompletedProcess] = []
    if server is None:
        procs = [subprocess.Popen([PY, str(script), *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for script, args, cwd in runs]
        return communicate_all(procs, timeout)
    started = [_start_forked(server, [str(script), *args], "tests.helpers:run_script", env, cwd)
               for script, args, cwd in runs]
    try:
        for (proc, logs), (script, args, _) in zip(started, runs):
            results.append(_finish_forked(proc, logs, timeout, [PY, str(script), *args]))
    finally:
        for proc, logs in started[len(results):]:  # one timed out: the others end too
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            shutil.rmtree(logs, ignore_errors=True)
    return results


def run_script(args: list[str]) -> None:
    """A forked rank's entry (``start_ranks``): run ``sys.argv[0]`` as ``python SCRIPT ARGS`` would."""
    import runpy

    sys.path.insert(0, str(Path(sys.argv[0]).parent))
    runpy.run_path(sys.argv[0], run_name="__main__")


class ScriptRank:
    """A rank script forked by :func:`script_server`: ``subprocess.Popen``'s API, with its
    output in files that :meth:`communicate` reads."""

    def __init__(self, proc, out: Path, err: Path) -> None:
        self._proc, self._out, self._err = proc, out, err
        self.pid, self.args = proc.pid, proc.args

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    def poll(self) -> int | None:
        return self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self._proc.wait(timeout)

    def send_signal(self, sig: int) -> None:
        self._proc.send_signal(sig)

    def kill(self) -> None:
        self._proc.kill()

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self._proc.wait(timeout)
        return (self._out.read_text(errors="replace") if self._out.exists() else "",
                self._err.read_text(errors="replace") if self._err.exists() else "")


def start_ranks(script: Path, world: int, args: list[str], *,
                port: int | None = None) -> list[subprocess.Popen | ScriptRank]:
    """Start ``script`` as ``world`` ranks (torchrun-style environment, rendezvous at
    ``port``: a free one by default), forked by the session's :func:`script_server` (or
    spawned); their out/err are read by ``communicate``."""
    port = free_port() if port is None else port
    return [start_rank(script, rank, world, args, port=port) for rank in range(world)]


def start_rank(script: Path, rank: int, world: int, args: list[str], *, port: int,
               extra_env: dict[str, str] | None = None) -> subprocess.Popen | ScriptRank:
    """One rank of :func:`start_ranks` (``extra_env`` added to its environment): e.g. a
    process that joins a running set of ranks late, at the same rendezvous ``port``."""
    server = script_server()
    env = {**rank_env(base_env(), rank, world, port), **(extra_env or {})}
    if server is None:
        return subprocess.Popen([PY, str(script), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    logs = Path(tempfile.mkdtemp(prefix="ranks-", dir=_session_tmp()))
    out, err = logs / f"rank{rank}.out", logs / f"rank{rank}.err"
    proc = server.start([str(script), *args], env, os.getcwd(), [], entry="tests.helpers:run_script",
                        stdout=str(out), stderr=str(err))
    return ScriptRank(proc, out, err)


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[subprocess.CompletedProcess]:
    """Each process's exit status and output, in order (each waited for up to ``timeout``);
    any still running afterwards (a timeout) is killed."""
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


def launch_ranks(script: Path, world: int, args: list[str], *, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Run ``script`` as ``world`` ranks (torchrun-style environment) and wait for all."""
    results = communicate_all(start_ranks(script, world, args), timeout)
    failed = [(rank, r) for rank, r in enumerate(results) if r.returncode != 0]
    if failed:
        codes = ", ".join(f"rank {rank}: {r.returncode}" for rank, r in enumerate(results))
        tails = "\n".join(f"--- rank {rank} ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
                          for rank, r in failed)
        raise AssertionError(f"ranks failed ({codes}):\n{tails}")
    return results


def run_rank_scenarios(run: Callable[[str, int, int, str], Any]) -> None:
    """One rank of a scenario script (``SCRIPT OUT NAME[,NAME...]``, torchrun-style
    environment): joins the gloo group, runs ``run(NAME, rank, world, OUT)`` for each name in
    order, writes ``{"world": world, NAME: result, ...}`` to ``OUT/rank<R>.json``, then waits
    for every rank and leaves the group."""
    import torch
    import torch.distributed as dist

    out_dir, names = sys.argv[1], sys.argv[2].split(",")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    result: dict[str, Any] = {"world": world}
    for name in names:
        result[name] = run(name, rank, world, out_dir)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    dist.barrier()
    dist.destroy_process_group()


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_valid_png(path: Path) -> None:
    """A real, non-blank PNG: signature, size, decodable by matplotlib, not one flat colour."""
    import matplotlib.image as mpimg

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 5_000, (path, len(data))
    pixels = mpimg.imread(str(path))
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert float(pixels[..., :3].std()) > 0.01  # axes, labels and data, not a blank canvas


class SoloCollective:
    """world_size = 1: each collective returns this rank's own tensors (nothing to exchange)."""

    world_size = 1

    def all_reduce_sum(self, tensors):
        return [t.clone() for t in tensors]

    def all_reduce_max(self, tensors):
        return [t.clone() for t in tensors]

    def all_gather(self, tensors):
        return [[t.clone() for t in tensors]]

    def all_to_all(self, sends):
        return [t.clone() for t in sends]


class MeteredSoloCollective(SoloCollective):
    """World of one metered under ``kind``, as the attach points' collectives are (what
    ``exchange_tensors`` needs beside the collectives: a meter kind and ``charge_dense``)."""

    def __init__(self, kind: str = "elastic") -> None:
        self.kind = kind

    def charge_dense(self, nbytes: int, key=None) -> None:
        pass
