"""scikit-learn's bundled ``digits`` data set (1797 real 8x8 handwritten digits, 10 classes).

Ships inside scikit-learn, so it needs no download. Pixels are scaled to [0, 1]; the
train/validation split is stratified and fixed by ``split_seed``.
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from easgd_lightning.utils.checks import check_float, check_int

__all__ = ["DigitsDataModule", "load_digits_tensors"]


def load_digits_tensors(val_fraction: float = 0.2, split_seed: int = 0):
    """(x_train, y_train, x_val, y_val) as float32 / int64 tensors."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = data.data.astype("float32") / 16.0
    y = data.target.astype("int64")
    x_tr, x_va, y_tr, y_va = train_test_split(
        x, y, test_size=val_fraction, random_state=split_seed, stratify=y
    )
    return (torch.from_numpy(x_tr), torch.from_numpy(y_tr), torch.from_numpy(x_va), torch.from_numpy(y_va))


class DigitsDataModule(pl.LightningDataModule):
    """Digits as a LightningDataModule (batch size per worker)."""

    num_classes = 10
    in_features = 64

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, split_seed: int = 0, num_workers: int = 0):
        super().__init__()
        check_int("data.batch_size", batch_size)
        check_float("data.val_fraction", val_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.num_workers = num_workers
        self._train = self._val = None

    def setup(self, stage: str | None = None) -> None:
        if self._train is None:
            x_tr, y_tr, x_va, y_va = load_digits_tensors(self.val_fraction, self.split_seed)
            self._train = TensorDataset(x_tr, y_tr)
            self._val = TensorDataset(x_va, y_va)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._train, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._val, batch_size=256, shuffle=False, num_workers=self.num_workers)

    def train_eval_dataloader(self) -> DataLoader:
        """The training set in order, for the final train_loss on the evaluated model."""
        return DataLoader(self._train, batch_size=256, shuffle=False)
