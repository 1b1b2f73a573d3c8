"""Shared machinery of the sparsifiers: (index, value) payloads that are all-gathered.

A sparsifier only chooses *which* entries to send (``select``); this base class packs
the chosen int32 indices and their values into one byte message (``nnz * (4 + 4)`` bytes
for fp32), all-gathers the messages (lengths differ per rank) and scatter-adds every
rank's entries into the dense mean. Not a config name by itself.

Selection helpers: :func:`count_above` counts ``|x| > thr`` in one pass and
:func:`select_above` returns the indices and values above a threshold in one pass (native
kernel; eager ``abs``/``nonzero``/gather elsewhere), so a threshold rule costs one counting
pass at most before it gathers. When the compressed tensor was offered by the residual
memory, the sent entries are zeroed in place: that is p - C(p), the next residual.
:meth:`SparseCompressor.compress_segments` is the fused exchange's form: one payload for
all the compressed tensors of a flat buffer, indices relative to the buffer, each tensor
selected by its own rule (``select_segments``: a native call over all segments where the
codec has one, else a loop over them).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from easgd_lightning.hooks.compressors import _native
from easgd_lightning.hooks.compressors.base import (
    Collective,
    Compressor,
    Payload,
    index_dtype_for,
    may_write_residual,
    num_selected,
    pack_sparse,
    record_sparse,
    residual_written,
    scratch_buffer,
    scratch_of,
    sparse_out,
    start_collective,
    unpack_sparse,
    with_out,
)
from easgd_lightning.hooks.compressors.segments import SEGMENT_STATES, Segments

__all__ = [
    "SparseCompressor",
    "divide_at",
    "sparse_payload",
    "sample_threshold",
    "strided_sample",
    "count_above",
    "select_above",
]


def strided_sample(flat: torch.Tensor, sample_size: int) -> torch.Tensor:
    """Every ``stride``-th entry, ``stride = max(1, n // sample_size)`` (a view)."""
    stride = max(1, flat.numel() // max(1, sample_size))
    return flat[::stride] if stride > 1 else flat


def _thr_value(thr) -> float:
    return float(thr)


def count_above(flat: torch.Tensor, thr, *, inclusive: bool = False) -> int:
    """Number of entries with |x| > thr (>= thr when ``inclusive``); one read pass."""
    lib = _native.use(flat)
    if lib is not None:
        fn = getattr(lib, f"count_abs_{_native.SUFFIX[flat.dtype]}")
        return int(fn(flat.data_ptr(), flat.numel(), _thr_value(thr), int(inclusive)))
    mag = flat.abs()
    return int(((mag >= thr) if inclusive else (mag > thr)).sum())


def select_above(
    flat: torch.Tensor,
    thr,
    *,
    inclusive: bool = False,
    expect: int | None = None,
    scratch: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices ascending int64, values) of the entries with |x| > thr (>= when ``inclusive``).

    One pass over ``flat`` with the native kernel (a second only when more than the
    reserved ``2 * expect + 1024`` entries pass); the results may be views of ``scratch``
    buffers, valid until the next call with the same scratch.
    """
    n = flat.numel()
    lib = _native.use(flat)
    if lib is not None:
        fn = getattr(lib, f"select_abs_{_native.SUFFIX[flat.dtype]}")
        cap = min(n, 2 * (expect if expect is not None else n // 100) + 1024)
        if scratch is not None and "sel_idx" in scratch:
            cap = min(n, max(cap, scratch["sel_idx"].numel()))
        t = _thr_value(thr)
        while True:
            idx = scratch_buffer(scratch, "sel_idx", cap, torch.int64, flat.device)
            val = scratch_buffer(scratch, "sel_val", cap, flat.dtype, flat.device)
            c = int(fn(flat.data_ptr(), n, t, int(inclusive), cap, idx.data_ptr(), val.data_ptr()))
            if c <= cap:
                return idx[:c], val[:c]
            cap = c
    mag = flat.abs()
    idx = torch.nonzero((mag >= thr) if inclusive else (mag > thr)).squeeze(1)
    return idx, flat[idx]


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
    if sample.dtype in (torch.float16, torch.bfloat16):
        sample = sample.float()
    if 4 * (ks + 1) <= m:  # the same order statistic; a small top-k is cheaper than a selection
        if _native.use(sample.contiguous()) is not None:  # |sample| = sample: magnitudes
            return _native.kth_largest_abs(sample.contiguous(), ks + 1).to(magnitudes.dtype)
        return torch.topk(sample, ks + 1, sorted=False).values.min().to(magnitudes.dtype)
    # (ks+1)-th largest == (m-ks)-th smallest
    return torch.kthvalue(sample, m - ks).values.to(magnitudes.dtype)


def divide_at(total: torch.Tensor, idx: torch.Tensor, world: int) -> torch.Tensor:
    """total <- total / world where ``total`` is zero outside ``idx`` (repeats allowed):
    only the touched entries are divided, so the mean of a sparse sum costs k reads and
    writes, not a pass over the dense tensor; bitwise ``total.div_(world)`` (0 / w = 0)."""
    if world == 1:
        return total
    if idx.numel() * 4 >= total.numel() or not total.is_contiguous():  # one pass is cheaper
        return total.div_(world)
    flat = total.view(-1)
    return _native.scatter_into(flat, idx, flat.index_select(0, idx).div_(world)).view_as(total)


class SparseCompressor(Compressor):
    """Base of the (index, value) sparsifiers; subclasses implement :meth:`select`."""

    aggregation = "allgather"
    default_memory = True
    #: the per-tensor rule keeps state of its own across steps (SIDCo's stage count and
    #: target correction): the fused exchange keeps one such dict per segment in the
    #: group's state (``segment_states``, checkpointed), :meth:`select_segments` hands each
    #: segment its own
    segment_state: ClassVar[bool] = False

    @abstractmethod
    def select(self, flat: torch.Tensor, state: dict) -> torch.Tensor:
        """Indices (1-D, int64, unique) of the entries of ``flat`` to send."""

    def select_values(self, flat: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) to send; the default gathers ``flat`` at :meth:`select`."""
        idx = self.select(flat, state)
        return idx, flat[idx]

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        flat = tensor.reshape(-1)
        idx, val = self.select_values(flat, state)
        state["last_nnz"] = int(idx.numel())
        payload = sparse_payload(flat, idx, val)
        if may_write_residual(tensor) and flat.data_ptr() == tensor.data_ptr():
            _native.zero_at(flat, idx)  # p - C(p): the sent entries leave the residual
            residual_written(tensor)
        return payload

    def select_segments(
        self, flat: torch.Tensor, segments: Segments, state: dict, zero_sent: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices relative to ``flat``, values) of :meth:`select_values` on each segment
        alone (a loop; codecs with a native segmented rule override it), each with its own
        state (with ``segment_state``, the group's ``segment_states[j]``; else scratch); with
        ``zero_sent`` the sent entries of ``flat`` are set to 0."""
        scratch = scratch_of(state)
        own = state.setdefault(SEGMENT_STATES, [{} for _ in range(len(segments))]) if self.segment_state else None
        idx, val = [], []
        for j, (off, n) in enumerate(segments):
            st = own[j] if own is not None else scratch.setdefault(("segment", j), {})
            i, v = self.select_values(flat[off : off + n], st)
            idx.append(i.long() + off)
            val.append(v.clone())
        idx_all, val_all = torch.cat(idx), torch.cat(val)
        if zero_sent:
            _native.zero_at(flat, idx_all)
        return idx_all, val_all

    select_segments.follows_select_values = True  # type: ignore[attr-defined]  # (has_fused_form)

    def compress_segments(self, flat: torch.Tensor, segments: Segments, state: dict) -> Payload:
        """One payload for every segment of the 1-D ``flat`` (indices relative to it),
        each selected by its own rule; the residual is written in place when ``flat`` was
        offered (as :meth:`compress`)."""
        zero = may_write_residual(flat)
        idx, val = self.select_segments(flat, segments, state, zero)
        state["last_nnz"] = int(idx.numel())
        payload = sparse_payload(flat, idx, val)
        if zero:
            residual_written(flat)
        return payload

    def local_segments(self, payload: Payload, segments: Segments, state: dict) -> torch.Tensor:
        meta = payload.meta
        n, dt = segments.numel, meta["dtype"]
        dev = payload.tensors[0].device
        return self.decompress(Payload(payload.tensors, with_out(meta, state, "local", n, dt, dev)),
                               torch.Size([n])).reshape(-1)

    def mean_segments(self, received, meta: dict, segments: Segments, out: torch.Tensor, world: int) -> None:
        """Every rank's (index, value) entries added in rank order into ``out`` (its
        segments zeroed first), divided by ``world`` at the touched entries."""
        for off, n in segments.runs():
            out[off : off + n].zero_()
        parts = [unpack_sparse(tensors[-1], meta["index_dtype"], out.dtype) for tensors in received]
        idx = torch.cat([p[0] for p in parts]).to(device=out.device, dtype=torch.int64)
        val = torch.cat([p[1] for p in parts]).to(out.device)
        _native.scatter_add_into(out, idx, val)
        divide_at(out, idx, world)

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        meta = payload.meta
        idx, val = unpack_sparse(payload.tensors[0], meta["index_dtype"], meta["dtype"])
        out = sparse_out(meta, meta["numel"], meta["dtype"], val.device)
        _native.scatter_into(out, idx, val)
        record_sparse(meta, out, idx)
        return out.reshape(shape)

    def _launch(
        self, tensor: torch.Tensor, state: dict, collective: Collective
    ) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """All-gather every rank's (index, value) message; ``finish`` scatter-adds them once."""
        shape, n, dt, dev = tensor.shape, tensor.numel(), tensor.dtype, tensor.device
        payload = self.compress(tensor, state)
        meta = payload.meta
        local = self.decompress(Payload(payload.tensors, with_out(meta, state, "local", n, dt, dev)), shape)
        pending = start_collective(collective, "all_gather", list(payload.tensors))

        def finish() -> torch.Tensor:
            parts = [unpack_sparse(rank[0], meta["index_dtype"], meta["dtype"]) for rank in pending.wait()]
            idx = torch.cat([p[0].long() for p in parts]).to(dev)
            val = torch.cat([p[1] for p in parts]).to(dev)
            total_meta = with_out(meta, state, "total", n, meta["dtype"], dev)
            total = sparse_out(total_meta, meta["numel"], meta["dtype"], dev)
            _native.scatter_add_into(total, idx, val)
            divide_at(total, idx, collective.world_size)
            record_sparse(total_meta, total, idx)
            return total.view(shape).to(dt)

        return local.to(dt), finish
