"""``easgd-train``: the Hydra main.

* Validates the whole config first; a bad value prints one line naming the key and the
  allowed values and exits with status 2, before any process starts.
* Launch: under an external launcher (``torchrun``, SLURM via submitit, DeepSpeed's
  launcher, the benchmark's namespaces: ``RANK`` and ``WORLD_SIZE`` set) this process is
  one rank. Otherwise it spawns ``trainer.devices`` local workers with
  ``torch.multiprocessing`` and this job's resolved config, so Hydra multirun jobs each
  get their own workers and output directory (Lightning's subprocess launcher, which
  re-runs the command line, is never used).
* Writes ``summary.json`` into the job's output directory; one failing job in a
  multirun sweep is recorded as failed and the sweep goes on.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from easgd_lightning.cli.build import ConfigError, validate_config
from easgd_lightning.cli.resolvers import register_resolvers
from easgd_lightning.cli.summary import build_summary, write_summary
from easgd_lightning.cli.worker import read_rank_reports, run_worker, spawn_entry

__all__ = ["main", "train", "CONF_DIR"]

log = logging.getLogger("easgd_lightning")

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")

register_resolvers()  # ${linear_lr:...}, ${bf16_if_supported:} in recipes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def _share_reports(report: dict, out_dir: Path, rank: int) -> None:
    """Across nodes the run directory may not be shared: rank 0 gathers every report."""
    import torch.distributed as dist

    from easgd_lightning.cli.worker import rank_file
    from easgd_lightning.comm import ops
    from easgd_lightning.utils.atomic import atomic_write_json

    if not (dist.is_available() and dist.is_initialized()):
        return
    reports = ops.all_gather_object(report)
    if rank == 0:
        for r, rep in enumerate(reports):
            if rep is not None and not rank_file(out_dir, r).exists():
                atomic_write_json(rank_file(out_dir, r), rep)


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


def _spawn_local(cfg_yaml: str, out_dir: Path, world: int, timeout_s: float) -> list[int]:
    """Start ``world`` worker processes and wait for them; returns their exit codes.

    When one worker dies, the others get ``timeout_s`` seconds to finish (asynchronous
    strategies go on without it) before they are terminated.
    """
    import torch.multiprocessing as mp

    port = _free_port()
    ctx = mp.start_processes(
        spawn_entry,
        args=(cfg_yaml, str(out_dir), port, world),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    procs = ctx.processes
    first_death: float | None = None
    while any(p.is_alive() for p in procs):
        for p in procs:
            p.join(timeout=0.2)
        dead_bad = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
        if dead_bad and first_death is None:
            first_death = time.monotonic()
            log.warning("a worker exited with code %s; waiting up to %.0fs for the others",
                        dead_bad[0].exitcode, timeout_s)
        if first_death is not None and time.monotonic() - first_death > timeout_s:
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
            break
    return [p.exitcode if p.exitcode is not None else -1 for p in procs]


def _wait_for_rank_files(out_dir: Path, world: int, timeout_s: float) -> None:
    from easgd_lightning.cli.worker import rank_file

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(rank_file(out_dir, r).exists() for r in range(world)):
            return
        time.sleep(0.2)


def train(cfg: DictConfig, out_dir: Path | None = None) -> dict[str, Any]:
    """Validate, launch, merge; returns the summary dict (also written to summary.json).

    Raises:
        ConfigError: a bad configuration value (nothing was started).
    """
    out_dir = Path(out_dir) if out_dir is not None else _output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    validate_config(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    world = int(cfg.trainer.devices) * int(cfg.trainer.get("num_nodes", 1))
    timeout_s = float(cfg.get("timeout_s", 300))
    status, error = "ok", None
    external = _external_rank_world()
    if external is not None:
        rank, world = external
        report = run_worker(cfg, out_dir)
        if int(cfg.trainer.get("num_nodes", 1)) > 1:
            _share_reports(report, out_dir, rank)
        if rank != 0:
            return {}
        _wait_for_rank_files(out_dir, world, timeout_s)
    else:
        if int(cfg.trainer.get("num_nodes", 1)) != 1:
            raise ConfigError(
                "trainer.num_nodes > 1 needs an external launcher (torchrun, SLURM/submitit, "
                "deepspeed): see the README section 'Launching across nodes'"
            )
        cfg_yaml = OmegaConf.to_yaml(OmegaConf.create(resolved))
        log.info("launching %d worker processes -> %s", world, out_dir)
        codes = _spawn_local(cfg_yaml, out_dir, world, timeout_s)
        if any(c != 0 for c in codes):
            status = "failed"
            error = f"worker exit codes {codes}"
    reports = read_rank_reports(out_dir, world)
    if any(r is None or r.get("status") != "ok" for r in reports) and status == "ok":
        status, error = "failed", "some ranks did not report"
    summary = build_summary(resolved, reports, status=status, error=error)
    path = write_summary(out_dir, summary)
    log.info("summary: %s (val_acc=%s, wall=%.1fs)", path, summary["val_acc"], summary["wall_time_s"])
    return summary


def _fail(out_dir: Path, cfg: DictConfig, message: str) -> None:
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # pragma: no cover - an unresolvable config still gets a summary
        resolved = {}
    write_summary(out_dir, build_summary(resolved, [], status="failed", error=message))


@hydra.main(config_path=CONF_DIR, config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    out_dir = _output_dir()
    multirun = _is_multirun()
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
    if summary and summary.get("status") != "ok" and not multirun and not _externally_launched():
        print(f"easgd-train: run failed: {summary.get('error')}", file=sys.stderr, flush=True)
        sys.exit(1)
    return summary.get("val_acc") if summary else None


def main() -> None:
    """Console entry point: the command line is checked against the config tree before Hydra
    runs it (unknown keys and options, bad overrides, YAML errors: one line, exit 2)."""
    from easgd_lightning.cli.overrides import check_command_line

    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        check_command_line(sys.argv[1:], conf_dir=CONF_DIR)
    except ConfigError as err:
        print(f"easgd-train: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    _hydra_main()


if __name__ == "__main__":
    main()
