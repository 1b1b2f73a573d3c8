"""Shared machinery of the sparsifiers: (index, value) payloads that are all-gathered.

A sparsifier only chooses *which* entries to send (``select``); this base class packs
the chosen int32 indices and their values into one byte message (``nnz * (4 + 4)`` bytes
for fp32), all-gathers the messages (lengths differ per rank) and scatter-adds every
rank's entries into the dense mean. Not a config name by itself.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from easgd_lightning.hooks.compressors.base import (
    Collective,
    Compressor,
    Payload,
    index_dtype_for,
    num_selected,
    pack_sparse,
    unpack_sparse,
)

__all__ = ["SparseCompressor", "sparse_payload", "sample_threshold"]


def sparse_payload(
    flat: torch.Tensor, indices: torch.Tensor, values: torch.Tensor | None = None
) -> Payload:
    """The wire form of selected entries of the 1-D ``flat`` (values default to flat[indices])."""
    if values is None:
        values = flat[indices]
    idt = index_dtype_for(flat.numel())
    return Payload(
        (pack_sparse(indices.to(idt), values.to(flat.dtype)),),
        {
            "numel": flat.numel(),
            "dtype": flat.dtype,
            "index_dtype": idt,
            "nnz": int(indices.numel()),
        },
    )


def sample_threshold(magnitudes: torch.Tensor, ratio: float, sample_size: int) -> torch.Tensor:
    """Magnitude threshold keeping a ``ratio`` fraction, estimated on a strided sample.

    Gradient dropping (Aji & Heafield 2017): the sample is every ``stride``-th entry with
    ``stride = max(1, n // sample_size)``; the threshold is the (k_s + 1)-th largest sample
    value with k_s = ceil(ratio * |sample|), so ``|g| > thr`` keeps ~ratio * n entries
    (exactly the k largest when the sample is the whole tensor and there are no ties).
    Returns a 0-d tensor; -1 when everything should be kept.
    """
    n = magnitudes.numel()
    stride = max(1, n // max(1, sample_size))
    sample = magnitudes[::stride] if stride > 1 else magnitudes
    m = sample.numel()
    ks = num_selected(m, ratio)
    if ks >= m:
        return magnitudes.new_tensor(-1.0)
    # (ks+1)-th largest == (m-ks)-th smallest
    if sample.dtype in (torch.float16, torch.bfloat16):
        sample = sample.float()
    return torch.kthvalue(sample, m - ks).values.to(magnitudes.dtype)


class SparseCompressor(Compressor):
    """Base of the (index, value) sparsifiers; subclasses implement :meth:`select`."""

    aggregation = "allgather"
    default_memory = True

    @abstractmethod
    def select(self, flat: torch.Tensor, state: dict) -> torch.Tensor:
        """Indices (1-D, int64, unique) of the entries of ``flat`` to send."""

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        flat = tensor.reshape(-1)
        idx = self.select(flat, state)
        state["last_nnz"] = int(idx.numel())
        return sparse_payload(flat, idx)

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        meta = payload.meta
        idx, val = unpack_sparse(payload.tensors[0], meta["index_dtype"], meta["dtype"])
        out = torch.zeros(meta["numel"], dtype=meta["dtype"], device=val.device)
        out.index_add_(0, idx.long(), val)
        return out.reshape(shape)

    def aggregate(
        self, tensor: torch.Tensor, state: dict, collective: Collective
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All-gather every rank's (index, value) message and scatter-add them once."""
        payload = self.compress(tensor, state)
        local = self.decompress(payload, tensor.shape)
        gathered = collective.all_gather(list(payload.tensors))
        meta = payload.meta
        parts = [unpack_sparse(rank[0], meta["index_dtype"], meta["dtype"]) for rank in gathered]
        idx = torch.cat([p[0].long() for p in parts])
        val = torch.cat([p[1] for p in parts])
        total = torch.zeros(meta["numel"], dtype=meta["dtype"], device=tensor.device)
        total.index_add_(0, idx.to(tensor.device), val.to(tensor.device))
        mean = total.reshape(tensor.shape) / collective.world_size
        return mean.to(tensor.dtype), local.to(tensor.dtype)
