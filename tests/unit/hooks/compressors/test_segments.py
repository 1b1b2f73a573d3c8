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


def test_dgc_ties_at_the_kth_magnitude_go_to_the_lowest_index_on_both_paths():
    """More than 1.3 k survivors with a tie at the k-th magnitude (the case that parted the
    two paths of a real DDP run after 102 steps): the per-tensor rule and the segmented
    kernel keep the same entries, the lowest-indexed of the tied ones."""
    from easgd_lightning.hooks.compressors.dgc import k_largest

    assert k_largest(torch.tensor([1.0, 3.0, 2.0, 3.0, 2.0, 2.0]), 3).tolist() == [1, 2, 3]
    rule = SelectRule(sample_ratio=1.0, upper=1.3)
    n, k = 4000, 40
    v = torch.linspace(0.1, 0.5, n)  # distinct, below the tied values
    tied = torch.tensor([3000, 120, 2500, 777, 1999, 3900])
    v[torch.arange(3, 38) * 7] = torch.linspace(2.0, 3.0, 35)  # 35 clear winners
    v[tied] = -1.5  # six at the k-th magnitude: 5 of them make 40
    v[tied[:3]] = 1.5
    segs = Segments([0], [n], n)
    # a threshold below the tied values lets > 1.3 k survive: the exact top-k among them
    idx, _, _ = dgc_select_values(v.clone(), k, rule._replace(sample_ratio=0.01, upper=1.0), {})
    idx_seg, _, _ = dgc_segments(torch.zeros(n), torch.zeros(n), v.clone(), segs, k / n, 0.0, False,
                                 rule._replace(sample_ratio=0.01, upper=1.0), {})
    assert sorted(idx.tolist()) == sorted(idx_seg.tolist())
    kept = set(idx.tolist()) & set(tied.tolist())
    assert kept == set(sorted(tied.tolist())[:5])


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
    assert DGCCompressor(clip_norm=1.0).fused_segments and DGCCompressor().fused_segments


def _per_tensor(comp, flat, segs, hashes=None):
    """Each segment compressed and decoded alone (its own state, key hash, step 0)."""
    out = torch.zeros_like(flat)
    work = flat.clone()
    for j, (off, n) in enumerate(segs):
        st = {"key_hash": hashes[j]} if hashes else {}
        out[off : off + n] = comp.decompress(comp.compress(work[off : off + n], st), torch.Size([n]))
    return out


#: a segment the sign kernel decodes through its table (>= 4096 entries, 5003: a tail too)
SIGN_LONG = Segments([0, 5100], [5003, 3000], 9000)


@pytest.mark.parametrize(("native", "segs"), [(True, SEGS), (False, SEGS), (True, SIGN_LONG)])
def test_signsgd_segments_equal_each_tensor_alone(native, segs):
    """One call: every segment's own scale ||x||_1 / n and signs (each from its own byte),
    decoded as the per-tensor codec decodes that tensor alone (SIGN_LONG: a segment that
    the kernel decodes through its table of +-scale rows); the residual kernel writes
    x - decoded on the segments only."""
    from easgd_lightning.hooks.compressors.base import offer_residual
    from easgd_lightning.hooks.compressors.signsgd import SignSGDCompressor

    comp = SignSGDCompressor()
    flat = torch.randn(segs.numel, generator=torch.Generator().manual_seed(1))
    flat[3000:3500] = -flat[3000:3500].abs()  # one sign over a stretch
    ref = _per_tensor(comp, flat, segs)
    ctx = _native.disabled() if not native else _null()
    with ctx:
        work = flat.clone()
        offer_residual(work)
        payload = comp.compress_segments(work, segs, {})
        local = comp.local_segments(payload, segs, {})
        assert payload.tensors[0].numel() == len(segs)
        assert payload.tensors[1].numel() == sum((n + 7) // 8 for n in segs.lengths)
        mean = torch.full_like(flat, 7.0)
        comp.mean_segments([payload.tensors, payload.tensors], payload.meta, segs, mean, 2)
    on = torch.zeros(segs.numel, dtype=torch.bool)
    on[segs.index()] = True
    assert torch.equal(local[on], ref[on]) and torch.equal(mean[on], ((ref + ref) / 2)[on])
    if native:  # the kernel wrote the residual on the segments, nothing elsewhere
        assert torch.equal(work[on], (flat - ref)[on]) and torch.equal(work[~on], flat[~on])


@pytest.mark.parametrize(("native", "unbiased", "ratio"), [
    (True, False, 0.03), (False, False, 0.03), (True, True, 0.03), (True, True, 0.02), (False, True, 0.02)])
def test_randomk_segments_draw_each_tensors_own_set(native, unbiased, ratio):
    """The kernel derives each tensor's seeds (CRC-32 of seed:step:key:n, as zlib) and
    draws what the per-tensor codec draws for that tensor alone; the mean scatters the
    summed values over world. ``unbiased``: each entry scaled by its stratum's size (ratio
    0.03: no k divides its n) or by n / k (0.02: every k does), the residual p - C(p)."""
    from easgd_lightning.hooks.compressors.base import offer_residual
    from easgd_lightning.hooks.compressors.randomk import RandomKCompressor

    hashes = [11, 2**31 - 5, 0, 123456789]
    segs = Segments(SEGS.offsets, SEGS.lengths, SEGS.numel, hashes)
    comp = RandomKCompressor(ratio=ratio, seed=7, unbiased=unbiased)
    flat = torch.randn(segs.numel, generator=torch.Generator().manual_seed(2))
    ref = _per_tensor(comp, flat, segs, hashes)
    with _native.disabled() if not native else _null():
        work = flat.clone()
        offer_residual(work)
        payload = comp.compress_segments(work, segs, {})
        local = comp.local_segments(payload, segs, {})
        mean = torch.full_like(flat, 7.0)
        comp.mean_segments([payload.tensors[0] * 3], payload.meta, segs, mean, 3)
    assert payload.tensors[0].numel() == sum(num_selected(n, ratio) for n in segs.lengths)
    if unbiased:  # E[C(x)] = x: the drawn entries carry about n / k times their value
        assert float(local.abs().sum()) > 10 * float(torch.cat([payload.tensors[0]]).abs().sum())
    on = torch.zeros(segs.numel, dtype=torch.bool)
    on[segs.index()] = True
    expect = torch.zeros_like(flat)  # the per-tensor all-reduce: decode(3 x values) / 3
    for (off, n), h in zip(segs, hashes):
        p = comp.compress(flat[off : off + n].clone(), {"key_hash": h})
        summed = type(p)((p.tensors[0] * 3,), p.meta)
        expect[off : off + n] = comp.decompress(summed, torch.Size([n])) / 3
    assert torch.equal(local[on], ref[on]) and torch.equal(mean[on], expect[on])
    assert torch.equal(work[on], (flat - ref)[on])  # the drawn entries left the residual


def _null():
    from contextlib import nullcontext

    return nullcontext()


def _fused_names():
    from easgd_lightning.hooks.compressors import build_compressor, compressor_names
    from easgd_lightning.hooks.compressors.base import has_fused_form

    return [n for n in compressor_names() if has_fused_form(build_compressor(n))]


@pytest.mark.parametrize("name", _fused_names())
def test_every_fused_codec_transmits_what_its_per_tensor_rule_does(name):
    """Whatever runs the fused exchange transmits, per segment, what its own compress /
    decompress transmits for that tensor alone (defaults, first exchange)."""
    from easgd_lightning.hooks.compressors import build_compressor

    comp, ref_comp = build_compressor(name), build_compressor(name)
    flat = torch.randn(SEGS.numel, generator=torch.Generator().manual_seed(3))
    state = {"world_size": 1}
    payload = comp.compress_segments(flat.clone(), SEGS, state)
    local = comp.local_segments(payload, SEGS, state)
    ref_comp.load_state_dict(comp.state_dict())  # a seed drawn at the first call (qsgd)
    ref = torch.zeros_like(flat)
    for off, n in SEGS:
        st = {"world_size": 1}
        ref[off : off + n] = ref_comp.decompress(ref_comp.compress(flat[off : off + n].clone(), st), torch.Size([n]))
    on = torch.zeros(SEGS.numel, dtype=torch.bool)
    on[SEGS.index()] = True
    assert torch.equal(local[on], ref[on])


@pytest.mark.parametrize(("native", "levels", "bucket", "coding"), [
    (True, 127, 512, "fixed"), (True, 7, 64, "fixed"), (False, 7, 64, "fixed"), (True, 1, 0, "fixed"),
    (True, 300, 64, "fixed"), (False, 300, 64, "fixed"), (True, 32767, 512, "fixed"),  # int16: 10, 16 bits
    (True, 1, 64, "elias"), (False, 7, 64, "elias"), (True, 300, 0, "elias"),  # the paper's coding
])
def test_qsgd_segments_equal_each_tensor_alone(native, levels, bucket, coding):
    """Every tensor's own buckets and noise words (from its key, the stream and the call
    count, derived in the kernel), one packed stream: decoded, the per-tensor levels times
    the per-tensor norms; the mean adds the ranks' payloads in order and divides."""
    from easgd_lightning.hooks.compressors.qsgd import QSGDCompressor

    hashes = [5, 2**31 - 1, 77, 0]
    segs = Segments(SEGS.offsets, SEGS.lengths, SEGS.numel, hashes)
    comp = QSGDCompressor(levels, bucket_size=bucket, seed=9, coding=coding)
    ref_comp = QSGDCompressor(levels, bucket_size=bucket, seed=9, coding=coding)
    flat = torch.randn(segs.numel, generator=torch.Generator().manual_seed(5))
    flat[7100:7200] = 0  # a bucket of zeros
    with _native.disabled() if not native else _null():
        state = {}
        for _ in range(2):  # the second call draws other noise, as each tensor's would
            payload = comp.compress_segments(flat, segs, state)
        local = comp.local_segments(payload, segs, state).clone()
        mean = torch.full_like(flat, 7.0)
        comp.mean_segments([payload.tensors, payload.tensors], payload.meta, segs, mean, 2)
        ref = torch.zeros_like(flat)
        for j, (off, n) in enumerate(segs):
            st = {"key_hash": hashes[j], "noise_calls": 1}
            ref[off : off + n] = ref_comp.decompress(ref_comp.compress(flat[off : off + n], st), torch.Size([n]))
    on = torch.zeros(segs.numel, dtype=torch.bool)
    on[segs.index()] = True
    assert torch.equal(local[on], ref[on]) and torch.equal(mean[on], ((ref + ref) / 2)[on])
    assert local[on].abs().max() > 0
    if coding == "fixed":
        assert payload.tensors[1].numel() == (segs.total * comp.width + 7) // 8
    else:  # one Elias stream: its levels are the per-tensor streams' levels, in order
        from easgd_lightning.hooks.compressors.qsgd import elias_decode

        levels_all = elias_decode(payload.tensors[1], segs.total)
        per_tensor = [elias_decode(ref_comp.compress(flat[o : o + n], {"key_hash": h, "noise_calls": 1}).tensors[1], n)
                      for (o, n), h in zip(segs, hashes)]
        assert torch.equal(levels_all, torch.cat(per_tensor)) and levels_all.abs().max() > 0


def test_a_subclass_that_changes_the_per_tensor_rule_leaves_the_fused_form():
    """A codec subclass (a user's ``compression._target_``) that overrides the per-tensor
    rule below the class that wrote ``compress_segments`` runs the per-tensor exchange --
    else its parent's fused form would send the parent's payload; a subclass that changes
    only its settings keeps the fused form, and so does one that writes its own fused form
    beside its own rule (SparseLoCo under top-k)."""
    from easgd_lightning.hooks.compressors.base import has_fused_form
    from easgd_lightning.hooks.compressors.fp16 import BF16Compressor
    from easgd_lightning.hooks.compressors.sparseloco import SparseLoCoCompressor

    class HalfTopK(TopKCompressor):  # another selection rule
        def select_values(self, flat, state):
            idx = torch.arange(0, flat.numel(), 2)
            return idx, flat[idx]

    class TwoBitTopK(TopKCompressor):  # SparseLoCo's shape, without its explicit flag
        def compress(self, tensor, state):
            return super().compress(tensor, state)

    class TightTopK(TopKCompressor):  # settings only
        def __init__(self, **kw):
            super().__init__(ratio=0.001, **kw)

    assert has_fused_form(TopKCompressor()) and has_fused_form(TightTopK()) and has_fused_form(BF16Compressor())
    assert not has_fused_form(HalfTopK()) and not has_fused_form(TwoBitTopK())
    class OwnCode(SparseLoCoCompressor):  # another value code under SparseLoCo's fused form
        def compress(self, tensor, state):
            return super().compress(tensor, state)

    assert has_fused_form(SparseLoCoCompressor()) and not has_fused_form(OwnCode())
    assert has_fused_form(DGCCompressor(clip_norm=1.0))


def test_the_sparse_loop_follows_a_subclass_selection_rule():
    """RedSync's and SIDCo's fused form is the sparse base's loop, which runs each segment
    through the codec's own ``select_values``: a subclass that changes only that rule keeps
    the fused exchange and its payload is that rule's, segment by segment (the reference:
    the subclass's rule on each segment alone); one that changes ``compress`` leaves it."""
    from easgd_lightning.hooks.compressors.base import has_fused_form
    from easgd_lightning.hooks.compressors.segments import Segments
    from easgd_lightning.hooks.compressors.sidco import SIDCoCompressor
    from easgd_lightning.hooks.compressors.sparse import unpack_sparse

    class EveryThird(SIDCoCompressor):
        def select_values(self, flat, state):
            idx = torch.arange(1, flat.numel(), 3)
            return idx, flat[idx] * 2

    class OwnPayload(SIDCoCompressor):
        def compress(self, tensor, state):
            return super().compress(tensor, state)

    assert has_fused_form(EveryThird()) and not has_fused_form(OwnPayload())
    flat = torch.randn(50, generator=torch.Generator().manual_seed(4))
    segs = Segments([3, 30], [20, 15], 50)
    payload = EveryThird().compress_segments(flat.clone(), segs, {})
    idx, val = unpack_sparse(payload.tensors[0], payload.meta["index_dtype"], payload.meta["dtype"])
    want_idx = torch.cat([torch.arange(1, n, 3) + off for off, n in segs])
    assert torch.equal(idx.long(), want_idx) and torch.equal(val, flat[want_idx] * 2)
