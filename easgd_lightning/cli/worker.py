"""One rank of an ``easgd-train`` run: build everything from the config, fit, report.

Each rank writes ``<run dir>/ranks/rank<R>.json`` atomically; the launching process (or
global rank 0 under an external launcher) merges them into ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from pathlib import Path
from typing import Any

from easgd_lightning.utils.atomic import atomic_write_json

__all__ = ["run_worker", "spawn_entry", "rank_file", "run_identity"]

log = logging.getLogger(__name__)


def rank_file(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir) / "ranks" / f"rank{rank}.json"


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
    from pytorch_lightning.loggers import WandbLogger

    os.environ.setdefault("WANDB_SILENT", "true")
    mode = cfg.logger.get("mode", "offline")
    run_name, group = run_identity(cfg, out_dir)
    return WandbLogger(
        project=cfg.logger.get("project", "easgd-lightning"),
        name=run_name,
        group=group,
        tags=list(cfg.logger.get("tags") or []),
        save_dir=str(out_dir),
        offline=mode == "offline",
        mode=mode,
        config=cfg_to_dict(cfg),
    )


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
    import torch
    from pytorch_lightning.callbacks import ModelCheckpoint

    import easgd_lightning  # noqa: F401  (registers strategy names)
    from easgd_lightning.callbacks import (
        CommMetricsCallback,
        EpochPrinter,
        FaultInjectionCallback,
        ValHistoryCallback,
    )
    from easgd_lightning.cli.build import build_model_and_data, build_strategy
    from easgd_lightning.comm import reset_meter
    from easgd_lightning.guards import NaNFaultInjection, NonFiniteLossGuard
    from easgd_lightning.utils.checkpoint import VerifiedCheckpointIO

    out_dir = Path(out_dir)
    rank = int(os.environ.get("RANK", "0"))
    threads = cfg.trainer.get("threads_per_process") or int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for processes this rank starts (loaders)
    torch.set_num_threads(int(threads))
    meter = reset_meter()
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    module, dm = build_model_and_data(cfg)
    strategy = build_strategy(cfg)
    val_history = ValHistoryCallback()
    callbacks: list = [
        CommMetricsCallback(every=int(cfg.trainer.get("log_every_n_steps", 10))),
        val_history,
        FaultInjectionCallback(**dict(cfg.get("faults") or {})),
        NonFiniteLossGuard(allow=bool(cfg.trainer.get("allow_nonfinite_loss", False))),
        NaNFaultInjection(**dict(cfg.get("faults") or {})),
    ]
    if not cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(EpochPrinter(label=f"{cfg.strategy.name}/{cfg.compression.name}"))
    if cfg.checkpoint.enabled:
        callbacks.append(
            ModelCheckpoint(
                dirpath=str(out_dir / "checkpoints"),
                filename="epoch{epoch:03d}",
                auto_insert_metric_name=False,
                save_last=True,
                save_top_k=-1,
                every_n_epochs=int(cfg.checkpoint.every_n_epochs),
            )
        )
    t = cfg.trainer
    trainer_kwargs: dict[str, Any] = dict(
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.get("num_nodes", 1),
        strategy=strategy,
        precision=t.precision,
        max_epochs=t.max_epochs,
        max_steps=t.get("max_steps", -1),
        log_every_n_steps=t.get("log_every_n_steps", 10),
        check_val_every_n_epoch=t.get("check_val_every_n_epoch", 1),
        enable_progress_bar=bool(t.get("enable_progress_bar", True)),
        num_sanity_val_steps=t.get("num_sanity_val_steps", 0),
        accumulate_grad_batches=t.get("accumulate_grad_batches", 1),
        gradient_clip_val=t.get("gradient_clip_val"),
        deterministic=t.get("deterministic", False),
        logger=_make_logger(cfg, out_dir),
        callbacks=callbacks,
        plugins=[VerifiedCheckpointIO()],  # atomic writes, checksum verified on load
        enable_checkpointing=bool(cfg.checkpoint.enabled),  # else Lightning adds its own
        default_root_dir=str(out_dir),
        enable_model_summary=False,
    )
    for key in ("limit_train_batches", "limit_val_batches"):
        if t.get(key) is not None:
            trainer_kwargs[key] = t.get(key)
    trainer = pl.Trainer(**trainer_kwargs)
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
        "status": "ok",
    }
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


def spawn_entry(local_rank: int, cfg_yaml: str, out_dir: str, port: int, world: int) -> None:
    """Entry point of a locally spawned worker (``torch.multiprocessing``)."""
    from omegaconf import OmegaConf

    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(world),
            "NODE_RANK": "0",
        }
    )
    cfg = OmegaConf.create(cfg_yaml)
    try:
        run_worker(cfg, out_dir)
    except BaseException as err:  # record why this rank failed, then re-raise
        atomic_write_json(
            rank_file(out_dir, local_rank),
            {"rank": local_rank, "status": "failed", "error": f"{type(err).__name__}: {err}",
             "traceback": traceback.format_exc()[-4000:]},
        )
        raise


def read_rank_reports(out_dir: str | Path, world: int) -> list[dict | None]:
    reports: list[dict | None] = []
    for r in range(world):
        path = rank_file(out_dir, r)
        reports.append(json.loads(path.read_text()) if path.exists() else None)
    return reports
