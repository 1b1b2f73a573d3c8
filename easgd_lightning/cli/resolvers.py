"""OmegaConf resolvers the recipes use; registered when ``easgd_lightning.cli.train`` is imported.

* ``${linear_lr:BASE_LR,BASE_BATCH}``: the linear scaling rule of Goyal et al. 2017
  ("Accurate, Large Minibatch SGD", section 2.1): when the global batch ``k * n`` (per-worker
  ``data.batch_size`` times ``trainer.devices * trainer.num_nodes`` workers) changes, scale the
  learning rate by the same factor: ``lr = BASE_LR * k * n / BASE_BATCH``.
* ``${world_size:}``: ``trainer.devices * trainer.num_nodes``.
* ``${bf16_if_supported:}``: ``bf16-mixed`` when this CPU runs bfloat16 natively (AVX512-BF16
  or AMX), else ``32-true``: bf16 autocast on many-core CPU nodes where it pays off, exact
  fp32 on chips (such as Knights Landing) that would only emulate it.

Resolved once, in the process that composes the config (every node under torchrun or
SLURM composes its own); the resolved values are what ``summary.json`` records.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

__all__ = ["register_resolvers", "linear_scaled_lr", "cpu_bf16_native"]


def linear_scaled_lr(base_lr: float, base_batch: int, global_batch: int) -> float:
    """Linear scaling rule (Goyal et al. 2017): ``base_lr * global_batch / base_batch``.

    Raises:
        ValueError: a non-positive batch.
    """
    if base_batch <= 0 or global_batch <= 0:
        raise ValueError(f"linear_lr: batches must be > 0, got base {base_batch}, global {global_batch}")
    return float(base_lr) * float(global_batch) / float(base_batch)


def cpu_bf16_native() -> bool:
    """True when the CPU has native bfloat16 arithmetic (AVX512-BF16 or AMX tiles)."""
    import torch

    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    for name in checks:
        fn = getattr(torch.cpu, name, None)
        try:
            if fn is not None and fn():
                return True
        except RuntimeError:  # pragma: no cover - a build without the probe
            continue
    return False


def _world(root: Any) -> int:
    trainer = root.trainer
    return int(trainer.devices) * int(trainer.get("num_nodes", 1) or 1)


def _linear_lr(base_lr: float, base_batch: int, *, _root_: Any) -> float:
    return linear_scaled_lr(base_lr, int(base_batch), int(_root_.data.batch_size) * _world(_root_))


def _world_size(*, _root_: Any) -> int:
    return _world(_root_)


def _bf16_if_supported() -> str:
    return "bf16-mixed" if cpu_bf16_native() else "32-true"


_RESOLVERS = {
    "linear_lr": _linear_lr,
    "world_size": _world_size,
    "bf16_if_supported": _bf16_if_supported,
}


def register_resolvers() -> None:
    """Register the resolvers with OmegaConf (idempotent)."""
    for name, fn in _RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
