"""The compressed tensors of one flat buffer, for codecs that run once per exchange.

The fused exchange (:mod:`easgd_lightning.hooks._fused`) hands a codec the whole flat
buffer of an exchange (DDP's bucket, the elastic difference) and a :class:`Segments`:
tensor j is ``flat[offsets[j] : offsets[j] + lengths[j]]``. A codec that declares
``fused_segments = True`` implements ``compress_segments(flat, segments, state)`` and
returns one payload for all of them, while keeping its rule per tensor where the paper
defines it per layer: top-k's sampled threshold, DGC's k = ceil(density * n), sample and
refinement rounds, EF-signSGD's scale, random-k's seeded draw and QSGD's buckets and noise
words are computed per segment, inside one native call (``topk_segments``,
``dgc_segments``, ``sign_pack_segments``, ``randomk_segments``, ``qsgd_segments`` in
``_kernels.c``); ``local_segments`` decodes this rank's payload and ``mean_segments`` the
mean over ranks. What a codec derives
from the segments alone (k per segment at a density, sample strides) is computed once and
kept (:meth:`Segments.cached`): the hot path runs no Python per tensor.
"""

from __future__ import annotations

import torch

__all__ = ["Segments", "merged_runs", "SEGMENT_STATES"]

#: the key of a fused group's per-member states, for a codec whose rule keeps state per
#: tensor across steps (a sparsifier's ``segment_state``; ``hooks/_fused.py``'s group_state)
SEGMENT_STATES = "segment_states"


def merged_runs(offsets, lengths) -> tuple[tuple[int, int], ...]:
    """(offset, length) runs covering the given stretches (ascending), adjacent ones merged."""
    out: list[tuple[int, int]] = []
    for off, n in zip(offsets, lengths):
        if out and sum(out[-1]) == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return tuple(out)


class Segments:
    """Tensor j of a flat buffer of ``numel`` entries is
    ``flat[offsets[j] : offsets[j] + lengths[j]]`` (ascending, disjoint).

    Args:
        offsets: start of each tensor in the buffer.
        lengths: its number of entries (>= 1).
        numel: entries of the whole buffer (the segments need not cover it).
        key_hashes: each tensor's stable key hash (its state's ``key_hash``: seeded codecs
            draw from it), when the segments are tensors with keys.
        shapes: each tensor's shape, when known (a rule that views a tensor as a matrix,
            ACP-SGD's, needs it; without it each segment is the 1-D tensor it is).
    """

    __slots__ = ("offsets", "lengths", "numel", "key_hashes", "shapes", "_cache")

    def __init__(self, offsets, lengths, numel: int, key_hashes=None, shapes=None) -> None:
        self.offsets = tuple(int(o) for o in offsets)
        self.lengths = tuple(int(n) for n in lengths)
        self.numel = int(numel)
        self.key_hashes = None if key_hashes is None else tuple(int(h) for h in key_hashes)
        self.shapes = tuple(torch.Size([n]) for n in self.lengths) if shapes is None else tuple(
            torch.Size(s) for s in shapes)
        if len(self.offsets) != len(self.lengths) or len(self.shapes) != len(self.lengths):
            raise ValueError("Segments: one offset and one shape per length")
        if any(s.numel() != n for s, n in zip(self.shapes, self.lengths)):
            raise ValueError("Segments: a shape of another number of entries than its length")
        self._cache: dict = {}

    def __len__(self) -> int:
        return len(self.offsets)

    def __iter__(self):
        return iter(zip(self.offsets, self.lengths))

    @property
    def total(self) -> int:
        """Entries in all segments together."""
        return sum(self.lengths)

    def cached(self, key, make):
        """``make()`` computed once per ``key`` (plain data derived from the segments and the
        codec's settings named in ``key``)."""
        value = self._cache.get(key)
        if value is None:
            value = self._cache[key] = make()
        return value

    def runs(self) -> tuple[tuple[int, int], ...]:
        """(offset, length) runs covering the segments, adjacent ones merged (cached)."""
        return self.cached("runs", lambda: merged_runs(self.offsets, self.lengths))

    def index(self, device=None) -> torch.Tensor:
        """The buffer positions of the segments' entries, in order (int64, cached per
        device)."""
        cpu = self.cached("index", lambda: torch.cat(
            [torch.arange(off, off + n, dtype=torch.int64) for off, n in self]
        ) if len(self) else torch.zeros(0, dtype=torch.int64))
        if device is None or torch.device(device).type == "cpu":
            return cpu
        return self.cached(("index", str(device)), lambda: cpu.to(device))

    def int64(self, name: str, values) -> torch.Tensor:
        """``values`` (one per segment) as a cached int64 CPU tensor named ``name``."""
        return self.cached(("int64", name), lambda: torch.tensor(list(values), dtype=torch.int64))

    def arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(offsets, lengths) as int64 CPU tensors (for the native kernels)."""
        return self.int64("offsets", self.offsets), self.int64("lengths", self.lengths)
