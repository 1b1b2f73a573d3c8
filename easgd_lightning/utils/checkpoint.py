"""Checkpoints that hold tensors and plain data only, with a checksum verified on load.

* :func:`to_plain` / :func:`from_plain`: the one serialization helper every attach point
  uses for its state (compressor per-tensor state, error-feedback memory, strategy
  state). Tensors, ``None``, bools, numbers, strings, lists, tuples and dicts pass
  through; the few objects that live in that state (memories, generators) become tagged
  dicts ``{"__object__": NAME, "state": ...}`` and are rebuilt by :func:`from_plain`;
  scratch buffers (the key :data:`SCRATCH_KEY`, rebuilt on demand) are dropped; anything
  else is an error naming where it sits. The result loads with
  ``torch.load(..., weights_only=True)``.
* :func:`content_digest`: SHA-256 over a checkpoint's content (every key, tensor dtype,
  shape and bytes, in order). :func:`save_checkpoint_file` stores it under
  :data:`CHECKSUM_KEY` and writes atomically; :func:`load_checkpoint_file` loads with
  ``weights_only=True`` and recomputes it, so a file whose bytes changed after it was
  written is refused with :class:`CheckpointError` naming the file.
* Lightning's ``CheckpointIO`` doing both is :class:`~easgd_lightning.utils.checkpoint_io.VerifiedCheckpointIO`
  (its own module: this one imports no Lightning, so the hooks that keep their state
  through it do not either).
* :func:`verify_checkpoint_dir`: the same check over a checkpoint directory (pipeline_3d
  writes one file per stage and per replica, each stamped like a single-file checkpoint).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from easgd_lightning.utils.atomic import atomic_torch_save

__all__ = [
    "SCRATCH_KEY",
    "CHECKSUM_KEY",
    "CheckpointError",
    "to_plain",
    "from_plain",
    "register_state_object",
    "content_digest",
    "save_checkpoint_file",
    "load_checkpoint_file",
    "verify_checkpoint_dir",
    "checkpoint_identity",
    "check_saved_world_size",
]

#: per-tensor compressor state key for working buffers; never checkpointed
SCRATCH_KEY = "_scratch"
#: top-level checkpoint key holding ``{"algorithm": "sha256", "digest": HEX}``
CHECKSUM_KEY = "checksum"
_OBJECT = "__object__"
_PLAIN_SCALARS = (type(None), bool, int, float, str)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and the problem."""


# ---------------------------------------------------------------------- state <-> plain
#: NAME -> (class, to_state, from_state(state, device)): the objects besides tensors and
#: plain data that checkpointed state may hold, registered by the modules that define them
#: (:func:`register_state_object`; hooks/memory.py: the attach points' residual memories)
_REGISTERED: dict[str, tuple[type, Any, Any]] = {}


def register_state_object(cls: type) -> type:
    """Class decorator: :func:`to_plain` / :func:`from_plain` carry instances of ``cls``
    (built with no argument, restored with ``load_state_dict`` from its ``state_dict``)
    under the class name."""
    def build(state, device):
        obj = cls()
        obj.load_state_dict(from_plain(state, device))
        return obj

    _REGISTERED[cls.__name__] = (cls, lambda o: to_plain(o.state_dict()), build)
    return cls


def _object_codecs() -> dict[str, tuple[type, Any, Any]]:
    """NAME -> (class, to_state, from_state(state, device)): the registered objects and
    ``torch.Generator``."""
    def _generator_from(state, device):
        gen = torch.Generator(device="cpu")
        gen.set_state(state)
        return gen

    return {**_REGISTERED, "Generator": (torch.Generator, lambda g: g.get_state().clone(), _generator_from)}


def to_plain(obj: Any, where: str = "state") -> Any:
    """``obj`` as tensors and plain data (CPU copies of tensors; scratch dropped).

    Raises:
        TypeError: an object that has no plain form, naming its place (``where``).
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, _PLAIN_SCALARS):
        return obj
    if isinstance(obj, dict):
        return {
            k: to_plain(v, f"{where}[{k!r}]")
            for k, v in obj.items()
            if k != SCRATCH_KEY
        }
    if isinstance(obj, torch.Size):
        return tuple(int(d) for d in obj)
    if isinstance(obj, (list, tuple)):
        items = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    if hasattr(obj, "item") and type(obj).__module__ == "numpy":  # numpy scalars
        return obj.item()
    for name, (cls, encode, _) in _object_codecs().items():
        if type(obj) is cls:
            return {_OBJECT: name, "state": encode(obj)}
    raise TypeError(
        f"{where} holds a {type(obj).__module__}.{type(obj).__name__}; checkpoint state must "
        "be tensors and plain data (or a class registered with easgd_lightning.utils.checkpoint.register_state_object)"
    )


def from_plain(obj: Any, device: torch.device | str | None = None) -> Any:
    """Rebuild what :func:`to_plain` produced (tensors moved to ``device`` when given)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device) if device is not None else obj.clone()
    if isinstance(obj, dict):
        if _OBJECT in obj and set(obj) == {_OBJECT, "state"}:
            codecs = _object_codecs()
            if obj[_OBJECT] not in codecs:
                raise TypeError(f"unknown checkpointed object {obj[_OBJECT]!r}")
            return codecs[obj[_OBJECT]][2](obj["state"], device)
        return {k: from_plain(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_plain(v, device) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_plain(v, device) for v in obj)
    return obj


# ---------------------------------------------------------------------- checksum
def _feed(h: Any, obj: Any, where: str) -> None:
    """Hash ``obj`` with its type and structure, so equal digests mean equal content."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(obj.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}{{".encode())
        for k, v in obj.items():
            _feed(h, k, where)
            _feed(h, v, f"{where}[{k!r}]")
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(f"{type(obj).__name__[0]}{len(obj)}[".encode())
        for i, v in enumerate(obj):
            _feed(h, v, f"{where}[{i}]")
        h.update(b"]")
    elif isinstance(obj, (*_PLAIN_SCALARS, torch.dtype, torch.device)):
        h.update(f"{type(obj).__name__}:{obj!r};".encode())
    else:
        raise TypeError(
            f"{where} holds a {type(obj).__module__}.{type(obj).__name__}; checkpoints hold "
            "tensors and plain data only (so they load with torch.load(weights_only=True))"
        )


def content_digest(checkpoint: dict) -> str:
    """SHA-256 (hex) of every entry of ``checkpoint`` except :data:`CHECKSUM_KEY`."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in checkpoint.items() if k != CHECKSUM_KEY}, "checkpoint")
    return h.hexdigest()


def save_checkpoint_file(checkpoint: dict, path: str | os.PathLike) -> None:
    """Write ``checkpoint`` plus its checksum atomically (temporary file, fsync, rename)."""
    stamped = {k: v for k, v in checkpoint.items() if k != CHECKSUM_KEY}
    stamped[CHECKSUM_KEY] = {"algorithm": "sha256", "digest": content_digest(stamped)}
    atomic_torch_save(stamped, path)


def load_checkpoint_file(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Load a checkpoint with ``weights_only=True`` and verify its checksum.

    Raises:
        CheckpointError: missing, empty, unreadable (truncated, not a torch file, holds
            objects other than tensors and plain data) or altered since it was written
            (checksum mismatch). Files written before checksums existed load as they are.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such file")
    if p.is_dir():
        raise CheckpointError(f"{p} is a directory, not a checkpoint file")
    if p.stat().st_size == 0:
        raise CheckpointError(f"{p} is empty")
    try:
        checkpoint = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as err:  # zip errors, unpickling errors, unsupported globals
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(
            f"{p} is not a readable checkpoint (truncated, not written by torch.save, or "
            f"holding objects other than tensors and plain data): {reason[:200]}"
        ) from err
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{p} holds a {type(checkpoint).__name__}, not a checkpoint dict")
    stamp = checkpoint.get(CHECKSUM_KEY)
    if stamp is not None:
        expected = stamp.get("digest") if isinstance(stamp, dict) else None
        if expected != content_digest(checkpoint):
            raise CheckpointError(
                f"{p} is corrupted: its content does not match the checksum written with it"
            )
    return checkpoint


def verify_checkpoint_dir(path: str | os.PathLike, marker: str) -> None:
    """Check a checkpoint written as a directory of files (pipeline_3d: ``meta.pt`` plus
    per-stage shards): ``marker`` is there and every ``*.pt`` file passes
    :func:`load_checkpoint_file`.

    Raises:
        CheckpointError: naming the directory or the first unusable file.
    """
    p = Path(path)
    if not (p / marker).is_file():
        raise CheckpointError(f"{p} is not a checkpoint directory (no {marker})")
    for file in sorted(p.glob("*.pt")):
        load_checkpoint_file(file)


def checkpoint_identity(checkpoint: dict) -> tuple[str | None, int | None]:
    """(strategy name, world size) recorded by the strategy that wrote ``checkpoint``
    (``checkpoint["easgd"]`` for center and parameter-server strategies, ``["ddp"]`` for
    ddp); None where it recorded nothing."""
    for key in ("easgd", "ddp"):
        entry = checkpoint.get(key)
        if isinstance(entry, dict):
            world = entry.get("world_size")
            return entry.get("strategy") or None, int(world) if isinstance(world, int) else None
    return None, None


def check_saved_world_size(saved: dict, world_size: int) -> None:
    """Refuse to resume a strategy's per-rank state written by a different number of processes."""
    if saved.get("world_size") != world_size:
        raise ValueError(
            f"checkpoint was written by {saved.get('world_size')} processes; this run has "
            f"{world_size} (trainer.devices x trainer.num_nodes must match to resume)"
        )
