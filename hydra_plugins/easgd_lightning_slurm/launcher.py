"""``hydra/launcher=slurm``: Hydra's submitit SLURM launcher, with a sweep that goes on past
a job SLURM ended (``scancel``, time limit, lost node) and job states read from ``squeue``,
so it works on clusters without accounting (no slurmdbd, where ``sacct`` has no answer).

Everything else is the plugin's own (hydra-submitit-launcher >= 1.2, the ``slurm`` extra):
the same parameters (``SlurmQueueConf``), one SLURM job array per sweep, each job run by
submitit in each of its tasks. A job that ended without a result gets a failed
``summary.json`` (:mod:`easgd_lightning.cli.slurm`); every job's directory is registered
so that ``easgd-train`` exits 1 naming the failed ones after the sweep, as local sweeps do.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)

_INSTALL = "hydra/launcher=slurm needs hydra-submitit-launcher: pip install 'easgd-lightning[slurm]'"


class SlurmLauncher(Launcher):
    """Hydra's submitit ``SlurmLauncher`` (the callable each task runs), launched and
    collected here."""

    def __init__(self, **params: Any) -> None:
        try:
            from hydra_plugins.hydra_submitit_launcher.submitit_launcher import (
                SlurmLauncher as SubmititSlurmLauncher,
            )
        except ImportError as err:
            raise ImportError(f"{_INSTALL} ({err})") from None
        self.submitit = SubmititSlurmLauncher(**params)
        self.params = self.submitit.params
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.submitit.setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.config, self.hydra_context = config, hydra_context

    def _executor(self):
        """submitit's SLURM executor with the plugin's parameters (as the plugin builds it)."""
        import submitit
        from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

        params = dict(self.params)
        executor = submitit.AutoExecutor(cluster="slurm", folder=params.pop("submitit_folder"),
                                         slurm_max_num_timeout=params.pop("max_num_timeout"))
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
        return executor

    def _job_config(self, overrides: Sequence[str], idx: int, job_id: str) -> tuple[DictConfig, Path]:
        """The job's config and output directory, as the job itself computes them."""
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.id = job_id
            cfg.hydra.job.num = idx
        saved = HydraConfig.instance().cfg
        try:
            HydraConfig.instance().set_config(cfg)
            job_dir = Path(str(cfg.hydra.sweep.dir)) / str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
        finally:
            HydraConfig.instance().cfg = saved
        return cfg, job_dir

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from easgd_lightning.cli.slurm import collect, record_failed_job
        from easgd_lightning.cli.summary import SWEEP_JOBS

        assert self.config is not None and self.hydra_context is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info(f"Submitit 'slurm' sweep output dir : {sweep_dir}")
        job_params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        jobs = self._executor().map_array(self.submitit, *zip(*job_params))
        log.info("SLURM job(s) %s", ", ".join(j.job_id for j in jobs))
        returns: list[JobReturn] = []
        for i, (job, outcome) in enumerate(zip(jobs, collect(jobs))):
            idx = initial_job_idx + i
            cfg, job_dir = self._job_config(job_overrides[i], idx, job.job_id)
            SWEEP_JOBS.append(job_dir)
            if outcome.error is None:
                returns.append(outcome.result)
                continue
            log.error("job #%d: %s", idx, outcome.error)
            task_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
            record_failed_job(job_dir, task_cfg, outcome.error)
            returns.append(JobReturn(overrides=list(job_overrides[i]), cfg=task_cfg, hydra_cfg=cfg,
                                     working_dir=str(job_dir), task_name=str(cfg.hydra.job.name),
                                     status=JobStatus.COMPLETED, _return_value=None))
        return returns
