"""``easgd-train``: the Hydra main.

* Validates the whole config first; a bad value prints one line naming the key and the
  allowed values and exits with status 2, before any process starts.
* Launch: under an external launcher (``torchrun``, SLURM via submitit, DeepSpeed's
  launcher, the benchmark's namespaces: ``RANK`` and ``WORLD_SIZE`` set) this process is
  one rank. Otherwise it owns the run directory (``run.lock``) and starts
  ``trainer.devices`` local worker processes with this job's resolved config and watches
  them (``cli/launch.py``: bounded waits, signals forwarded, SIGKILL after a grace period),
  so Hydra multirun jobs each get their own workers and output directory (Lightning's
  subprocess launcher, which re-runs the command line, is never used).
* Writes ``summary.json`` into the job's output directory; one failing job in a
  multirun sweep is recorded as failed and the sweep goes on, then exits 1 naming it.
  A run ended by SIGINT / SIGTERM / SIGHUP exits 128 + the signal (130 / 143 / 129).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from easgd_lightning import ft
from easgd_lightning.cli import forkserver, launch
from easgd_lightning.cli.resolvers import register_resolvers
from easgd_lightning.cli.summary import SWEEP_JOBS as _SWEEP_JOBS
from easgd_lightning.cli.summary import build_summary, write_summary
from easgd_lightning.cli.validate import ConfigError, validate_config
from easgd_lightning.cli.worker import (
    current_run_id,
    read_rank_reports,
    run_worker,
)
from easgd_lightning.comm.ops import close_process_group
from easgd_lightning.config_tree import CONF_DIR, CONF_PATH
from easgd_lightning.utils.procs import exit_now, freeze_at_exit
from easgd_lightning.utils.renames import apply_renames

__all__ = ["main", "train", "CONF_DIR"]

log = logging.getLogger("easgd_lightning")

register_resolvers()  # ${linear_lr:...}, ${bf16_if_supported:} in recipes


def _external_rank_world() -> tuple[int, int] | None:
    """(rank, world) when an external launcher started this process, else None.

    torchrun / DeepSpeed's launcher / the benchmark set RANK and WORLD_SIZE; SLURM (srun,
    Hydra's submitit launcher) sets SLURM_PROCID and SLURM_NTASKS.
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    return None


def _externally_launched() -> bool:
    return _external_rank_world() is not None


def _set_node_rank(devices: int) -> None:
    """Set ``NODE_RANK`` from ``RANK`` and ``LOCAL_RANK`` when the launcher set neither it
    nor ``GROUP_RANK``.

    DeepSpeed's launcher (``deepspeed.launcher.launch``) sets ``RANK``, ``LOCAL_RANK`` and
    ``WORLD_SIZE`` but names the node only as ``CROSS_RANK``; Lightning's
    ``LightningEnvironment`` reads ``NODE_RANK`` / ``GROUP_RANK`` (default 0) and sets the
    global rank to ``node_rank * trainer.devices + LOCAL_RANK``, so every node would claim
    ranks ``0..devices-1``. The inverse of that rule: ``NODE_RANK = (RANK - LOCAL_RANK) /
    trainer.devices``.
    """
    if "LOCAL_RANK" not in os.environ or "NODE_RANK" in os.environ or "GROUP_RANK" in os.environ:
        return
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    node, rest = divmod(rank - local, devices)
    if rest or local >= devices:
        raise ConfigError(f"trainer.devices={devices} is not the launcher's processes per node "
                          f"(RANK={rank}, LOCAL_RANK={local})")
    os.environ["NODE_RANK"] = str(node)


def _share_reports(report: dict, out_dir: Path, rank: int) -> bool:
    """Across nodes the run directory may not be shared: rank 0 gathers every report.

    Returns True when rank 0 now holds every rank's report (the other ranks then leave the
    summary to it instead of waiting for reports that never reach their own directory)."""
    import torch.distributed as dist

    from easgd_lightning.cli.summary import rank_file
    from easgd_lightning.comm import ops
    from easgd_lightning.utils.atomic import atomic_write_json

    if not (dist.is_available() and dist.is_initialized()):
        return False
    reports = ops.all_gather_object(report)
    if rank == 0:
        for r, rep in enumerate(reports):
            if rep is not None and not rank_file(out_dir, r).exists():
                atomic_write_json(rank_file(out_dir, r), rep)
    return all(rep is not None for rep in reports)


def _output_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        return HydraConfig.get().mode == RunMode.MULTIRUN
    except ValueError:
        return False


def _launch_local(cfg_yaml: str, out_dir: Path, world: int, timeout_s: float, run_id: str,
                  signals: launch.LauncherSignals, start_method: str = "spawn",
                  preload: list[str] | None = None) -> tuple[str, str | None, dict]:
    """Start and watch the local ranks; returns (status, error, summary fields of the launch)."""
    from easgd_lightning.utils.atomic import atomic_write_text

    cfg_file = out_dir / "ranks" / "config.yaml"
    atomic_write_text(cfg_file, cfg_yaml)
    log.info("launching %d worker processes -> %s (run id %s)", world, out_dir, run_id)
    outcome = launch.spawn_and_supervise(cfg_file, out_dir, world, timeout_s, run_id, signals,
                                         start_method=start_method, preload=preload)
    for path in launch.remove_stray_temp_files(out_dir):  # every process of the run has ended
        log.warning("removed %s, left by an interrupted write", path)
    first = outcome.first_failure
    fields = {
        "exit_codes": outcome.exit_codes,
        "first_failure": {k: v for k, v in first.items() if k not in ("after_interrupt",)} if first else None,
        "killed_ranks": outcome.killed_ranks,
        "interrupted_by": signal.Signals(outcome.interrupted_by).name if outcome.interrupted_by else None,
        # ranks the run went on without (a dropped parameter-server worker): not a failure
        "ft": {"lost_ranks": launch.lost_rank_records(outcome)},
    }
    if outcome.interrupted_by is not None:
        return "failed", f"interrupted by {fields['interrupted_by']}", fields
    if outcome.failed_ranks:
        return "failed", launch.failure_message(first, outcome.exit_codes) or f"worker exit codes {outcome.exit_codes}", fields
    return "ok", None, fields


def _wait_for_rank_files(out_dir: Path, world: int, timeout_s: float) -> None:
    from easgd_lightning.cli.summary import rank_file

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(rank_file(out_dir, r).exists() for r in range(world)):
            return
        time.sleep(0.2)


#: run directories ``main`` claimed before Hydra ran (resolved path -> run id): Hydra writes
#: ``.hydra/`` only into a directory this process holds (README, "Signals, exit codes and
#: run directories"); :func:`train` takes the claim over
_PRECLAIMED: dict[str, str] = {}


def _diverged(reports: list[dict | None]) -> tuple[int, dict] | None:
    """(rank, report) of the rank whose loss diverged first (guards.NonFiniteLossError),
    else None."""
    hits = [(r, rep) for r, rep in enumerate(reports) if rep and rep.get("diverged_at_step") is not None]
    return min(hits, key=lambda hit: (hit[1]["diverged_at_step"], hit[0])) if hits else None


def _diverged_status(reports: list[dict | None], status: str, error: str | None) -> tuple[str, str | None]:
    """``status: diverged`` for a run that failed because a loss became NaN / inf or
    exploded (``loss_explosion_factor``), naming the step and the rank."""
    hit = _diverged(reports)
    if hit is None or status == "ok":
        return status, error
    rank, rep = hit
    message = str(rep.get("error") or "").removeprefix("NonFiniteLossError: ")
    return "diverged", f"diverged at step {rep['diverged_at_step']} (rank {rank}): {message}"


def train(cfg: DictConfig, out_dir: Path | None = None) -> dict[str, Any]:
    """Validate, launch, merge; returns the summary dict (also written to summary.json).

    Raises:
        ConfigError: a bad configuration value (nothing was started), or the run
            directory is held by another live run.
    """
    apply_renames(cfg)  # a config file of the user's own may use a key's name before 0.2
    out_dir = Path(out_dir) if out_dir is not None else _output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    if _external_rank_world() is not None:
        return _train_as_rank(cfg, out_dir)
    run_id = _PRECLAIMED.pop(str(out_dir.resolve()), None)  # main() holds it already
    if run_id is None:
        run_id = launch.new_run_id()
        try:
            launch.claim_run_dir(out_dir, run_id)
        except launch.RunDirInUse as err:
            raise ConfigError(str(err)) from None
    try:
        with launch.LauncherSignals() as signals:
            return _train_local(cfg, out_dir, run_id, signals)
    finally:
        launch.release_run_dir(out_dir)


def _train_local(cfg: DictConfig, out_dir: Path, run_id: str, signals: launch.LauncherSignals) -> dict[str, Any]:
    notes = validate_config(cfg) or {}
    resolved = OmegaConf.to_container(cfg, resolve=True)
    world = int(cfg.trainer.devices) * int(cfg.trainer.get("num_nodes", 1))
    timeout_s = float(cfg.get("timeout_s", 300))
    if int(cfg.trainer.get("num_nodes", 1)) != 1:
        raise ConfigError(
            "trainer.num_nodes > 1 needs an external launcher (torchrun, SLURM/submitit, "
            "deepspeed): see the README section 'Launching across nodes'"
        )
    if signals.received:  # interrupted while validating: start nothing
        status, error, fields = "failed", f"interrupted by {signal.Signals(signals.first).name}", {
            "interrupted_by": signal.Signals(signals.first).name, "exit_codes": [], "first_failure": None,
            "killed_ranks": []}
    else:
        cfg_yaml = OmegaConf.to_yaml(OmegaConf.create(resolved))
        if ft.enabled(cfg):  # restarts, a lighthouse, the ft summary: easgd_lightning/ft/launch.py
            from easgd_lightning.ft.external import check_own_launcher
            from easgd_lightning.ft.launch import train_local_ft

            check_own_launcher(cfg)

            return train_local_ft(cfg, resolved, cfg_yaml, out_dir, world, timeout_s, run_id, signals,
                                  launch.resolve_start_method(cfg), launch.preload_modules(cfg))
        status, error, fields = _launch_local(cfg_yaml, out_dir, world, timeout_s, run_id, signals,
                                              launch.resolve_start_method(cfg), launch.preload_modules(cfg))
    reports = read_rank_reports(out_dir, world, run_id)
    lost = [rec["rank"] for rec in fields.get("ft", {}).get("lost_ranks", [])]
    if status == "ok" and lost and not any(r and r.get("status") == "ok" and r.get("role", "worker") == "worker"
                                           for r in reports):
        status, error = "failed", f"every worker was lost (ranks {lost})"
    if any((r is None or r.get("status") != "ok") and i not in lost for i, r in enumerate(reports)) and status == "ok":
        status, error = "failed", "some ranks did not report"
    if not fields.get("interrupted_by"):
        status, error = _diverged_status(reports, status, error)
    summary = build_summary(resolved, reports, status=status, error=error, lost=lost)
    summary.update(run_id=run_id, resume=notes.get("resume"), **fields)
    path = write_summary(out_dir, summary)
    log.info("summary: %s (val_acc=%s, wall=%.1fs)", path, summary["val_acc"], summary["wall_time_s"])
    return summary


def _train_as_rank(cfg: DictConfig, out_dir: Path) -> dict[str, Any]:
    """This process is one rank of an externally launched run (torchrun, SLURM).

    Every rank writes its outcome (``ranks/rankR.json``, also when it fails), then waits,
    bounded, for the others'. The summary is written by the lowest rank that reported --
    global rank 0 unless it died without a word -- and names the first failure
    (:func:`launch.first_failure_of_reports`); a failed rank re-raises its error after that.
    Under ``ft=torchft`` each process is one worker of its own (ft/external.py).
    """
    notes = validate_config(cfg) or {}
    if ft.enabled(cfg):  # one worker (replica group) per torchrun / SLURM task: easgd_lightning/ft/external.py
        from easgd_lightning.ft.external import train_as_replica

        return train_as_replica(cfg, out_dir)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    timeout_s = float(cfg.get("timeout_s", 300))
    rank, world = _external_rank_world()
    if "RANK" in os.environ and isinstance(cfg.trainer.get("devices"), int):
        _set_node_rank(cfg.trainer.devices)
    started = time.time()
    failure: BaseException | None = None
    try:
        report = run_worker(cfg, out_dir)  # on failure it has written this rank's report
    except BaseException as err:  # noqa: BLE001 -- re-raised below, after the summary
        failure = err
    gathered = False
    if failure is None and int(cfg.trainer.get("num_nodes", 1)) > 1:
        gathered = _share_reports(report, out_dir, rank)
    close_process_group()  # the last collective is done (issue 14: an abort at exit)
    if gathered and rank != 0:  # rank 0 has every report: one summary, on its node
        return {}
    summary = _summarize_external_run(resolved, out_dir, rank, world, started, _report_wait_s(timeout_s),
                                      resume=notes.get("resume"))
    if failure is not None:
        raise failure
    return summary


def _report_wait_s(timeout_s: float) -> float:
    """How long a rank waits for the others' reports: ``timeout_s`` (a peer stuck in a
    collective fails within it), or half the stop grace when this rank is stopping on a
    signal (its own deadline ends the process at the full grace)."""
    from easgd_lightning.utils import stop

    if stop.stop_signal() is not None:
        return max(1.0, stop.grace_s() / 2)
    return timeout_s


def _summarize_external_run(resolved: dict, out_dir: Path, rank: int, world: int, started: float,
                            wait_s: float, resume: dict | None = None) -> dict[str, Any]:
    """Write ``summary.json`` if this rank is the lowest that reported; returns it ({} if not)."""
    from easgd_lightning.cli.summary import rank_file

    run_id = current_run_id()
    _wait_for_rank_files(out_dir, world, wait_s)
    reports = read_rank_reports(out_dir, world, run_id)
    reporters = [r for r, rep in enumerate(reports) if rep is not None]
    if not rank_file(out_dir, rank).exists() or (reporters and reporters[0] != rank):
        return {}
    first = launch.first_failure_of_reports(reports, started)
    status, error = "ok", None
    if first is not None:
        status, error = "failed", launch.failure_message(first, None)
    if not any(rep and rep.get("signal") for rep in reports):
        status, error = _diverged_status(reports, status, error)
    summary = build_summary(resolved, reports, status=status, error=error)
    summary.update(run_id=run_id, first_failure=first, resume=resume)
    path = write_summary(out_dir, summary)
    log.info("summary: %s (val_acc=%s, wall=%.1fs)", path, summary["val_acc"], summary["wall_time_s"])
    return summary


def _fail(out_dir: Path, cfg: DictConfig, message: str) -> None:
    if launch.held_by_another_run(out_dir):  # never overwrite the summary of a live run
        return
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # pragma: no cover - an unresolvable config still gets a summary
        resolved = {}
    write_summary(out_dir, build_summary(resolved, [], status="failed", error=message))


@hydra.main(config_path=CONF_PATH, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    out_dir = _output_dir()
    multirun = _is_multirun()
    if multirun:
        _SWEEP_JOBS.append(out_dir)
    try:
        summary = train(cfg, out_dir)
    except ConfigError as err:
        print(f"easgd-train: error: {err}", file=sys.stderr, flush=True)
        _fail(out_dir, cfg, str(err))
        if multirun:
            return None
        sys.exit(2)
    except Exception as err:  # a failing job must not lose a sweep's other results
        if not multirun:
            raise
        print(f"easgd-train: job failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        traceback.print_exc()
        _fail(out_dir, cfg, f"{type(err).__name__}: {err}")
        return None
    if summary and summary.get("interrupted_by"):  # a signal ends a sweep too: 128 + N
        print(f"easgd-train: {summary.get('error')}", file=sys.stderr, flush=True)
        sys.exit(128 + signal.Signals[summary["interrupted_by"]].value)
    if summary and summary.get("status") != "ok" and not multirun and not _externally_launched():
        what = "diverged" if summary.get("status") == "diverged" else "failed"
        print(f"easgd-train: run {what}: {summary.get('error')}", file=sys.stderr, flush=True)
        sys.exit(1)
    from easgd_lightning.cli.search import objective

    return objective(cfg.get("search"), summary)




def _failed_sweep_jobs(job_dirs: list[Path]) -> list[str]:
    """'DIR: error' for each job whose summary.json is missing or not ``ok``."""
    failed = []
    for job in job_dirs:
        try:
            summary = json.loads((job / "summary.json").read_text())
        except (OSError, ValueError):
            failed.append(f"{job.name}: no summary.json")
            continue
        if summary.get("status") != "ok":
            failed.append(f"{job.name}: {summary.get('error')}")
    return failed


def _exit_if_sweep_failed() -> None:
    """After a multirun sweep (all jobs done): exit 1 naming the jobs that failed."""
    failed = _failed_sweep_jobs(_SWEEP_JOBS)
    if failed:
        print(f"easgd-train: {len(failed)} of {len(_SWEEP_JOBS)} sweep jobs failed: " + "; ".join(failed),
              file=sys.stderr, flush=True)
        sys.exit(1)


_PLAIN_PATH = re.compile(r"[\w./+%@-]+")


def _override_value(value: str) -> str:
    """``value`` as a Hydra override value (quoted unless it is a plain path)."""
    if _PLAIN_PATH.fullmatch(value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _pin(argv: list[str], key: str, value: str) -> list[str]:
    """``argv`` with ``key=value`` as the only override of ``key`` (``${now:...}`` would be
    resolved again, later, by Hydra's run: the directory checked must be the one used)."""
    return [a for a in argv if a.split("=", 1)[0] != key] + [f"{key}={_override_value(value)}"]


def check_dir_usable(key: str, value: str | None, *, probe: bool = True) -> Path:
    """``hydra.run.dir`` / ``hydra.sweep.dir`` is a directory this run can create and write.

    Rules: not empty (Hydra would use the current directory: summary.json, checkpoints/ and
    ranks/ among the user's files); the path at most 4095 bytes and every name in it at
    most 255 (Linux's PATH_MAX and NAME_MAX); created here when missing (its parents too);
    ``probe``: a file can be created in it (not immutable, not under /proc or on a read-only
    file system). Returns the absolute path.

    Raises:
        ConfigError: one line naming the key and what is wrong.
    """
    if value is None or not str(value).strip():
        raise ConfigError(
            f"{key}: is empty; give the run a directory of its own, e.g. {key}=outputs/my-run (an empty one "
            "would put summary.json, checkpoints/ and ranks/ into the current directory)"
        )
    path = Path(value).absolute()
    size = len(os.fsencode(str(path)))
    if size > 4095:
        raise ConfigError(f"{key}: the path is {size} bytes long; Linux allows at most 4095 (PATH_MAX)")
    for part in path.parts:
        if len(os.fsencode(part)) > 255:
            raise ConfigError(
                f"{key}: the name {part[:24]}... in it is {len(os.fsencode(part))} bytes long; Linux allows at "
                "most 255 per name (NAME_MAX)"
            )
    shown = f"{key}={value}"
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{shown}: is a file, not a directory; give the run a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{shown}: cannot be created ({err.strerror or err}); give the run a writable directory") from None
    if probe:
        test = path / f".easgd-write-test-{os.getpid()}"
        try:
            os.close(os.open(test, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            os.unlink(test)
        except OSError as err:
            raise ConfigError(
                f"{shown}: no file can be created in it ({err.strerror or err}); give the run a writable directory"
            ) from None
    return path


def _live_run_under(sweep_dir: Path) -> Path | None:
    """A job directory of ``sweep_dir`` that a live run holds (its run.lock), else None."""
    if not sweep_dir.is_dir():
        return None
    for lock in sorted(sweep_dir.glob(f"*/{launch.LOCK_NAME}")):
        if launch.held_by_another_run(lock.parent):
            return lock.parent
    return None


def before_hydra(argv: list[str], composed: list[tuple[list[str], DictConfig]]) -> list[str]:
    """What ``main`` checks after the command line and before Hydra writes anything.

    * a sweep (``-m``) run by this process: every job's values (``validate_config``), so a
      bad job stops the sweep before its first job trains;
    * the run directory (:func:`check_dir_usable`); for a single run launched here it is
      also claimed (``run.lock``): a directory a live run holds is refused before Hydra
      writes ``.hydra/`` into it, and Hydra then uses exactly the directory claimed.

    Returns:
        ``argv`` for Hydra (the run or sweep directory pinned when it was an interpolation).

    Raises:
        ConfigError: one line naming the key (for a sweep, also the job).
    """
    from easgd_lightning.cli.overrides import hydra_settings

    settings = hydra_settings(argv, conf_dir=CONF_DIR)
    if settings is None or not settings["runs"]:
        return argv
    if settings["multirun"]:
        if settings["launcher"] in (None, "basic"):  # every job runs on this machine, one after the other
            for i, (job, cfg) in enumerate(composed):
                try:
                    validate_config(cfg)
                except ConfigError as err:
                    raise ConfigError(f"{err} (sweep job {i}: {' '.join(job) or 'the defaults'}; no job was started)") from None
        sweep = Path(settings["sweep_dir"] or "").absolute()
        live = _live_run_under(sweep) if settings["sweep_dir"] else None
        if live is not None:
            raise ConfigError(f"hydra.sweep.dir={settings['sweep_dir']} is in use by a live run ({live}); "
                              "give this sweep its own hydra.sweep.dir")
        check_dir_usable("hydra.sweep.dir", settings["sweep_dir"])
        if settings["sweep_dir_raw"] != settings["sweep_dir"]:
            argv = _pin(argv, "hydra.sweep.dir", str(sweep))
        return argv
    launched_here = not _externally_launched()
    path = check_dir_usable("hydra.run.dir", settings["run_dir"], probe=not launched_here)
    if not launched_here:  # every rank of torchrun / SLURM runs main(): no lock (train.py doc)
        return argv
    run_id = launch.new_run_id()
    try:
        launch.claim_run_dir(path, run_id)
    except launch.RunDirInUse as err:
        raise ConfigError(str(err)) from None
    except OSError as err:
        raise ConfigError(f"hydra.run.dir={settings['run_dir']}: no file can be created in it "
                          f"({err.strerror or err}); give the run a writable directory") from None
    _PRECLAIMED[str(path.resolve())] = run_id
    if settings["run_dir_raw"] != settings["run_dir"]:
        argv = _pin(argv, "hydra.run.dir", str(path))
    return argv


def main() -> None:
    """Console entry point: the command line is checked against the config tree before Hydra
    runs it (unknown keys and options, bad overrides, YAML errors: one line, exit 2), then
    :func:`before_hydra` (a sweep's every job, the run directory and its lock)."""
    from easgd_lightning.cli.overrides import check_command_line

    freeze_at_exit()  # the launcher's (or an external rank's) exit: no shutdown collection
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    composed: list = []
    try:
        sys.argv[1:] = check_command_line(sys.argv[1:], conf_dir=CONF_DIR, composed=composed)  # renamed keys: new names
    except ConfigError as err:
        print(f"easgd-train: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    if _externally_launched():
        _end_rank_process(_run_hydra, composed)
    forkserver.start_server()  # ranks forked from here (cli/forkserver.py): before Hydra, threads, torch ops, the lock
    _run_hydra(composed)


def _run_hydra(composed: list) -> None:
    try:
        sys.argv[1:] = before_hydra(sys.argv[1:], composed)
    except ConfigError as err:
        print(f"easgd-train: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        _hydra_main()
    finally:
        for held in list(_PRECLAIMED):  # a claim no job took over (Hydra stopped first)
            _PRECLAIMED.pop(held, None)
            launch.release_run_dir(Path(held))
    _exit_if_sweep_failed()


def exit_status(code: object) -> int:
    """The process exit status ``sys.exit(code)`` gives: None is 0, an int itself, anything
    else (a message, printed by the caller) 1."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _end_rank_process(run: Any, *args: Any) -> None:
    """Run ``run(*args)`` as an externally launched rank, then end the process with
    :func:`~easgd_lightning.utils.procs.exit_now`: exit handlers (the process group's
    destruction, log and wandb flushes) run, the interpreter's finalization does not.

    A rank left to finalize sometimes aborted at exit ("terminate called without an active
    exception": SIGABRT after its report and the summary were written) in the suite's
    two-host ``pipeline_3d`` launches under ``torchrun`` and DeepSpeed's launcher, which count
    the exit -6 as a failed run; the ranks ``easgd-train`` forks end this way and never did."""
    try:
        run(*args)
        code = 0
    except SystemExit as err:
        code = exit_status(err.code)
        if not isinstance(err.code, int | None):
            print(err.code, file=sys.stderr)
    exit_now(code)


if __name__ == "__main__":
    main()
