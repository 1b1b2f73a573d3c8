"""GradientFlow's lazy all-reduce: consecutive tensors fused into buffers of at least
``fusion_mb`` before they travel.

Rule (Sun et al., "Optimizing Network Performance for Distributed DNN Training on GPU
Clusters: ImageNet/AlexNet Training in 1.5 Minutes", 2019, "lazy all-reduce"): walk the
tensors in order, adding each to the open buffer; the buffer is sent as soon as it holds
at least ``fusion_mb`` MiB, and whatever is left at the end is sent as the last buffer.
So every message but the last of an exchange carries >= ``fusion_mb``, and a model of
many small layers pays the per-message latency once per buffer instead of once per
layer. ``fusion_mb = 0`` sends one message per tensor (the unfused baseline); a
``fusion_mb`` above the whole exchange sends it as one message (SC17's "single-layer
communication"). Default 25 MiB, the size of DDP's buckets.

Where the rule runs:

* flat buffers (the elastic exchange, local SGD's average, the pipeline's data-parallel
  gradients): :func:`fusion_buckets` cuts the buffer at tensor boundaries and
  :class:`~easgd_lightning.comm.layout.CommLayout` all-reduces the buckets, views of the
  buffer, in place (no copy);
* compressed per-tensor exchanges: :class:`~easgd_lightning.hooks.collective.
  ProcessGroupCollective` fuses the payloads of one-round all-reduce codecs the same way
  (:func:`fusion_buckets` is its rule too);
* DDP: DDP's own buckets (``bucket_cap_mb`` = ``comm.fusion_mb``) are the buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

__all__ = ["DEFAULT_FUSION_MB", "MIB", "fusion_threshold", "fusion_buckets"]

#: default ``comm.fusion_mb`` (DDP's default bucket size)
DEFAULT_FUSION_MB = 25.0

MIB = 1024 * 1024


def fusion_threshold(fusion_mb: float) -> int:
    """``fusion_mb`` MiB in bytes (0: no fusion)."""
    return int(round(float(fusion_mb) * MIB))


@lru_cache(maxsize=256)
def _buckets(sizes: tuple[int, ...], threshold: int) -> tuple[tuple[int, int], ...]:
    out, start, filled = [], 0, 0
    for i, n in enumerate(sizes):
        filled += n
        if filled >= threshold:
            out.append((start, i + 1))
            start, filled = i + 1, 0
    if start < len(sizes):
        out.append((start, len(sizes)))
    return tuple(out)


def fusion_buckets(sizes: Sequence[int], threshold: int) -> tuple[tuple[int, int], ...]:
    """The buffers of the lazy all-reduce: ``(first, end)`` index ranges over ``sizes``.

    Args:
        sizes: each tensor's size in bytes, in the order they travel.
        threshold: bytes at which a buffer is sent (<= 0: every tensor alone).

    Returns:
        Consecutive ranges covering every tensor; each holds >= ``threshold`` bytes except
        possibly the last.
    """
    return _buckets(tuple(int(s) for s in sizes), max(0, int(threshold)))
