"""The parameter server's wire protocol: operation codes, tags and message layouts.

Point-to-point messages on the gloo process group (through :mod:`easgd_lightning.comm.ops`).
A request is a float64 header ``[op, local_step, lr, weight_decay]`` (the SGD rule adds,
per parameter group, its learning rate and, per parameter tensor, whether the worker had a
gradient for it) followed, for ``OP_ELASTIC`` / ``OP_GRAD``, by one flat payload (the SC17
single-layer message). A reply is a header ``[op, server_updates, stop, extra]`` plus one
flat payload; ``OP_STATE`` adds the server's state as one serialized blob of ``extra`` bytes.
``OP_CGRAD`` (a compressed push, :mod:`easgd_lightning.strategies.ps.compressed`) carries
the byte length of its uint8 message in the header's ``lr`` entry; its reply is the dense
center (one-way, ``extra`` 0) or a uint8 message of ``extra`` bytes (two-way).
``OP_CELASTIC`` (a compressed elastic push) carries its message length the same way; its
reply is the dense elastic difference d.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = [
    "OP_ELASTIC", "OP_GRAD", "OP_PULL", "OP_STATE", "OP_DONE", "OP_FINAL", "OP_CGRAD", "OP_CELASTIC",
    "TAG_REQ", "TAG_REQ_DATA", "TAG_REP", "TAG_REP_DATA", "TAG_REP_STATE", "HEADER",
    "request_header_size", "request_extras", "split_request_extras", "to_blob", "from_blob",
]

# request / reply operation codes (first header entry)
OP_ELASTIC, OP_GRAD, OP_PULL, OP_STATE, OP_DONE, OP_FINAL, OP_CGRAD, OP_CELASTIC = 1, 2, 3, 4, 5, 6, 7, 8
# point-to-point tags (gloo slots)
TAG_REQ, TAG_REQ_DATA, TAG_REP, TAG_REP_DATA, TAG_REP_STATE = 41, 42, 43, 44, 45
HEADER = 4


def request_header_size(optimizer: Optimizer | None, params: list[torch.Tensor]) -> int:
    """Entries of a request header: ``[op, step, lr, wd]``, then (SGD rule) each parameter
    group's learning rate and, per parameter tensor, 1.0 when the worker had a gradient for it."""
    if optimizer is None:
        return HEADER
    return HEADER + len(optimizer.param_groups) + len(params)


def request_extras(optimizer: Optimizer, params: list[torch.Tensor]) -> list[float]:
    """The worker's side of :func:`request_header_size`: its groups' current learning rates
    (so its schedulers apply at the server) and which parameters have a gradient."""
    return [float(g["lr"]) for g in optimizer.param_groups] + [float(p.grad is not None) for p in params]


def split_request_extras(hdr: torch.Tensor, n_groups: int) -> tuple[list[float], list[bool]]:
    """(learning rate per group, has-gradient per parameter) from a request header."""
    extras = hdr[HEADER:].tolist()
    return extras[:n_groups], [v > 0.5 for v in extras[n_groups:]]


def to_blob(obj: Any) -> torch.Tensor:
    """``obj`` (tensors and plain data) serialized into a uint8 tensor, to send."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def from_blob(blob: torch.Tensor) -> Any:
    """The object :func:`to_blob` serialized (plain data and tensors only: weights_only)."""
    return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)

