"""The DataLoaders of the image data modules (synthetic, ImageNet): one place for the
worker options (processes, pinned memory, persistence, start method, prefetch) and the
``data.`` integer checks."""

from __future__ import annotations

import multiprocessing

import torch
from torch.utils.data import DataLoader, Dataset

from easgd_lightning.utils.checks import check_int

__all__ = ["WorkerLoaders", "loader_start_method"]


def loader_start_method(method: str | None) -> str | None:
    """DataLoader worker start method: ``method``, or ``fork`` where available when None.

    Whether ``easgd-train`` forks its ranks or spawns them (``launcher.start_method``), the
    loaders' start method is set here, not inherited; a spawned DataLoader worker re-imports
    torch, Lightning and torchvision before its first batch (tens of seconds on a busy
    machine), a forked one starts at once.

    Raises:
        ValueError: a method this platform does not have (naming data.multiprocessing_context).
    """
    available = multiprocessing.get_all_start_methods()
    if method is None:
        return "fork" if "fork" in available else None
    if method not in available:
        raise ValueError(
            f"data.multiprocessing_context={method!r}; choose one of {', '.join(available)} or null"
        )
    return method


class WorkerLoaders:
    """``train_dataloader`` / ``val_dataloader`` of a data module that has ``_train``,
    ``_val``, ``batch_size`` and ``val_batch_size``, with the worker options set once by
    :meth:`set_worker_options`. Training batches are shuffled and the last partial one is
    dropped; validation keeps every sample in order."""

    def set_worker_options(
        self,
        num_workers: int,
        pin_memory: bool | None,
        persistent_workers: bool,
        multiprocessing_context: str | None,
        prefetch_factor: int | None = None,
    ) -> None:
        """Check and keep the options (``pin_memory`` null: when CUDA is available)."""
        self.num_workers = check_int("data.num_workers", num_workers, 0)
        if prefetch_factor is not None:
            check_int("data.prefetch_factor", prefetch_factor, 1)
        self.prefetch_factor = prefetch_factor
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        self.persistent_workers = bool(persistent_workers)
        self.multiprocessing_context = loader_start_method(multiprocessing_context)

    def make_loader(
        self, dataset: Dataset, batch_size: int, *, shuffle: bool = False, drop_last: bool = False,
        workers: int | None = None, persistent: bool = True,
    ) -> DataLoader:
        """A DataLoader over ``dataset`` with the module's worker options (``workers``
        overrides the process count; ``persistent=False`` for a loader used once)."""
        workers = self.num_workers if workers is None else workers
        extra = {}
        if workers > 0:
            extra["persistent_workers"] = self.persistent_workers and persistent
            extra["multiprocessing_context"] = self.multiprocessing_context
            if self.prefetch_factor is not None:
                extra["prefetch_factor"] = self.prefetch_factor
        return DataLoader(
            dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
            num_workers=workers, pin_memory=self.pin_memory, **extra,
        )

    def train_dataloader(self) -> DataLoader:
        return self.make_loader(self._train, self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return self.make_loader(self._val, self.val_batch_size)
