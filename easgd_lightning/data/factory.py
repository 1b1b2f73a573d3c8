"""Data modules by config name."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["DATA_NAMES", "build_datamodule", "datamodule_target"]

#: name -> "module:Class"; modules are imported on demand.
_DATAMODULES: dict[str, str] = {
    "digits": "easgd_lightning.data.digits:DigitsDataModule",
    "imagenet": "easgd_lightning.data.imagenet:ImageNetDataModule",
    "synthetic": "easgd_lightning.data.synthetic:SyntheticImageDataModule",
    "text": "easgd_lightning.data.text:TextDataModule",
}

DATA_NAMES = tuple(sorted(_DATAMODULES))


def datamodule_target(name: str) -> str:
    """The dotted class path of ``data.name`` (what ``conf/data/NAME.yaml``'s ``_target_`` names).

    Raises:
        ValueError: unknown name (lists the valid ones).
    """
    if name not in _DATAMODULES:
        raise ValueError(f"data.name={name!r} is unknown; choose one of {', '.join(DATA_NAMES)}")
    return _DATAMODULES[name].replace(":", ".")


def build_datamodule(name: str, **kwargs: Any):
    """Build a LightningDataModule by name.

    Raises:
        ValueError: unknown name (lists the valid ones).
    """
    module, cls = datamodule_target(name).rsplit(".", 1)
    return getattr(importlib.import_module(module), cls)(**kwargs)
