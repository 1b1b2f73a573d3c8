"""LightningDataModules by config name (``data=NAME``)."""

from easgd_lightning.data.digits import DigitsDataModule
from easgd_lightning.data.factory import DATA_NAMES, build_datamodule, datamodule_target

__all__ = ["DigitsDataModule", "build_datamodule", "datamodule_target", "DATA_NAMES"]
