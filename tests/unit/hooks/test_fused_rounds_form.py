"""hooks/_fused.py's multi-round form (``rounds_segments``: sgc, adaptive): which codecs take
it, and how ``start_exchange_flat`` drives it -- first round at launch, the others, the
residual update and this rank's buffer at finish (the 2-rank numbers:
tests/distributed/test_fused_rounds.py)."""

from __future__ import annotations

import torch

from easgd_lightning.hooks import build_compressor, make_memory
from easgd_lightning.hooks._fused import fusable, has_fused_rounds, layout_for, start_exchange_flat
from easgd_lightning.hooks.collective import ProcessGroupCollective
from easgd_lightning.hooks.compressors.adaptive import AdaptiveCompressor
from easgd_lightning.hooks.compressors.base import has_fused_form
from easgd_lightning.hooks.compressors.sgc import SGCCompressor
from easgd_lightning.hooks.compressors.topk import topk_select
from tests.helpers import MeteredSoloCollective


class OwnSGC(SGCCompressor):
    def aggregate(self, tensor, state, collective):  # a rule of its own: not the parent's rounds
        return super().aggregate(tensor, state, collective)


class OwnAdaptive(AdaptiveCompressor):
    def select_values(self, flat, state):
        return super().select_values(flat, state)


def test_sgc_adaptive_and_powersgd_take_the_rounds_form_and_only_it():
    sgc, adaptive, psgd = build_compressor("sgc"), build_compressor("adaptive"), build_compressor("powersgd")
    assert has_fused_rounds(sgc) and has_fused_rounds(adaptive) and has_fused_rounds(psgd)
    # no one-call form (compress_segments): the PS codec path and the one-call tests skip them
    assert not has_fused_form(sgc) and not has_fused_form(adaptive) and not has_fused_form(psgd)
    # ACP-SGD, under PowerSGD, replaces its rule: its own one-call form, not its parent's rounds
    acp = build_compressor("acpsgd")
    assert has_fused_form(acp) and not has_fused_rounds(acp)
    assert fusable(sgc, ProcessGroupCollective()) and fusable(adaptive, ProcessGroupCollective())
    assert not fusable(sgc, ProcessGroupCollective(), plan={"t": None})
    assert not fusable(sgc, MeteredSoloCollective())  # no batched all-gathers
    assert not has_fused_rounds(OwnSGC()) and not has_fused_rounds(OwnAdaptive())
    assert not has_fused_rounds(build_compressor("topk"))
    off = build_compressor("sgc")
    off.fused_segments = False  # the per-tensor exchange, as a test or a user asks
    assert not has_fused_rounds(off)


class Logged(MeteredSoloCollective):
    """World of one that logs its all-reduces."""

    def __init__(self) -> None:
        super().__init__("unit_rounds")
        self.log: list[int] = []

    def all_reduce_sum(self, tensors):
        self.log.append(sum(t.numel() for t in tensors))
        return super().all_reduce_sum(tensors)


SHAPES = [(300,), (7,), (500,)]
KEYS = ["a", "b", "c"]


def test_sgc_rounds_are_driven_at_launch_and_at_finish():
    """Summaries (256 + 1 and 256 + 1 values) at launch; at finish the aggregation of both
    tensors (S = 1 in a world of one: the first step skips, the second aggregates)."""
    comp = build_compressor("sgc", threshold=0.5, sample_size=256, min_numel=100, memory=True)
    memory, states, coll = make_memory(comp), {}, Logged()
    layout = layout_for(states, SHAPES, KEYS, 100)
    flat = torch.randn(807, generator=torch.Generator().manual_seed(0))
    for step, aggregated in ((0, False), (1, True)):
        pending = start_exchange_flat(flat, layout, comp, memory, states, coll, want_local=True)
        assert coll.log == [2 * 257] and pending.local is None  # the first round only
        mean, local, _ = pending.finish()
        assert coll.log == [2 * 257] + ([800] if aggregated else [])
        assert torch.equal(mean, flat) and torch.equal(local, flat)  # mean of one; skipped: local
        group = states[layout.group]["segment_states"]
        assert [st["last_aggregated"] for st in group] == [aggregated] * 2
        assert [st["step"] for st in group] == [step + 1] * 2
        assert torch.equal(memory.residual("a"), torch.zeros(300))  # updated at finish: p - p
        coll.log.clear()


def test_adaptive_rounds_end_at_launch():
    """Its calls are blocking (measured): the exchange is over at launch, so a caller that
    reads this rank's buffer then (the elastic exchange) has it."""
    comp = build_compressor("adaptive", bandwidth=1e4, compute_time=0.01, min_numel=100)
    memory, states = make_memory(comp), {}
    layout = layout_for(states, SHAPES, KEYS, 100)
    flat = torch.randn(807, generator=torch.Generator().manual_seed(1))
    pending = start_exchange_flat(flat, layout, comp, memory, states, MeteredSoloCollective("unit_rounds"),
                                  want_local=True)
    assert pending.local is not None
    ratio = comp.last_ratio  # N = 800 known from this exchange: 100 / (1 * 8) / 800
    assert abs(ratio - 100 / 8 / 800) < 1e-12
    mean, local, _ = pending.finish()
    for off, n in ((0, 300), (307, 500)):  # each tensor its own top-k: ceil(0.015625 * n) entries
        idx, _ = topk_select(flat[off : off + n], ratio)
        assert set(torch.nonzero(local[off : off + n]).view(-1).tolist()) == set(idx.tolist())
        assert idx.numel() == {300: 5, 500: 8}[n]
    assert torch.equal(mean[:300], local[:300]) and torch.equal(mean[300:307], flat[300:307])
    assert torch.equal(memory.residual("a") + local[:300], flat[:300])  # nothing lost
