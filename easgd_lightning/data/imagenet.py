"""ImageNet (ILSVRC-2012) from an ``ImageFolder`` tree, or generated stand-ins (``data=imagenet``).

Layout under ``data.root``::

    root/train/<class>/<image>    e.g. root/train/n01440764/n01440764_10026.JPEG
    root/val/<class>/<image>      the 50,000 validation images sorted into class folders

(the usual preparation: extract the train tarballs per class, sort ``val/`` into class
folders with the devkit labels). ``train/`` and ``val/`` must hold the same class folders,
each with at least one image. The tree is checked when the data module is constructed, so
``easgd-train`` reports a bad ``data.root`` before any process starts.

Transforms are the standard ones of the ResNet / torchvision ImageNet reference:

* train: ``RandomResizedCrop(image_size)`` (scale 0.08-1, aspect 3/4-4/3), horizontal
  flip, ``ToTensor``, normalisation with the ImageNet channel mean and std;
* val: ``Resize(resize_size)`` (default ``image_size / 0.875``, 256 for 224), ``CenterCrop``,
  ``ToTensor``, normalisation.

Input pipeline: ``num_workers`` decoding processes per rank, persistent across epochs,
pinned host memory when CUDA is available (``pin_memory: null``), ``drop_last`` on the
training loader so every step has a full per-worker batch. Channels-last is a property
of the model (``model.channels_last``), applied to the batch inside the module.

``synthetic: true`` replaces both splits by deterministic generated images of the same
shape and class count (:class:`~easgd_lightning.data.synthetic.SyntheticImageDataset`),
``train_size`` / ``val_size`` samples (ImageNet's own sizes by
default), for smoke tests and throughput measurements; ``root`` is then ignored.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytorch_lightning as pl
from torch.utils.data import DataLoader, Dataset, Subset

from easgd_lightning.data.loaders import WorkerLoaders
from easgd_lightning.data.synthetic import SyntheticImageDataset
from easgd_lightning.utils.checks import check_bool, check_int

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGENET_TRAIN_SIZE",
    "IMAGENET_VAL_SIZE",
    "EXPECTED_LAYOUT",
    "ImageNetDataModule",
    "check_imagefolder_root",
    "train_transform",
    "val_transform",
]

#: Channel statistics of the ImageNet training set (RGB, pixels in [0, 1]).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: ILSVRC-2012 sizes (the synthetic stand-in's defaults).
IMAGENET_TRAIN_SIZE = 1_281_167
IMAGENET_VAL_SIZE = 50_000
IMAGENET_CLASSES = 1000

EXPECTED_LAYOUT = (
    "expected an ImageFolder tree: <data.root>/train/<class>/<image> and "
    "<data.root>/val/<class>/<image> with the same class folders in both "
    "(or data.synthetic=true for generated images)"
)

_IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp"}
)


def _has_image(folder: str) -> bool:
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_file() and os.path.splitext(entry.name)[1].lower() in _IMAGE_SUFFIXES:
                return True
    return False


def check_imagefolder_root(root: str | os.PathLike | None) -> list[str]:
    """Check ``root`` has the train/val ImageFolder layout; returns the sorted class names.

    Reads only directory listings (one ``scandir`` per class folder, stopping at the
    first image), so it is cheap even for the full data set.

    Raises:
        ValueError: ``data.root`` unset, missing, not a directory, without ``train/`` or
            ``val/``, with a split that has no class folders or an empty class folder, or
            with different class folders in the two splits; the message names
            ``data.root`` and the expected layout.
    """
    if root is None or str(root).strip() == "":
        raise ValueError(f"data.root is not set; {EXPECTED_LAYOUT}")
    path = Path(root).expanduser()
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise ValueError(f"data.root={str(path)!r} {what}; {EXPECTED_LAYOUT}")
    missing = [f"{split}/" for split in ("train", "val") if not (path / split).is_dir()]
    if missing:
        raise ValueError(f"data.root={str(path)!r} has no {' or '.join(missing)} folder; {EXPECTED_LAYOUT}")
    classes: dict[str, list[str]] = {}
    for split in ("train", "val"):
        split_dir = path / split
        names = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))
        if not names:
            raise ValueError(
                f"data.root={str(path)!r}: {split}/ has no class folders; {EXPECTED_LAYOUT}"
            )
        for name in names:
            if not _has_image(str(split_dir / name)):
                raise ValueError(
                    f"data.root={str(path)!r}: {split}/{name}/ holds no image files "
                    f"({', '.join(sorted(_IMAGE_SUFFIXES))}); {EXPECTED_LAYOUT}"
                )
        classes[split] = names
    if classes["train"] != classes["val"]:
        only_train = sorted(set(classes["train"]) - set(classes["val"]))[:3]
        only_val = sorted(set(classes["val"]) - set(classes["train"]))[:3]
        raise ValueError(
            f"data.root={str(path)!r}: train/ and val/ have different class folders "
            f"(only in train: {only_train}, only in val: {only_val}); {EXPECTED_LAYOUT}"
        )
    return classes["train"]


def train_transform(image_size: int):
    """Random-resized crop, horizontal flip, tensor, ImageNet normalisation."""
    from torchvision import transforms as T

    return T.Compose(
        [
            T.RandomResizedCrop(image_size),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def val_transform(image_size: int, resize_size: int | None = None):
    """Resize the short side (default ``image_size / 0.875``), centre crop, tensor, normalise."""
    from torchvision import transforms as T

    resize = resize_size or int(round(image_size / 0.875))
    return T.Compose(
        [
            T.Resize(resize),
            T.CenterCrop(image_size),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


class ImageNetDataModule(WorkerLoaders, pl.LightningDataModule):
    """ImageNet as a LightningDataModule (``batch_size`` per worker).

    Args:
        root: The ImageFolder tree (see the module docstring); ignored when ``synthetic``.
        batch_size: Training samples per step on one worker.
        image_size: Side of the square crops the network sees (224 for the papers;
            smaller for smoke tests).
        resize_size: Validation resize of the short side (null: ``image_size / 0.875``).
        num_workers: Decoding processes per rank.
        pin_memory: Pin host memory for faster host-to-GPU copies (null: when CUDA is
            available).
        persistent_workers: Keep the decoding processes between epochs.
        prefetch_factor: Batches each decoding process prepares ahead.
        multiprocessing_context: How decoding processes start (null: ``fork`` where the
            platform has it). ``easgd-train`` ranks are themselves spawned, so the default
            start method inside them is ``spawn``, which would re-import the whole
            training stack in every decoding process.
        synthetic: Generated images instead of ``root``.
        num_classes: Class count; null: the tree's (1000 when synthetic). When set with a
            real tree it must match the tree.
        train_size: Training samples of the synthetic stand-in.
        val_size: Validation samples of the synthetic stand-in.
        val_batch_size: Validation batch size (null: ``batch_size``).
        train_eval_size: Training samples the final ``train_loss`` is measured on (a fixed,
            evenly strided subset, so every class is represented; null: the whole set).
        seed: Seed of the synthetic images.

    Raises:
        ValueError: a bad value or a bad tree; the message names the ``data.`` key.
    """

    def __init__(
        self,
        root: str | None = None,
        batch_size: int = 256,
        image_size: int = 224,
        resize_size: int | None = None,
        num_workers: int = 8,
        pin_memory: bool | None = None,
        persistent_workers: bool = True,
        prefetch_factor: int | None = 2,
        multiprocessing_context: str | None = None,
        synthetic: bool = False,
        num_classes: int | None = None,
        train_size: int = IMAGENET_TRAIN_SIZE,
        val_size: int = IMAGENET_VAL_SIZE,
        val_batch_size: int | None = None,
        train_eval_size: int | None = 10_000,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_int("data.batch_size", batch_size, 1)
        check_int("data.image_size", image_size, 1)
        for key, value in (
            ("resize_size", resize_size), ("val_batch_size", val_batch_size),
            ("train_eval_size", train_eval_size),
        ):
            if value is not None:
                check_int(f"data.{key}", value, 1)
        if resize_size is not None and resize_size < image_size:
            raise ValueError(
                f"data.resize_size={resize_size} must be >= data.image_size={image_size}"
            )
        self.synthetic = check_bool("data.synthetic", synthetic)
        self.root = None if root is None else str(Path(root).expanduser())
        if synthetic:
            self.classes = None
            classes = check_int("data.num_classes", num_classes, 2) if num_classes is not None else IMAGENET_CLASSES
            check_int("data.train_size", train_size, 1)
            check_int("data.val_size", val_size, 1)
        else:
            self.classes = check_imagefolder_root(root)
            classes = len(self.classes)
            if num_classes is not None and num_classes != classes:
                raise ValueError(
                    f"data.num_classes={num_classes} but data.root={self.root!r} has "
                    f"{classes} class folders; set data.num_classes=null to use the tree's"
                )
        self.num_classes = classes
        self.batch_size = batch_size
        self.image_size = image_size
        self.resize_size = resize_size
        self.set_worker_options(
            num_workers, pin_memory, persistent_workers, multiprocessing_context, prefetch_factor
        )
        self.train_size = train_size
        self.val_size = val_size
        self.val_batch_size = val_batch_size or batch_size
        self.train_eval_size = train_eval_size
        self.seed = seed
        self._train: Dataset | None = None
        self._val: Dataset | None = None
        self._train_eval: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        if self.synthetic:
            common = dict(image_size=self.image_size, num_classes=self.num_classes, seed=self.seed)
            self._train = SyntheticImageDataset(self.train_size, split="train", **common)
            self._val = SyntheticImageDataset(self.val_size, split="val", **common)
            self._train_eval = self._train
            return
        from torchvision.datasets import ImageFolder

        root = Path(self.root)
        self._train = ImageFolder(str(root / "train"), transform=train_transform(self.image_size))
        evaluation = val_transform(self.image_size, self.resize_size)
        self._val = ImageFolder(str(root / "val"), transform=evaluation)
        # the final train_loss sees training images the way validation does (no augmentation)
        self._train_eval = ImageFolder(str(root / "train"), transform=evaluation)

    def train_eval_dataloader(self) -> DataLoader:
        """A fixed subset of the training set (``train_eval_size``) for the final ``train_loss``."""
        dataset = self._train_eval
        n = len(dataset)
        if self.train_eval_size is not None and self.train_eval_size < n:
            dataset = Subset(dataset, [i * n // self.train_eval_size for i in range(self.train_eval_size)])
        return self.make_loader(dataset, self.val_batch_size, persistent=False)
