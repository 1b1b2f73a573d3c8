"""One rank of an ``easgd-train`` run: build everything from the config, fit, report.

Each rank writes ``<run dir>/ranks/rank<R>.json`` atomically (also when it fails or is
stopped, with the reason); the launching process (or global rank 0 under an external
launcher) merges them into ``summary.json``. Reports carry the run id (``EASGD_RUN_ID``)
so a merge never takes another run's report.

Exit status of a rank: 0 done; 128 + N when it received signal N (SIGTERM: 143, SIGINT:
130) and stopped; 1 for any other failure (including being stopped because another rank
was signalled).

Run as ``python -m easgd_lightning.cli.worker CONFIG.yaml RUN_DIR`` by the local launcher
(``cli/train.py``), which sets the rank's environment, or forked by its fork server
(``cli/forkserver.py``), which calls :func:`worker_main` the same way.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from easgd_lightning.cli.summary import current_run_id, rank_file, read_rank_reports, report_run_id
from easgd_lightning.utils import stop
from easgd_lightning.utils.atomic import atomic_write_json
from easgd_lightning.utils.procs import freeze_at_exit

__all__ = [
    "run_worker", "worker_main", "rank_file", "read_rank_reports", "run_identity", "current_run_id",
]

log = logging.getLogger(__name__)


def _sweep_dir(out_dir: Path) -> Path | None:
    """The multirun sweep directory holding ``out_dir`` (Hydra writes multirun.yaml there)."""
    for parent in out_dir.resolve().parents:
        if (parent / "multirun.yaml").is_file():
            return parent
    return None


def run_identity(cfg, out_dir: str | Path) -> tuple[str, str | None]:
    """(run name, group) for experiment loggers.

    The name is ``run_name`` when set, else the job's command-line overrides (Hydra's
    ``.hydra/overrides.yaml`` in the run directory) joined by commas, else the directory
    name. The group is ``logger.group`` when set, else, for a job of a multirun sweep, the
    sweep directory's name, so every sweep is one group; single runs have no group.
    """
    out_dir = Path(out_dir)
    name = cfg.get("run_name")
    if not name:
        overrides_file = out_dir / ".hydra" / "overrides.yaml"
        overrides: list = []
        if overrides_file.is_file():
            import yaml

            try:
                overrides = list(yaml.safe_load(overrides_file.read_text()) or [])
            except (OSError, yaml.YAMLError):
                overrides = []
        name = ",".join(str(o) for o in overrides) or out_dir.name
    group = cfg.logger.get("group") if "logger" in cfg else None
    if not group:
        sweep = _sweep_dir(out_dir)
        group = sweep.name if sweep is not None else None
    return str(name), group


def _make_logger(cfg, out_dir: Path):
    name = cfg.logger.name
    if name == "none":
        return False
    if name == "csv":
        from pytorch_lightning.loggers import CSVLogger

        return CSVLogger(save_dir=str(out_dir), name="csv", version="")
    if name == "tensorboard":
        from pytorch_lightning.loggers import TensorBoardLogger

        return TensorBoardLogger(save_dir=str(out_dir), name="tensorboard", version="", default_hp_metric=False)
    from pytorch_lightning.loggers import WandbLogger

    os.environ.setdefault("WANDB_SILENT", "true")
    mode = cfg.logger.get("mode", "offline")
    run_name, group = run_identity(cfg, out_dir)
    from easgd_lightning.compat.lightning import drop_wandb_anonymous

    return drop_wandb_anonymous(WandbLogger(
        project=cfg.logger.get("project", "easgd-lightning"),
        name=run_name,
        group=group,
        tags=list(cfg.logger.get("tags") or []),
        save_dir=str(out_dir),
        offline=mode == "offline",
        mode=mode,
        config=cfg_to_dict(cfg),
    ))


def cfg_to_dict(cfg) -> dict:
    from omegaconf import DictConfig, OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def _train_loss_on_shard(module, dm, rank: int, world: int) -> tuple[float, int]:
    """Sum of per-sample losses of the evaluated model over this rank's shard of the train set."""
    import torch

    loader_fn = getattr(dm, "train_eval_dataloader", None)
    if loader_fn is None:
        return 0.0, 0
    module.eval()
    total, count = 0.0, 0
    device = next(module.parameters()).device
    dtype = next(module.parameters()).dtype
    with torch.no_grad():
        for i, batch in enumerate(loader_fn()):
            if i % world != rank:
                continue
            x, y = batch
            x = x.to(device)
            if x.is_floating_point():
                x = x.to(dtype)
            loss, _, n = module.loss_and_correct((x, y.to(device)))
            total += float(loss) * n
            count += n
    return total, count


def run_worker(cfg, out_dir: str | Path) -> dict:
    """Train on this rank (rank/world from the environment) and write its report."""
    import pytorch_lightning as pl

    import easgd_lightning  # noqa: F401  (registers strategy names)
    from easgd_lightning.cli.build import build_model_and_data, build_strategy
    from easgd_lightning.cli.trainer_config import build_trainer
    from easgd_lightning.comm import reset_meter
    from easgd_lightning.utils.checkpoint_io import VerifiedCheckpointIO
    from easgd_lightning.utils.quiet import quiet_third_party

    quiet_third_party()
    out_dir = Path(out_dir)
    ft_ctx, late = _prepare_ft(cfg, out_dir)
    rank = int(os.environ.get("RANK", "0"))
    _set_threads(cfg)
    meter = reset_meter()
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    module, dm = build_model_and_data(cfg)
    strategy = _with_ft(cfg, build_strategy(cfg), ft_ctx, late)
    callbacks, stopper, val_history, train_clock = _callbacks(cfg, out_dir, late)
    trainer = build_trainer(  # every trainer key is a Trainer argument (cli/trainer_config.py)
        cfg,
        strategy=strategy,
        logger=_make_logger(cfg, out_dir),
        callbacks=callbacks,
        plugins=[VerifiedCheckpointIO()],  # atomic writes, checksum verified on load
        enable_checkpointing=bool(cfg.checkpoint.enabled),  # else Lightning adds its own
        default_root_dir=str(out_dir),
    )
    stopper.attach(trainer)
    try:
        return _fit_and_report(cfg, out_dir, rank, trainer, module, dm, strategy, meter, val_history, stopper, train_clock)
    except BaseException as err:
        _write_failure_report(out_dir, trainer.global_rank, err, stopper,
                              measured=_measured_so_far(val_history))
        signum = stop.stop_signal()
        if signum is not None:  # this rank was signalled: 128 + N, whatever it was doing
            raise SystemExit(stop.exit_code_for(signum)) from err
        if isinstance(err, SystemExit) and not err.code:  # stopped by another rank's signal
            raise SystemExit(1) from err
        raise


def _prepare_ft(cfg, out_dir: Path) -> tuple[Any, Any]:
    """(ft context, late start) of this worker under ``ft=torchft`` ((None, None) without):
    a restarted worker that a server re-admits gets a late start (strategies/ps/rejoin.py);
    otherwise the worker is its own replica group (easgd_lightning/ft/worker.py)."""
    from easgd_lightning import ft
    from easgd_lightning.ft.config import rejoins_natively

    if ft.enabled(cfg) and rejoins_natively(cfg):
        from easgd_lightning.ft.worker import ENV_ATTEMPT
        from easgd_lightning.strategies.ps.rejoin import prepare_late_start

        return None, prepare_late_start(cfg, str(out_dir), int(os.environ.get(ENV_ATTEMPT, "0")))
    if ft.enabled(cfg):
        from easgd_lightning.ft.worker import prepare

        return prepare(cfg, str(out_dir)), None
    return None, None


def _with_ft(cfg, strategy, ft_ctx, late):
    """``strategy`` under ``ft=torchft``: wrapped for its replica group, or told it may be a
    late start; as it is without ft."""
    from easgd_lightning import ft

    if ft_ctx is not None:
        from easgd_lightning.ft.strategies import attach

        return attach(strategy, ft_ctx)
    if ft.enabled(cfg):
        strategy.enable_rejoin(late)
    return strategy


def _set_threads(cfg) -> None:
    """``threads_per_process`` (null: ``$OMP_NUM_THREADS``, else 1) torch threads, and the
    same for the processes this rank starts (data loaders)."""
    import torch

    threads = cfg.get("threads_per_process") or int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(int(threads))


def _callbacks(cfg, out_dir: Path, late) -> tuple[list, Any, Any, Any]:
    """(the Trainer's callbacks, the signal stopper, the validation history, the train clock)."""
    from easgd_lightning.callbacks import (
        CommMetricsCallback,
        EpochPrinter,
        FaultInjectionCallback,
        SignalStop,
        TrainClockCallback,
        ValHistoryCallback,
    )
    from easgd_lightning.guards import NaNFaultInjection, NonFiniteLossGuard

    val_history = ValHistoryCallback()
    train_clock = TrainClockCallback()
    stopper = SignalStop(str(out_dir / "checkpoints") if cfg.checkpoint.enabled else None)
    callbacks: list = [
        stopper,
        CommMetricsCallback(every=int(cfg.trainer.get("log_every_n_steps", 10))),
        val_history,
        train_clock,
        FaultInjectionCallback(**dict(cfg.get("faults") or {})),
        NonFiniteLossGuard(allow=bool(cfg.get("allow_nonfinite_loss", False)),
                           explosion_factor=cfg.get("loss_explosion_factor")),
        NaNFaultInjection(**dict(cfg.get("faults") or {})),
    ]
    if not cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(EpochPrinter(label=f"{cfg.strategy.name}/{cfg.compression.name}"))
    if cfg.checkpoint.enabled:
        callbacks.append(_checkpoint_callback(cfg, out_dir, late))
    return callbacks, stopper, val_history, train_clock


def _checkpoint_callback(cfg, out_dir: Path, late):
    """Checkpoints every ``checkpoint.every_n_epochs`` into ``out_dir/checkpoints``."""
    from easgd_lightning.callbacks import LastFirstCheckpoint

    return LastFirstCheckpoint(
        dirpath=str(out_dir / "checkpoints"),
        filename="epoch{epoch:03d}",
        auto_insert_metric_name=False,
        save_last=True,
        save_top_k=-1,
        every_n_epochs=int(cfg.checkpoint.every_n_epochs),
        # a restarted worker 0 replaces its first start's files (last.ckpt: the newest center)
        enable_version_counter=late is None,
    )


def _failure_report(rank: int, err: BaseException, stopper) -> dict:
    """What a failed rank says about itself: the error, its signal, whether a peer caused it."""
    from easgd_lightning.cli.launch import is_peer_loss

    signum = stop.stop_signal()
    if signum is not None:
        error = f"interrupted by {signal.Signals(signum).name}"
    elif stopper.signal is not None:
        name = signal.Signals(stopper.signal).name
        error = f"stopped: rank(s) {stopper.signalled_ranks} received {name}"
    else:
        error = f"{type(err).__name__}: {err}"
    return {
        "rank": rank,
        "run_id": current_run_id(),
        "status": "failed",
        "error": error,
        "signal": signal.Signals(signum).name if signum is not None else None,
        # a lost or timed-out peer (launch.is_peer_loss) is a consequence, not a cause
        "peer_error": is_peer_loss(err) or stopper.signal is not None and signum is None,
        "failed_at": time.time(),
        "traceback": traceback.format_exc()[-4000:],
    }


def _measured_so_far(val_history) -> dict:
    """What a failed or stopped rank measured in the epochs that finished: ``val_history``,
    the last validation's ``val_acc`` / ``val_loss`` and ``steps`` at its end (the summary
    keeps them; the interrupted epoch's partial steps are not counted)."""
    history = list(getattr(val_history, "history", []) or [])
    last = history[-1] if history else {}
    return {"val_history": history, "val_acc": last.get("val_acc"), "val_loss": last.get("val_loss"),
            "steps": last.get("step")}


def _write_failure_report(out_dir: Path, rank: int, err: BaseException, stopper, measured: dict | None = None) -> None:
    from easgd_lightning.ft.worker import failure_fields
    from easgd_lightning.guards import NonFiniteLossError

    try:
        report = {**(measured or {}), **_failure_report(rank, err, stopper)}
        report.update(failure_fields(err))  # under ft=torchft: which start it was, and why it ended
        if isinstance(err, NonFiniteLossError) and stop.stop_signal() is None:
            report["diverged_at_step"] = err.step
        atomic_write_json(rank_file(out_dir, rank), report)
    except Exception:  # pragma: no cover - reporting must not hide the original error
        log.exception("could not write the failure report of rank %d", rank)


def _fit_and_report(cfg, out_dir: Path, rank: int, trainer, module, dm, strategy, meter, val_history, stopper,
                    train_clock) -> dict:
    start = time.perf_counter()
    trainer.fit(module, datamodule=dm, ckpt_path=cfg.checkpoint.get("resume"))
    wall = time.perf_counter() - start
    comm = meter.snapshot()
    steps = int(getattr(strategy, "local_steps", trainer.global_step))
    extras = strategy.summary_extras() if hasattr(strategy, "summary_extras") else {}
    extras = {**extras, "run": _run_info(cfg, trainer, module, dm)}
    role = extras.get("role", "worker")
    val_metrics: dict = {}
    if getattr(strategy, "supports_final_validate", True):
        results = trainer.validate(module, datamodule=dm, verbose=False)
        val_metrics = results[0] if results else {}
    world = trainer.world_size
    loss_sum, loss_n = _train_loss_on_shard(module, dm, trainer.global_rank, world)
    batch = int(cfg.data.get("batch_size", 1))
    report = {
        "rank": trainer.global_rank,
        "role": role,
        "steps": steps,
        "wall_time_s": wall,
        "train_time_s": train_clock.train_time_s,
        "train_cpu": train_clock.train_cpu,
        # a rank counts samples when it consumes its own data (not a server, and for
        # pipeline/tensor parallelism only one rank per data-parallel replica)
        "samples": steps * batch if role != "server" and extras.get("counts_samples", True) else 0,
        "comm": comm,
        "train_loss_sum": loss_sum,
        "train_loss_count": loss_n,
        "val_loss": val_metrics.get("val/loss"),
        "val_acc": val_metrics.get("val/acc"),
        "val_history": val_history.history,
        "extras": extras,
        "run_id": current_run_id(),
        "status": "ok",
    }
    if stop.stop_signal() is not None:  # signalled after training: still a stop, say so
        raise SystemExit(stop.exit_code_for(stop.stop_signal()))
    atomic_write_json(rank_file(out_dir, trainer.global_rank), report)
    if rank == 0 and hasattr(trainer.logger, "experiment") and cfg.logger.name == "wandb":
        try:
            trainer.logger.experiment.finish()
        except Exception:  # pragma: no cover - logging must not fail a run
            log.debug("wandb finish failed", exc_info=True)
    return report


def _run_info(cfg, trainer, module, dm) -> dict:
    """What this rank actually trained with: model, batch, optimizer, schedule, precision."""
    import torch

    info: dict[str, Any] = {
        "module_class": type(module).__name__,
        "model_class": type(getattr(module, "net", module)).__name__,
        "num_parameters": int(sum(p.numel() for p in module.parameters())),
        "datamodule_class": type(dm).__name__,
        "batch_size": getattr(dm, "batch_size", None),
        "num_classes": getattr(dm, "num_classes", None),
        "image_size": getattr(dm, "image_size", None),
        "precision": str(trainer.precision),
        "accelerator": type(trainer.accelerator).__name__,
        "torch_threads": torch.get_num_threads(),
        "channels_last": bool(dict(getattr(module, "hparams", {}) or {}).get("channels_last", False)),
        "schedule": dict(getattr(module, "resolved_schedule", {}) or {}),
    }
    try:
        backend = trainer.strategy.process_group_backend  # type: ignore[attr-defined]
    except AttributeError:
        backend = None
    info["process_group_backend"] = backend
    if trainer.optimizers:
        opt = trainer.optimizers[0]
        group = opt.param_groups[0]
        info.update(
            optimizer=type(opt).__name__,
            lr_final=float(group["lr"]),
            lr_initial=float(group.get("initial_lr", group["lr"])),
            momentum=group.get("momentum"),
            weight_decay=group.get("weight_decay"),
        )
    return info


def _die_with_launcher(launcher_pid: int | None) -> None:
    """Ask Linux to send SIGTERM to this rank when its launcher dies (even by SIGKILL): the
    rank then stops gracefully within the stop grace period. Exit now if it is gone already."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher's own kill is the bound
        pass
    if launcher_pid is not None and os.getppid() != launcher_pid:
        sys.exit(1)


def worker_main(argv: list[str] | None = None) -> None:
    """Entry of a rank started by the local launcher: ``CONFIG.yaml RUN_DIR`` (rank and
    rendezvous in the environment). Signals only set the stop flag from the first line on."""
    stop.install_stop_handlers(stop.grace_s())
    freeze_at_exit()  # a rank's exit: no shutdown collection of torch's and Lightning's objects
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        sys.exit("usage: python -m easgd_lightning.cli.worker CONFIG.yaml RUN_DIR")
    # the process that started this rank: the launcher, or its fork server (cli/forkserver.py)
    launcher = os.environ.get("EASGD_PARENT_PID") or os.environ.get("EASGD_LAUNCHER_PID")
    _die_with_launcher(int(launcher) if launcher else None)
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(args[0])
    rank = int(os.environ.get("RANK", "0"))
    from easgd_lightning.ft.worker import leave_if_quorum_pending

    try:
        run_worker(cfg, args[1])
        from easgd_lightning.comm.ops import close_process_group

        close_process_group()
    except SystemExit as done:
        leave_if_quorum_pending(done.code if isinstance(done.code, int) else 1)
        raise
    except BaseException as err:  # failed before the trainer existed: still say why
        if not rank_file(args[1], rank).exists() or report_run_id(rank_file(args[1], rank)) != current_run_id():
            atomic_write_json(rank_file(args[1], rank), {
                "rank": rank, "run_id": current_run_id(), "status": "failed",
                "error": f"{type(err).__name__}: {err}", "signal": None, "peer_error": False,
                "failed_at": time.time(), "traceback": traceback.format_exc()[-4000:],
            })
        traceback.print_exc()
        signum = stop.stop_signal()
        code = stop.exit_code_for(signum) if signum is not None else 1
        leave_if_quorum_pending(code)
        sys.exit(code)






if __name__ == "__main__":
    worker_main()
