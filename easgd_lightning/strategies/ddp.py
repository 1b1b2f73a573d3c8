"""Metered, compression-capable DDP (``ddp_compressed``; ``strategy=ddp`` in our Hydra tree).

Gradient all-reduce through torch ``DistributedDataParallel`` with a communication hook
registered on every backend. Lightning's own ``DDPStrategy`` registers hooks only on CUDA;
this subclass registers :func:`easgd_lightning.hooks.ddp.register_compression_hook` on
CPU/gloo too, so every byte is metered and compressors work everywhere. With
``compression=None`` it is plain DDP (averaged gradients) plus metering.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning.strategies import DDPStrategy
from typing_extensions import override

from easgd_lightning.hooks.ddp import register_compression_hook

__all__ = ["CompressedDDPStrategy"]


class CompressedDDPStrategy(DDPStrategy):
    """DDP whose gradient buckets go through our (optionally compressing) comm hook.

    Args:
        compression: a compressor from ``easgd_lightning.hooks.build_compressor`` or None.
        hook_options: extra keyword options for the hook (e.g. ``min_numel``, ``memory``).
        **kwargs: passed to Lightning's ``DDPStrategy``.
    """

    strategy_name = "ddp_compressed"

    def __init__(self, compression: Any = None, hook_options: dict | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._compression = compression
        self._hook_options = dict(hook_options or {})
        self.hook_state: Any = None
        self._local_steps = 0

    @override
    def _register_ddp_hooks(self) -> None:
        self.hook_state = register_compression_hook(
            self.model, self._compression, **self._hook_options
        )

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        self._local_steps += 1
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @property
    def local_steps(self) -> int:
        return self._local_steps

    def summary_extras(self) -> dict:
        stats = getattr(self.hook_state, "compression_stats", None)
        return {"hook": type(self.hook_state).__name__, **({"compression_stats": stats()} if callable(stats) else {})}
