"""Generated images with the shape and class count of a real data set (``data=synthetic``).

For smoke tests and throughput benchmarks: no files, no download, and the same bytes on
every machine. Sample ``i`` of a split is drawn from its own generator seeded with
``(seed, split, i)``, so a sample does not depend on which worker process, rank or epoch
asks for it, and the data set costs no memory however large ``train_size`` is. Pixels are
standard-normal (what a normalised real image looks like to the network); labels are
uniform over ``num_classes``. There is nothing to learn: accuracy stays at chance.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from easgd_lightning.data.loaders import WorkerLoaders
from easgd_lightning.utils.checks import check_int

__all__ = ["SyntheticImageDataset", "SyntheticImageDataModule"]

#: Splits get disjoint generator streams.
_SPLIT_OFFSET = {"train": 0, "val": 1}


class SyntheticImageDataset(Dataset):
    """``size`` deterministic random ``(channels, image_size, image_size)`` images and labels.

    Args:
        size: Number of samples.
        image_size: Height and width in pixels.
        num_classes: Labels are drawn from ``[0, num_classes)``.
        channels: Image channels.
        seed: Base seed; sample ``i`` uses ``seed * 1_000_003 + 2 * i + split``.
        split: ``train`` or ``val`` (disjoint streams).
    """

    def __init__(
        self,
        size: int,
        image_size: int,
        num_classes: int,
        channels: int = 3,
        seed: int = 0,
        split: str = "train",
    ) -> None:
        if split not in _SPLIT_OFFSET:
            raise ValueError(f"split={split!r}; choose one of {', '.join(_SPLIT_OFFSET)}")
        self.size = size
        self.shape = (channels, image_size, image_size)
        self.num_classes = num_classes
        self.seed = seed
        self.split = split

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} out of range for {self.size} samples")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 2 * index + _SPLIT_OFFSET[self.split])
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        image = torch.randn(self.shape, generator=g)
        return image, label


class SyntheticImageDataModule(WorkerLoaders, pl.LightningDataModule):
    """Synthetic images as a LightningDataModule (``batch_size`` per worker).

    Args:
        batch_size: Samples per training batch on one worker.
        image_size: Height and width of the square images.
        num_classes: Number of classes (the model's output size).
        train_size: Training samples per epoch (all ranks together).
        val_size: Validation samples.
        channels: Image channels.
        seed: Seed of the generated data (independent of the training seed).
        num_workers: DataLoader worker processes.
        pin_memory: Pin host memory (null: when CUDA is available).
        persistent_workers: Keep DataLoader workers alive between epochs.
        multiprocessing_context: DataLoader worker start method (null: ``fork`` where
            available; see :func:`~easgd_lightning.data.loaders.loader_start_method`).
        val_batch_size: Validation batch size (null: ``batch_size``).
        train_eval_size: How many training samples the final ``train_loss`` is measured on
            (null: all of them).

    Raises:
        ValueError: a size that is not a positive integer (naming its ``data.`` key).
    """

    def __init__(
        self,
        batch_size: int = 32,
        image_size: int = 32,
        num_classes: int = 10,
        train_size: int = 512,
        val_size: int = 128,
        channels: int = 3,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
        val_batch_size: int | None = None,
        train_eval_size: int | None = None,
        multiprocessing_context: str | None = None,
    ) -> None:
        super().__init__()
        for key, value in (
            ("batch_size", batch_size), ("image_size", image_size), ("num_classes", num_classes),
            ("train_size", train_size), ("val_size", val_size), ("channels", channels),
        ):
            check_int(f"data.{key}", value, 1)
        if val_batch_size is not None:
            check_int("data.val_batch_size", val_batch_size, 1)
        if train_eval_size is not None:
            check_int("data.train_eval_size", train_eval_size, 1)
        self.batch_size = batch_size
        self.image_size = image_size
        self.num_classes = num_classes
        self.train_size = train_size
        self.val_size = val_size
        self.channels = channels
        self.seed = seed
        self.set_worker_options(num_workers, pin_memory, persistent_workers, multiprocessing_context)
        self.val_batch_size = val_batch_size or batch_size
        self.train_eval_size = train_eval_size
        self._train: Dataset | None = None
        self._val: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self._train is None:
            common = dict(image_size=self.image_size, num_classes=self.num_classes, channels=self.channels, seed=self.seed)
            self._train = SyntheticImageDataset(self.train_size, split="train", **common)
            self._val = SyntheticImageDataset(self.val_size, split="val", **common)

    def train_eval_dataloader(self) -> DataLoader:
        """The first ``train_eval_size`` training samples in order (final ``train_loss``)."""
        dataset = self._train
        if self.train_eval_size is not None and self.train_eval_size < len(dataset):
            dataset = torch.utils.data.Subset(dataset, range(self.train_eval_size))
        return self.make_loader(dataset, self.val_batch_size, workers=0)
