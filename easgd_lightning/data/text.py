"""Byte-level language-modelling data from a real text corpus that is always on disk.

Default corpus: the Python standard library's own ``.py`` sources under
``sysconfig.get_paths()["stdlib"]`` (``site-packages`` and ``dist-packages`` excluded),
read in sorted relative-path order and joined with a newline, so every machine with the
same Python builds the same token stream without downloading anything. ``path`` takes the
user's own corpus instead: one file, or a directory read recursively (files matching
``glob``, sorted).

Tokens are bytes (vocabulary 256). The stream is cut into non-overlapping windows of
``seq_len + 1`` bytes; a sample is ``(window[:-1], window[1:])`` (next-byte prediction).
The last ``val_fraction`` of the windows (a contiguous tail, so no window straddles the
split) is the validation set.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from easgd_lightning.utils.checks import check_float, check_int

__all__ = ["TextDataModule", "ByteWindowDataset", "load_corpus_bytes", "stdlib_source_files"]

VOCAB_SIZE = 256
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_source_files() -> list[Path]:
    """The standard library's ``.py`` files in deterministic (sorted relative path) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        f
        for f in root.rglob("*.py")
        if f.is_file() and not _EXCLUDED_DIRS.intersection(f.relative_to(root).parts)
    ]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def _corpus_files(path: str | Path | None, glob: str) -> list[Path]:
    if path is None:
        files = stdlib_source_files()
        if not files:
            raise ValueError(
                "no standard-library sources found under sysconfig's stdlib path; set data.path"
            )
        return files
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted((f for f in p.rglob(glob) if f.is_file()), key=lambda f: f.as_posix())
        if not files:
            raise ValueError(f"data.path={str(p)!r} has no files matching data.glob={glob!r}")
        return files
    raise ValueError(f"data.path={str(p)!r} is neither a file nor a directory")


def load_corpus_bytes(
    path: str | Path | None = None, *, glob: str = "**/*", max_bytes: int | None = None
) -> torch.Tensor:
    """The corpus as a 1-D ``uint8`` tensor (files joined by ``\\n``, cut at ``max_bytes``).

    Args:
        path: A file or directory; ``None`` for the standard-library sources.
        glob: File pattern inside a directory ``path``.
        max_bytes: Stop reading after this many bytes (``None``: everything).
    """
    chunks: list[bytes] = []
    total = 0
    for f in _corpus_files(path, glob):
        data = f.read_bytes() + b"\n"
        if max_bytes is not None and total + len(data) > max_bytes:
            chunks.append(data[: max_bytes - total])
            total = max_bytes
            break
        chunks.append(data)
        total += len(data)
    blob = b"".join(chunks)
    if not blob:
        raise ValueError(f"data.path={path!r}: the corpus is empty")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


class ByteWindowDataset(Dataset):
    """Non-overlapping windows ``(x, y)`` with ``y`` the next byte of each ``x`` position."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.n = (tokens.numel() - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


class TextDataModule(pl.LightningDataModule):
    """Byte-level text as a LightningDataModule.

    Args:
        path: Corpus file or directory; ``None`` (default) for the standard library.
        glob: File pattern when ``path`` is a directory.
        seq_len: Tokens per sample.
        batch_size: Samples per batch on one data-parallel replica (for ``pipeline_3d``
            this is ``micro_batch_size * strategy.micro_batches``).
        val_fraction: Share of the windows kept for validation (the tail).
        max_bytes: Read at most this many bytes of the corpus (default 4 MiB, enough for
            CPU runs; ``null`` for everything).
        num_workers: DataLoader workers.
    """

    vocab_size = VOCAB_SIZE

    def __init__(
        self,
        path: str | None = None,
        glob: str = "**/*",
        seq_len: int = 64,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        max_bytes: int | None = 4 * 1024 * 1024,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        check_int("data.seq_len", seq_len)
        check_int("data.batch_size", batch_size)
        check_float("data.val_fraction", val_fraction, 0.0, 1.0, lo_open=True, hi_open=True)
        if max_bytes is not None and max_bytes < 2 * (seq_len + 1):
            raise ValueError(f"data.max_bytes ({max_bytes}) is too small for data.seq_len={seq_len}")
        self.path = path
        self.glob = glob
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self._train: Dataset | None = None
        self._val: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        tokens = load_corpus_bytes(self.path, glob=self.glob, max_bytes=self.max_bytes)
        windows = (tokens.numel() - 1) // self.seq_len
        n_val = max(1, int(round(windows * self.val_fraction)))
        if windows - n_val < 1:
            raise ValueError(
                f"corpus of {tokens.numel()} bytes gives {windows} windows of data.seq_len="
                f"{self.seq_len}: too few for a train/validation split"
            )
        cut = (windows - n_val) * self.seq_len
        self._train = ByteWindowDataset(tokens[: cut + 1], self.seq_len)
        self._val = ByteWindowDataset(tokens[cut:], self.seq_len)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self._train, batch_size=self.batch_size, shuffle=True, drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self._val, batch_size=self.batch_size, shuffle=False, drop_last=True,
            num_workers=self.num_workers,
        )
