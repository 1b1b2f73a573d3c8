"""easgd-lightning's Hydra launcher plugin (``hydra/launcher=slurm``, ``slurm_gpu``)."""
