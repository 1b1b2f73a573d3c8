"""The segmented codecs of the fused exchange select, per segment, exactly what the
per-tensor codec selects on that tensor alone (top-k's sampled threshold, DGC's k, sample,
rounds and masking), in one call over the flat buffer."""

from __future__ import annotations

import pytest
import torch

from easgd_lightning.hooks.compressors import _native
from easgd_lightning.hooks.compressors.base import num_selected
from easgd_lightning.hooks.compressors.dgc import (
    DGCCompressor,
    SelectRule,
    dgc_segments,
    dgc_select_values,
    momentum_select_values,
)
from easgd_lightning.hooks.compressors.segments import Segments
from easgd_lightning.hooks.compressors.topk import TopKCompressor, topk_segments, topk_select

#: (offset, length) of the compressed tensors in a buffer of 9000 entries: a gap (a dense
#: tensor) between some of them, lengths that make the sample strides differ
SEGS = Segments([0, 3000, 3500, 7100], [3000, 500, 3600, 1900], 9000)


def _as_set(idx: torch.Tensor, val: torch.Tensor) -> dict[int, float]:
    return dict(zip(idx.tolist(), val.tolist()))


#: a long segment whose whole-tensor sample takes the kernel's histogram selection
LONG = Segments([0, 6500], [6000, 2000], 9000)


@pytest.mark.parametrize(("native", "segs", "sample"), [(True, SEGS, 700), (False, SEGS, 700), (True, LONG, 10**5)])
def test_topk_segments_equal_each_tensor_alone(native, segs, sample):
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(segs.numel, generator=g)
    flat[3000:3500] = 0.5  # ties everywhere: the sample keeps its order statistic
    ref_idx, ref_val = [], []
    for off, n in segs:
        i, v = topk_select(flat[off : off + n], 0.02, sample_size=sample)
        ref_idx.append(i + off)
        ref_val.append(v)
    work = flat.clone()
    if native:
        assert _native.available()
        idx, val = topk_segments(work, segs, 0.02, sample, zero_sent=True, scratch={})
    else:
        with _native.disabled():
            idx, val = topk_segments(work, segs, 0.02, sample, zero_sent=True, scratch={})
    assert torch.equal(idx, torch.cat(ref_idx)) and torch.equal(val, torch.cat(ref_val))
    expect = flat.clone()
    expect[idx] = 0
    assert torch.equal(work, expect)  # the residual: the sent entries zeroed


def _dgc_reference(g, u, v, density, momentum, rule):
    """The per-tensor rule on each segment (views of u, v: updated in place)."""
    out, most = {}, 0
    for off, n in SEGS:
        gs, us, vs = g[off : off + n], u[off : off + n], v[off : off + n]
        k = num_selected(n, density)
        if momentum > 0:
            i, x, r = momentum_select_values(gs, us, vs, momentum, False, k, rule, {})
        else:
            vs.add_(gs)
            i, x, r = dgc_select_values(vs, k, rule, {})
        out.update(_as_set(i + off, x.clone()))
        vs[i] = 0
        us[i] = 0
        most = max(most, r)
    return out, most


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_dgc_segments_equal_each_tensor_alone_over_steps(momentum):
    """Three steps (u, v carried): the same entries, values, rounds and u, v as the
    per-tensor rule; the 1% sample of short tensors makes the refinement rounds (and the
    exact top-k among > 1.3 k survivors) happen."""
    rule = SelectRule(sample_ratio=0.01)
    u_ref, v_ref = torch.zeros(SEGS.numel), torch.zeros(SEGS.numel)
    u, v = u_ref.clone(), v_ref.clone()
    g = torch.Generator().manual_seed(1)
    rounds_seen = set()
    for step, density in enumerate((0.05, 0.01, 1.0)):
        grad = torch.randn(SEGS.numel, generator=g) * (1 + step)
        ref, most = _dgc_reference(grad, u_ref, v_ref, density, momentum, rule)
        idx, val, rounds = dgc_segments(grad, u, v, SEGS, density, momentum, False, rule, {})
        assert _as_set(idx, val) == ref and rounds == most, step
        assert torch.equal(u, u_ref) and torch.equal(v, v_ref), step
        rounds_seen.add(rounds)
    assert len(rounds_seen) > 1


def test_compress_segments_one_payload_with_buffer_indices():
    """One payload for all segments; decoding it gives each tensor's own sparsification."""
    comp = TopKCompressor(0.02, sample_size=700)
    flat = torch.randn(SEGS.numel, generator=torch.Generator().manual_seed(2))
    payload = comp.compress_segments(flat.clone(), SEGS, {})
    assert len(payload.tensors) == 1
    dense = comp.decompress(payload, torch.Size([SEGS.numel]))
    for off, n in SEGS:
        i, v = topk_select(flat[off : off + n], 0.02, sample_size=700)
        want = torch.zeros(n)
        want[i] = v
        assert torch.equal(dense[off : off + n], want)
    assert not DGCCompressor(clip_norm=1.0).fused_segments and DGCCompressor().fused_segments
