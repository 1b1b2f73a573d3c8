"""Lightning's ``CheckpointIO`` over :mod:`easgd_lightning.utils.checkpoint`: atomic writes
with a checksum, weights-only loads verified against it (``easgd-train`` hands it to the
Trainer)."""

from __future__ import annotations

from typing import Any

from lightning_fabric.plugins import TorchCheckpointIO

from easgd_lightning.compat.lightning import PATH
from easgd_lightning.utils.checkpoint import load_checkpoint_file, save_checkpoint_file

__all__ = ["VerifiedCheckpointIO"]


class VerifiedCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO``: atomic writes with a checksum; verified weights-only loads."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PATH, storage_options: Any | None = None) -> None:
        save_checkpoint_file(checkpoint, path)

    def load_checkpoint(self, path: PATH, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        return load_checkpoint_file(path, map_location=map_location if map_location is not None else "cpu")
