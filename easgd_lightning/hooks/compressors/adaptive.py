"""``adaptive``: bandwidth-adaptive top-k (the rule we adopt; ALGORITHMS.md section 6).

Rule, per step, from the measured link bandwidth B (bytes/s, counting payload bytes sent
plus received by this rank), the step's compute time T, p ranks, N elements
communicated per step (D = N * elem bytes dense) and e bytes per sparse (index, value):
  dense all-reduce moves ~2D:          if 2D / B <= budget * T, send dense (fast link);
  sparse all-gather moves ~p k e:      else k = budget * T * B / (p e), ratio = k / N
                                       clamped to [min_ratio, max_ratio];
  dense again if p * ratio * e >= 2 * elem bytes (sparse would not be cheaper).
Ranks agree on the ratio with a 4-byte max all-reduce (so all take the same path).
Until both B and T are known (or with ``bandwidth`` / ``compute_time`` fixed in the
config) it sends dense. Measurements come in through :meth:`AdaptiveCompressor.
observe_bandwidth` and :meth:`observe_compute_time` (exponential moving averages, weight
``smoothing`` on the old value): each exchange observes the payload bytes and seconds of
its own calls on the collective it is handed (:class:`~.base.MeasuredCollective`; never
the global meter, which only observes), the attach points feed the compute time, and a
strategy may feed either. Sparse steps use gradient dropping (:mod:`.topk`)
with residuals.
The measurements and the sizes of the tensors seen (N) are the compressor's
:meth:`~AdaptiveCompressor.state_dict`, so a resumed run picks the ratios it would have.
Defaults: budget = 1.0, min_ratio = 0.001, max_ratio = 0.25, smoothing = 0.8,
memory = true.
Fused exchange (:mod:`easgd_lightning.hooks._fused`, ``rounds_segments``): one agreement per
exchange -- the sizes of all its compressed tensors are noted, one proposal from N, one max
all-reduce --, then either one all-reduce of the concatenated tensors (dense) or one call
selecting every tensor's own top-k at the agreed ratio (topk's ``topk_segments``) and one
all-gather; the bandwidth is observed once, on the exchange's own calls (blocking, so the
exchange is over when it is launched). Once every tensor's size has been seen (from the
second exchange, or from a resumed checkpoint) and with ``bandwidth`` and ``compute_time``
fixed, the numbers are the per-tensor path's. What differs: in the very first exchange the
per-tensor path proposes while N still grows tensor by tensor (its first tensors may get a
denser ratio), and with a measured link it feeds the bandwidth EMA once per tensor, so a
step's later tensors may get another ratio than its first; here one measurement and one
ratio serve the whole exchange, and the index width in the cost is that of the buffer's
indices (4 bytes below 2**31 entries, as for each tensor). Still section 6's rule: the
density is chosen per step from the measured bandwidth and compute time, agreed by all
ranks, each tensor keeping its own top-k threshold.
"""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors.base import (
    Collective,
    MeasuredCollective,
    Payload,
    check_bool,
    check_int,
    check_momentum,
    check_positive,
    check_ratio,
    index_dtype_for,
    may_write_residual,
    residual_written,
    scratch_buffer,
    scratch_of,
    wants_local,
)
from easgd_lightning.hooks.compressors.segments import Segments
from easgd_lightning.hooks.compressors.sparse import SparseCompressor, sparse_payload
from easgd_lightning.hooks.compressors.topk import topk_indices, topk_segments, topk_select

__all__ = ["AdaptiveCompressor", "adaptive_ratio"]


def adaptive_ratio(
    *,
    numel: int,
    elem_bytes: int,
    index_bytes: int,
    world_size: int,
    bandwidth: float | None,
    compute_time: float | None,
    budget: float = 1.0,
    min_ratio: float = 0.001,
    max_ratio: float = 0.25,
) -> float:
    """The density to use (1.0 = dense), following the module docstring's rule."""
    if not bandwidth or not compute_time or bandwidth <= 0 or compute_time <= 0 or numel <= 0:
        return 1.0
    p = max(1, world_size)
    dense_bytes = numel * elem_bytes
    allowed = budget * compute_time
    if 2.0 * dense_bytes / bandwidth <= allowed:
        return 1.0
    e = elem_bytes + index_bytes
    ratio = allowed * bandwidth / (p * e) / numel
    ratio = min(max_ratio, max(min_ratio, ratio))
    if p * ratio * e >= 2.0 * elem_bytes:
        return 1.0
    return ratio


class AdaptiveCompressor(SparseCompressor):
    """Top-k whose density follows the measured bandwidth and compute time.

    Args:
        budget: fraction of the step's compute time communication may take (> 0).
        min_ratio, max_ratio: bounds on the sparse density, in (0, 1].
        smoothing: EMA weight on the previous measurement, in [0, 1).
        bandwidth: fixed link bandwidth in bytes/s (null: measured).
        compute_time: fixed compute time per step in seconds (null: measured).
        sample_size, exact: top-k selection options (see :mod:`.topk`).
        min_numel, memory: attach-point policies (see :class:`Compressor`).
    """

    name = "adaptive"
    #: the fused exchange's multi-round form (``rounds_segments``): one agreement per exchange
    fused_segments = True

    def __init__(
        self,
        *,
        budget: float = 1.0,
        min_ratio: float = 0.001,
        max_ratio: float = 0.25,
        smoothing: float = 0.8,
        bandwidth: float | None = None,
        compute_time: float | None = None,
        sample_size: int = 100_000,
        exact: bool = False,
        min_numel: int | None = None,
        memory: bool | None = None,
    ) -> None:
        super().__init__(min_numel=min_numel, memory=memory)
        self.budget = check_positive("compression.budget", budget)
        self.min_ratio = check_ratio("compression.min_ratio", min_ratio)
        self.max_ratio = check_ratio("compression.max_ratio", max_ratio)
        if self.min_ratio > self.max_ratio:
            raise ValueError(
                f"compression.min_ratio ({min_ratio}) must be <= compression.max_ratio ({max_ratio})"
            )
        self.smoothing = check_momentum("compression.smoothing", smoothing)
        self.bandwidth = None if bandwidth is None else check_positive("compression.bandwidth", bandwidth)
        self.compute_time = (
            None if compute_time is None else check_positive("compression.compute_time", compute_time)
        )
        self.sample_size = check_int("compression.sample_size", sample_size, 1)
        self.exact = check_bool("compression.exact", exact)
        self._bw: float | None = None
        self._ct: float | None = None
        self._numels: dict[int, int] = {}
        self.last_ratio: float = 1.0

    # ------------------------------------------------------------ measurement hooks
    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.smoothing * old + (1.0 - self.smoothing) * new

    def observe_bandwidth(self, nbytes: float, seconds: float) -> None:
        """Feed one exchange: bytes sent + received by this rank and its wall time."""
        if nbytes > 0 and seconds > 0:
            self._bw = self._ema(self._bw, nbytes / seconds)

    def observe_compute_time(self, seconds: float) -> None:
        """Feed the compute time (forward + backward) of one step, in seconds."""
        if seconds > 0:
            self._ct = self._ema(self._ct, seconds)

    @property
    def measured_bandwidth(self) -> float | None:
        return self.bandwidth if self.bandwidth is not None else self._bw

    @property
    def measured_compute_time(self) -> float | None:
        return self.compute_time if self.compute_time is not None else self._ct

    def choose_ratio(self, world_size: int, elem_bytes: int = 4, index_bytes: int = 4) -> float:
        """This rank's proposal for the density (1.0 = dense)."""
        total = sum(self._numels.values())
        return adaptive_ratio(
            numel=total,
            elem_bytes=elem_bytes,
            index_bytes=index_bytes,
            world_size=world_size,
            bandwidth=self.measured_bandwidth,
            compute_time=self.measured_compute_time,
            budget=self.budget,
            min_ratio=self.min_ratio,
            max_ratio=self.max_ratio,
        )

    # ------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict:
        """Measured bandwidth / compute time (EMAs), the tensor sizes seen, the last ratio."""
        return {
            "bandwidth": self._bw,
            "compute_time": self._ct,
            "numels": {int(k): int(n) for k, n in self._numels.items()},
            "last_ratio": self.last_ratio,
        }

    def load_state_dict(self, state: dict) -> None:
        bw, ct = state.get("bandwidth"), state.get("compute_time")
        self._bw = None if bw is None else float(bw)
        self._ct = None if ct is None else float(ct)
        self._numels = {int(k): int(n) for k, n in (state.get("numels") or {}).items()}
        self.last_ratio = float(state.get("last_ratio", 1.0))

    # ------------------------------------------------------------ codec
    def select(self, flat: torch.Tensor, state: dict) -> torch.Tensor:
        ratio = float(state.get("ratio", self.max_ratio))
        return topk_indices(flat, ratio, exact=self.exact, sample_size=self.sample_size)

    def select_values(self, flat: torch.Tensor, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        ratio = float(state.get("ratio", self.max_ratio))
        return topk_select(
            flat, ratio, exact=self.exact, sample_size=self.sample_size, scratch=scratch_of(state)
        )

    def compress(self, tensor: torch.Tensor, state: dict) -> Payload:
        ratio = float(state.get("ratio", 1.0))
        if ratio >= 1.0:
            return Payload((tensor.reshape(-1),), {"dense": True})
        return super().compress(tensor, state)

    def decompress(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        if payload.meta.get("dense"):
            return payload.tensors[0].reshape(shape)
        return super().decompress(payload, shape)

    def aggregate(
        self, tensor: torch.Tensor, state: dict, collective: Collective
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Agree on the density (max over ranks), then dense all-reduce or sparse top-k;
        observe the bandwidth of this exchange (its own calls, measured on ``collective``)."""
        measured = MeasuredCollective(collective)
        mean, local = self._agree_and_exchange(tensor, state, measured)
        self.observe_bandwidth(measured.traffic.nbytes, measured.traffic.seconds)
        return mean, local

    def _agree_and_exchange(
        self, tensor: torch.Tensor, state: dict, collective: Collective
    ) -> tuple[torch.Tensor, torch.Tensor]:
        world = collective.world_size
        self._numels[int(state.get("key_hash", 0))] = tensor.numel()
        ratio = self._agree(tensor, tensor.numel(), state, collective)
        if ratio >= 1.0:
            (summed,) = collective.all_reduce_sum([tensor.reshape(-1)])
            return summed.reshape(tensor.shape) / world, tensor.clone()
        return super().aggregate(tensor, state, collective)

    def _agree(self, like: torch.Tensor, numel: int, state: dict, collective) -> float:
        """The ratio every rank uses: each proposes from its measurements, for indices into
        ``numel`` entries, and the largest wins (one 4-byte max all-reduce)."""
        index_bytes = torch.empty((), dtype=index_dtype_for(numel)).element_size()
        proposal = self.choose_ratio(collective.world_size, like.element_size(), index_bytes)
        vote = torch.tensor([proposal], dtype=torch.float64, device=like.device)
        (agreed,) = collective.all_reduce_max([vote])
        ratio = float(agreed[0])
        state["ratio"] = ratio
        self.last_ratio = ratio
        return ratio

    # ------------------------------------------------------------ fused exchange
    def rounds_segments(self, flat: torch.Tensor, segments: Segments, state: dict, collective, out: torch.Tensor):
        """The fused exchange (module docstring): every segment's mean written into ``out``;
        returns this rank's transmitted buffer (None unless :func:`~.base.wants_local`). Its
        calls are blocking (measured), so the generator ends at its first advance."""
        measured = MeasuredCollective(collective)
        local = self._agree_and_exchange_segments(flat, segments, state, measured, out)
        self.observe_bandwidth(measured.traffic.nbytes, measured.traffic.seconds)
        return local
        yield  # a generator (the fused rounds' protocol), with no round left for finish

    def _agree_and_exchange_segments(self, flat, segments: Segments, state: dict, collective, out):
        world = collective.world_size
        self._numels.update(zip(segments.key_hashes, segments.lengths))
        ratio = self._agree(flat, segments.numel, state, collective)
        if ratio >= 1.0:
            index = segments.index(flat.device)
            (summed,) = collective.all_reduce_sum([flat.index_select(0, index)])
            out.index_copy_(0, index, summed / world)
            if not wants_local(state):
                return None
            return scratch_buffer(scratch_of(state), "local", flat.numel(), flat.dtype, flat.device).copy_(flat)
        zero = may_write_residual(flat)
        idx, val = self._select_all(flat, segments, state, ratio, zero)
        state["last_nnz"] = int(idx.numel())
        payload = sparse_payload(flat, idx, val)
        if zero:
            residual_written(flat)
        local = self.local_segments(payload, segments, state) if wants_local(state) else None
        rows = collective.all_gather(list(payload.tensors))
        self.mean_segments(rows, payload.meta, segments, out, world)
        return local

    def _select_all(self, flat, segments: Segments, state: dict, ratio: float, zero: bool):
        """(indices relative to ``flat``, values) of every segment's own top-k at ``ratio``
        (:func:`topk_select` on each alone): topk's one native call, its plan kept for the
        last ratio only (a measured ratio changes every step), or the exact variant's loop;
        with ``zero`` the sent entries of ``flat`` are set to 0."""
        scratch = scratch_of(state)
        if self.exact:
            picks = [(topk_select(flat[off : off + n], ratio, exact=True), off) for off, n in segments]
            idx = torch.cat([i.long() + off for (i, _), off in picks])
            val = torch.cat([v.clone() for (_, v), _ in picks])
            if zero:
                flat.index_fill_(0, idx, 0)
            return idx, val
        held = scratch.get("adaptive_segments")
        if held is None or held[0] != ratio or held[1] is not segments:
            held = scratch["adaptive_segments"] = (
                ratio, segments, Segments(segments.offsets, segments.lengths, segments.numel))
        return topk_segments(flat, held[2], ratio, self.sample_size, zero_sent=zero, scratch=scratch)
