"""Atomic file writes: write a temporary file in the same directory, fsync, rename.

A crash or a kill at any point leaves either the old file or the new one, never a
truncated file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_json", "atomic_torch_save"]


_UMASK = os.umask(0)
os.umask(_UMASK)


def _atomic_write(path: str | os.PathLike, write) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    _atomic_write(path, lambda fh: fh.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` that never leaves a partial file behind."""
    _atomic_write(path, lambda fh: torch.save(obj, fh))
