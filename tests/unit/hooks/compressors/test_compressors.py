"""Each compressor against a reference written here (pure tensor code, no process group)."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
from omegaconf import OmegaConf

from easgd_lightning.hooks import build_compressor, compressor_names
from easgd_lightning.hooks.compressors import PLUGINS, base
from easgd_lightning.hooks.compressors.adaptive import adaptive_ratio
from easgd_lightning.hooks.compressors.dgc import DGCCompressor
from easgd_lightning.hooks.compressors.powersgd import power_iteration
from easgd_lightning.hooks.compressors.qsgd import (
    noise_words,
    qsgd_dequantize,
    qsgd_quantize,
    unpack_levels,
)
from easgd_lightning.hooks.compressors.redsync import threshold_bisect, trimmed_topk
from easgd_lightning.hooks.compressors.sidco import (
    exponential_threshold,
    gamma_threshold,
    gammainccinv,
    gpareto_threshold,
    multistage_threshold,
)
from easgd_lightning.hooks.compressors.sketch import build_sketch, peel_decode, sketch_hashes
from tests.helpers import SoloCollective

CONF = Path(__file__).resolve().parents[4] / "conf" / "compression"



def roundtrip(comp, x, state=None):
    state = {} if state is None else state
    payload = comp.compress(x, state)
    return payload, comp.decompress(payload, x.shape)


def reference_topk_mask(x: np.ndarray, k: int) -> np.ndarray:
    order = np.argsort(-np.abs(x), kind="stable")
    mask = np.zeros(x.size, dtype=bool)
    mask[order[:k]] = True
    return mask


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- top-k


@pytest.mark.parametrize("exact", [False, True])
def test_topk_keeps_exactly_the_k_largest(exact):
    x = torch.randn(5000, generator=gen(0))
    comp = build_compressor("topk", ratio=0.01, exact=exact)
    payload, y = roundtrip(comp, x)
    k = math.ceil(0.01 * 5000)
    mask = reference_topk_mask(x.numpy(), k)
    np.testing.assert_array_equal(y.numpy() != 0, mask)
    np.testing.assert_array_equal(y.numpy()[mask], x.numpy()[mask])
    assert comp.payload_bytes(payload) == k * (4 + 4)


def test_topk_sampled_threshold_on_a_large_tensor():
    x = torch.randn(400_000, generator=gen(1))
    comp = build_compressor("topk", ratio=0.001)
    payload, y = roundtrip(comp, x)
    kept = y != 0
    k = 400
    assert 0.5 * k <= int(kept.sum()) <= 1.5 * k
    assert x[kept].abs().min() > x[~kept].abs().max()  # a threshold rule
    assert comp.payload_bytes(payload) == int(kept.sum()) * 8


def test_topk_float64_payload_bytes():
    x = torch.randn(1000, dtype=torch.float64, generator=gen(2))
    comp = build_compressor("topk", ratio=0.1)
    payload, y = roundtrip(comp, x)
    assert y.dtype == torch.float64
    assert comp.payload_bytes(payload) == 100 * (4 + 8)


# ----------------------------------------------------------------------------- random-k


def test_randomk_same_indices_on_every_rank_and_payload():
    x = torch.randn(1000, generator=gen(3))
    a, b = build_compressor("randomk", ratio=0.05), build_compressor("randomk", ratio=0.05)
    pa, ya = roundtrip(a, x)
    pb, yb = roundtrip(b, torch.randn(1000, generator=gen(4)))
    torch.testing.assert_close(pa.meta["indices"], pb.meta["indices"])  # shared seed
    assert a.payload_bytes(pa) == 50 * 4  # values only: indices are regenerated
    assert int((ya != 0).sum()) == 50
    torch.testing.assert_close(ya[pa.meta["indices"]], x[pa.meta["indices"]])


def test_randomk_unbiased_over_seeds():
    x = torch.randn(40, generator=gen(5))
    comp = build_compressor("randomk", ratio=0.25, unbiased=True, memory=False)
    state: dict = {}
    total = torch.zeros_like(x)
    steps = 4000
    for _ in range(steps):
        total += roundtrip(comp, x, state)[1]
    mean = total / steps
    # std of the mean per entry: |x| sqrt((n/k - 1) / steps) ~ 0.027 |x|
    assert torch.allclose(mean, x, atol=0.15 * float(x.abs().max()))


# ----------------------------------------------------------------------------- QSGD


def test_qsgd_unbiased_and_on_the_grid():
    torch.manual_seed(0)
    x = torch.randn(1000, generator=gen(6))
    comp = build_compressor("qsgd", levels=4, bucket_size=100, seed=7)
    payload, y = roundtrip(comp, x)
    norms, packed = payload.tensors
    q = unpack_levels(packed, 1000, 4)  # s = 4: 3 bits of level + a sign bit
    assert packed.numel() == 500 and int(q.abs().max()) <= 4
    bnorm = torch.linalg.vector_norm(x.view(10, 100), dim=1)
    torch.testing.assert_close(norms, bnorm)
    levels = (y.view(10, 100) / bnorm.unsqueeze(1) * 4)
    torch.testing.assert_close(levels, levels.round(), atol=1e-4, rtol=0)
    total = torch.zeros_like(x)
    steps = 3000
    state: dict = {"key_hash": 1}  # one tensor's state across its steps (fresh noise per call)
    for _ in range(steps):
        total += roundtrip(comp, x, state)[1]
    # z-scores with the exact per-entry variance (norm / s)^2 f (1 - f), f = frac(s|x|/norm)
    scaled = (x.view(10, 100).abs() * 4 / bnorm.unsqueeze(1)).view(-1)
    frac = scaled - scaled.floor()
    var = (bnorm.repeat_interleave(100) / 4) ** 2 * frac * (1 - frac)
    z = (total / steps - x).abs() / torch.sqrt(var / steps + 1e-12)
    assert float(z.max()) < 5.0, float(z.max())


def test_qsgd_payload_bytes_formula():
    """ceil(log2(s + 1)) bits of level plus a sign bit per entry, and a norm per bucket:
    s = 1 is 2 bits per entry, not a byte."""
    x = torch.randn(1300, generator=gen(7))
    for levels, bits in ((1, 2), (2, 3), (3, 3), (4, 4), (7, 4), (15, 5), (127, 8), (128, 9), (40000, 17)):
        comp = build_compressor("qsgd", levels=levels, bucket_size=512)
        payload, _ = roundtrip(comp, x)
        assert comp.payload_bytes(payload) == math.ceil(1300 * bits / 8) + math.ceil(1300 / 512) * 4


@pytest.mark.parametrize("levels", [1, 3, 6, 127, 200, 40000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_qsgd_packed_decode_is_the_unpacked_rule(levels, dtype):
    """Decoding the packed stream gives exactly norm_bucket * level / s of the unpacked
    levels, and the stream is those levels as w-bit two's-complement fields, little-endian
    (re-packed here bit by bit, independently of the codec)."""
    x = torch.randn(2049, generator=gen(12), dtype=torch.float64).to(dtype)
    comp = build_compressor("qsgd", levels=levels, bucket_size=100, seed=5)
    payload, y = roundtrip(comp, x)
    norms, packed = payload.tensors
    w = int(levels).bit_length() + 1
    n_b = math.ceil(2049 / 100)
    # the unpacked rule from the same noise: the words of call 0 of tensor key 0, seed 5
    ref_norms, q = qsgd_quantize(x, levels, 100, seeds=noise_words(5, 0, 0))
    assert torch.equal(norms, ref_norms) and norms.numel() == n_b
    q = q.to(torch.int64).tolist()
    stream = "".join(format(v & ((1 << w) - 1), f"0{w}b")[::-1] for v in q)
    stream += "0" * (-len(stream) % 8)
    expect = bytes(int(stream[i:i + 8][::-1], 2) for i in range(0, len(stream), 8))
    assert packed.numpy().tobytes() == expect
    scale = (ref_norms.double() / levels).repeat_interleave(100)[:2049]
    ref = (torch.tensor(q, dtype=torch.float64) * scale)
    torch.testing.assert_close(y.double(), ref, rtol=1e-6 if dtype == torch.float32 else 1e-15, atol=0)
    assert torch.equal(y, qsgd_dequantize(ref_norms, torch.tensor(q), levels, 100, 2049, dtype))


def _omega(v: int) -> str:
    """Elias omega code of v >= 1 as a bit string (the textbook recursion)."""
    code = "0"
    while v > 1:
        b = format(v, "b")
        code = b + code
        v = len(b) - 1
    return code


@pytest.mark.parametrize("levels", [1, 5, 127])
def test_qsgd_elias_coding_is_the_papers_code(levels):
    """coding=elias: omega(nnz + 1), then per nonzero level omega(gap), sign bit,
    omega(|level|), written out here from the unpacked levels; the decode is the
    unpacked rule, and s = 1 costs well under the fixed 2 bits per entry."""
    x = torch.randn(5000, generator=gen(13))
    comp = build_compressor("qsgd", levels=levels, bucket_size=512, seed=9, coding="elias")
    payload, y = roundtrip(comp, x)
    norms, stream = payload.tensors
    ref_norms, q = qsgd_quantize(x, levels, 512, seeds=noise_words(9, 0, 0))
    q = q.to(torch.int64).tolist()
    nz = [i for i, v in enumerate(q) if v]
    bits = _omega(len(nz) + 1)
    prev = -1
    for i in nz:
        bits += _omega(i - prev) + ("1" if q[i] < 0 else "0") + _omega(abs(q[i]))
        prev = i
    bits += "0" * (-len(bits) % 8)
    expect = bytes(int(bits[j:j + 8][::-1], 2) for j in range(0, len(bits), 8))  # bit j -> byte j/8, bit j%8
    assert stream.numpy().tobytes() == expect
    assert torch.equal(y, qsgd_dequantize(ref_norms, torch.tensor(q), levels, 512, 5000, torch.float32))
    if levels == 1:
        assert comp.payload_bytes(payload) * 8 / 5000 < 1.0


def test_qsgd_bad_coding_is_refused():
    with pytest.raises(ValueError, match="compression.coding must be one of"):
        build_compressor("qsgd", coding="huffman")


# ----------------------------------------------------------------------------- PowerSGD


def test_powersgd_full_rank_reconstructs_exactly():
    m = torch.randn(12, 7, generator=gen(8), dtype=torch.float64)
    q = torch.randn(7, 7, generator=gen(9), dtype=torch.float64)
    p, q2 = power_iteration(m, q)
    torch.testing.assert_close(p @ q2.t(), m)


def test_powersgd_rank_r_matrix_through_the_compressor():
    a = torch.randn(64, 2, generator=gen(10))
    b = torch.randn(2, 48, generator=gen(11))
    x = (a @ b).reshape(64, 4, 12)  # a conv-like 3-D tensor of rank 2 as (64, 48)
    comp = build_compressor("powersgd", rank=2)
    payload, y = roundtrip(comp, x)
    torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4)
    assert comp.payload_bytes(payload) == (64 + 48) * 2 * 4
    mean, local = comp.aggregate(x, {}, SoloCollective())
    torch.testing.assert_close(mean, x, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(local, x, atol=1e-4, rtol=1e-4)


def test_powersgd_vectors_travel_dense_and_warm_start_is_kept():
    comp = build_compressor("powersgd", rank=2)
    v = torch.randn(100, generator=gen(12))
    payload, y = roundtrip(comp, v)
    torch.testing.assert_close(y, v)
    assert comp.payload_bytes(payload) == 400
    state: dict = {}
    x = torch.randn(30, 20, generator=gen(13))
    comp.compress(x, state)
    q1 = state["q"].clone()
    comp.compress(x, state)
    assert state["q"].shape == (20, 2) and not torch.equal(q1, state["q"])


# ----------------------------------------------------------------------------- sign


def test_signsgd_keeps_the_scale_and_packs_bits():
    x = torch.randn(1001, generator=gen(14))
    x[5] = 0.0
    comp = build_compressor("signsgd")
    payload, y = roundtrip(comp, x)
    scale = x.abs().sum() / x.numel()
    expected = torch.where(x >= 0, scale, -scale)
    torch.testing.assert_close(y, expected)
    assert comp.payload_bytes(payload) == math.ceil(1001 / 8) + 4
    assert payload.tensors[1].dtype == torch.uint8


def test_bit_packing_roundtrip():
    bits = torch.rand(77, generator=gen(15)) > 0.5
    packed = base.pack_bits(bits)
    assert packed.numel() == 10
    torch.testing.assert_close(base.unpack_bits(packed, 77), bits)


# ----------------------------------------------------------------------------- fp16 / bf16


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_precision(name, dtype):
    x = torch.randn(300, generator=gen(16))
    comp = build_compressor(name)
    payload, y = roundtrip(comp, x)
    assert payload.tensors[0].dtype == dtype
    torch.testing.assert_close(y, x.to(dtype).float())
    assert comp.payload_bytes(payload) == 600


def test_none_is_identity():
    x = torch.randn(3, 4, generator=gen(17))
    comp = build_compressor("none")
    payload, y = roundtrip(comp, x)
    torch.testing.assert_close(y, x)
    assert comp.payload_bytes(payload) == 48


# ----------------------------------------------------------------------------- DGC


def test_dgc_warmup_schedule_steps_and_epochs():
    comp = build_compressor("dgc", ratio=0.001, warmup_ratio_steps=8)
    got = [comp.density(s) for s in range(10)]
    assert got == [0.25, 0.25, 0.0625, 0.0625, 0.0156, 0.0156, 0.004, 0.004, 0.001, 0.001]
    comp = build_compressor("dgc", warmup_ratio_steps=999, warmup_ratio_epochs=2)
    comp.set_steps_per_epoch(2)  # 4 warm-up steps, one per stage
    assert [comp.density(s) for s in range(5)] == [0.25, 0.0625, 0.0156, 0.004, 0.001]
    assert build_compressor("dgc", warmup_ratio_steps=0).density(0) == 0.001


def reference_dgc(gs, m, nesterov, k):
    """DGC by hand in numpy, with exact top-k selection of v."""
    u = np.zeros_like(gs[0])
    v = np.zeros_like(gs[0])
    sent = []
    for g in gs:
        if nesterov:
            u = (u + g) * m
            v = v + u + g
        else:
            u = m * u + g
            v = v + u
        mask = reference_topk_mask(v, k)
        out = np.where(mask, v, 0.0)
        v = np.where(mask, 0.0, v)
        u = np.where(mask, 0.0, u)
        sent.append(out)
    return sent, u, v


@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_momentum_correction_and_factor_masking(nesterov):
    n, ratio = 2000, 0.01
    gs = [torch.randn(n, generator=gen(20 + i), dtype=torch.float64) for i in range(4)]
    comp = DGCCompressor(ratio=ratio, momentum=0.9, nesterov=nesterov, warmup_ratio_steps=0)
    state: dict = {}
    ys = [roundtrip(comp, g, state)[1] for g in gs]
    # the selection is a threshold: at most 1.3k, at least 0.8k entries
    ref, u, v = reference_dgc([g.numpy() for g in gs], 0.9, nesterov, 20)
    for y in ys:
        nnz = int((y != 0).sum())
        assert 0.8 * 20 <= nnz <= 1.3 * 20
    # with the exact-count case the result must match the exact top-k reference
    comp2 = DGCCompressor(ratio=ratio, momentum=0.9, nesterov=nesterov, warmup_ratio_steps=0, sample_ratio=1.0)
    state2: dict = {}
    ys2 = [roundtrip(comp2, g, state2)[1] for g in gs]
    for y, r in zip(ys2, ref):
        np.testing.assert_allclose(y.numpy(), r, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(state2["u"].numpy(), u, atol=1e-12)
    np.testing.assert_allclose(state2["v"].numpy(), v, atol=1e-12)
    # masking: sent coordinates restart from zero in both u and v
    last = ys2[-1] != 0
    assert torch.all(state2["u"][last] == 0) and torch.all(state2["v"][last] == 0)


def test_dgc_local_clipping_scaled_by_sqrt_p():
    g = torch.full((100,), 1.0)  # norm 10
    comp = DGCCompressor(ratio=1.0, momentum=0.0, clip_norm=2.0, warmup_ratio_steps=0)
    state = {"world_size": 4}
    _, y = roundtrip(comp, g, state)
    assert math.isclose(float(torch.linalg.vector_norm(y)), 2.0 / math.sqrt(4), rel_tol=1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_dense_part_keeps_momentum(nesterov):
    """A tensor under min_numel sends DGC's momentum dense (no accumulation, no masking):
    u <- m u + g, send u (Nesterov: u <- m (u + g), send u + g); clipping first."""
    comp = DGCCompressor(momentum=0.9, nesterov=nesterov, clip_norm=1.0)
    gs = [np.random.default_rng(30 + i).standard_normal(50) for i in range(4)]
    state: dict = {}
    u = np.zeros(50)
    for g in gs:
        sent = comp.dense_part(torch.tensor(g).view(5, 10), state, 4).numpy().reshape(-1)
        gc = g * min(1.0, (1.0 / 2.0) / np.linalg.norm(g))  # clip at C / sqrt(p)
        u = 0.9 * (u + gc) if nesterov else 0.9 * u + gc
        np.testing.assert_allclose(sent, u + gc if nesterov else u, rtol=1e-12)
    assert not np.allclose(sent, gs[-1])
    # no momentum: the (clipped) gradient itself, and no state kept
    plain = DGCCompressor(momentum=0.0).dense_part(torch.ones(3), {}, 1)
    assert torch.equal(plain, torch.ones(3))


def test_dgc_bind_training_owns_momentum_and_sets_epochs():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    comp = DGCCompressor(ratio=0.001, warmup_ratio_steps=999, warmup_ratio_epochs=1)
    notes = comp.bind_training([opt], 8)
    assert opt.param_groups[0]["momentum"] == 0 and not opt.param_groups[0]["nesterov"]
    assert any("momentum was set to 0" in n for n in notes)
    assert comp.total_warmup_steps == 8 and comp.density(7) == 0.004 and comp.density(8) == 0.001
    # unknown epoch length: the step default, said so; momentum 0 leaves the optimizer alone
    comp = DGCCompressor(momentum=0.0, warmup_ratio_steps=20, warmup_ratio_epochs=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    notes = comp.bind_training([opt], None)
    assert comp.total_warmup_steps == 20 and opt.param_groups[0]["momentum"] == 0.5
    assert notes and "warmup_ratio_steps=20" in notes[0]


def reference_residual_topk(ds, k):
    """An elastic exchange's sparsifier by hand: v <- v + d, send the exact top-k of v, zero
    them in v (no momentum, no clipping)."""
    v = np.zeros_like(ds[0])
    sent = []
    for d in ds:
        v = v + d
        mask = reference_topk_mask(v, k)
        sent.append(np.where(mask, v, 0.0))
        v = np.where(mask, 0.0, v)
    return sent, v


def test_dgc_bind_exchange_drops_the_gradient_rules_for_every_tensor():
    """Under sync_easgd / local_sgd (bind_exchange) DGC is its sparsifier alone: large tensors
    accumulate the difference into v without momentum or clipping, small tensors send the
    difference itself; the optimizer's momentum is left alone."""
    n, k = 2000, 20
    ds = [np.random.default_rng(40 + i).standard_normal(n) for i in range(5)]
    comp = DGCCompressor(ratio=k / n, momentum=0.9, clip_norm=0.5, warmup_ratio_steps=0, sample_ratio=1.0)
    opt = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1, momentum=0.9)
    notes = comp.bind_exchange(None, None)
    assert not comp.gradient_mode and opt.param_groups[0]["momentum"] == 0.9
    assert notes and "momentum correction and local clipping are off" in notes[0]
    state: dict = {"world_size": 4}
    ys = [roundtrip(comp, torch.tensor(d), state)[1].numpy() for d in ds]
    ref, v = reference_residual_topk(ds, k)
    for y, r in zip(ys, ref):
        np.testing.assert_allclose(y, r, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(state["v"].numpy(), v, atol=1e-12)
    assert float(np.abs(state["u"].numpy()).max()) == 0.0  # no momentum kept
    # mass is conserved: everything sent plus the residual is the sum of the differences
    np.testing.assert_allclose(sum(ys) + state["v"].numpy(), sum(ds), atol=1e-10)
    small: dict = {}
    for d in ds[:3]:
        x = torch.tensor(d[:50]).view(5, 10)
        assert torch.equal(comp.dense_part(x, small, 4), x)
    assert small == {}
    # ddp's bind_training turns the gradient rules back on
    comp.bind_training([opt], None)
    assert comp.gradient_mode and opt.param_groups[0]["momentum"] == 0


def test_dgc_bind_exchange_warmup_counts_optimizer_steps():
    """The warm-up under an elastic strategy counts the strategy's optimizer steps (an
    exchange every tau steps), and warmup_ratio_epochs uses the Trainer's epoch length."""
    clock = {"step": 0}
    comp = DGCCompressor(ratio=0.001, warmup_ratio_steps=999, warmup_ratio_epochs=1, sample_ratio=1.0)
    assert comp.bind_exchange(8, lambda: clock["step"]) == [
        "compression=dgc exchanges elastic differences here, not gradients: its momentum "
        "correction and local clipping are off (the optimizer keeps its own momentum)"
    ]
    assert comp.total_warmup_steps == 8
    x = torch.randn(4000, generator=gen(5), dtype=torch.float64)
    state: dict = {}
    got = []
    for step in (0, 4, 6, 8):  # tau = 2: four exchanges over steps 0..8, not exchanges 0..3
        clock["step"] = step
        comp.compress(x, state)
        got.append(state["last_density"])
    assert got == [0.25, 0.0156, 0.004, 0.001]
    # the epoch length unknown: the step default, said so
    comp = DGCCompressor(momentum=0.0, warmup_ratio_steps=20, warmup_ratio_epochs=1)
    notes = comp.bind_exchange(None, None)
    assert comp.total_warmup_steps == 20 and notes == [
        "compression.warmup_ratio_epochs: the epoch length is unknown, so the DGC warm-up uses "
        "compression.warmup_ratio_steps=20"
    ]


def test_dgc_rejects_memory():
    with pytest.raises(ValueError, match="compression.memory"):
        build_compressor("dgc", memory=True)


# ----------------------------------------------------------------------------- RedSync


def test_redsync_trimmed_topk_is_exact():
    x = torch.randn(3000, generator=gen(30))
    k = 30
    idx = trimmed_topk(x.abs(), k)
    mask = np.zeros(3000, dtype=bool)
    mask[idx.numpy()] = True
    np.testing.assert_array_equal(mask, reference_topk_mask(x.numpy(), k))


def test_redsync_bisection_lands_in_k_to_2k():
    x = torch.randn(50_000, generator=gen(31))
    k = 50
    idx, thr = threshold_bisect(x.abs(), k)
    assert k <= idx.numel() <= 2 * k
    mask = torch.zeros(50_000, dtype=torch.bool)
    mask[idx] = True
    assert x[mask].abs().min() > x[~mask].abs().max()
    comp = build_compressor("redsync", ratio=0.001, method="bisect", reuse_steps=3)
    state: dict = {}
    payload, y = roundtrip(comp, x, state)
    assert comp.payload_bytes(payload) == int((y != 0).sum()) * 8
    roundtrip(comp, x, state)
    assert state["thr_age"] == 2  # reused


# ----------------------------------------------------------------------------- SIDCo


def test_gammainccinv_matches_scipy():
    for a in (0.3, 0.7, 1.0, 2.5, 8.0):
        for q in (0.25, 0.01, 0.001, 1e-5):
            ours = gammainccinv(a, q)
            assert math.isclose(ours, scipy.special.gammainccinv(a, q), rel_tol=1e-8), (a, q)


def test_sidco_thresholds_match_scipy_closed_forms():
    rng = np.random.default_rng(0)
    x = np.abs(rng.standard_t(3, size=20_000)) + 1e-6
    t = torch.from_numpy(x)
    delta = 0.001
    mean = x.mean()
    # exponential: scale = mean
    assert math.isclose(exponential_threshold(t, delta), scipy.stats.expon(scale=mean).isf(delta), rel_tol=1e-9)
    # gamma: the closed-form shape estimate, scipy's inverse survival function
    s = math.log(mean) - np.log(x).mean()
    a = (3 - s + math.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
    expected = scipy.stats.gamma(a, scale=mean / a).isf(delta)
    assert math.isclose(gamma_threshold(t, delta), expected, rel_tol=1e-7)
    # generalized Pareto by moments; scipy's shape c = -k
    v = x.var()
    k = (mean**2 / v - 1) / 2
    sigma = mean * (mean**2 / v + 1) / 2
    expected = scipy.stats.genpareto(c=-k, scale=sigma).isf(delta)
    assert math.isclose(gpareto_threshold(t, delta), expected, rel_tol=1e-9)


def test_sidco_selects_about_delta_on_exponential_data():
    rng = np.random.default_rng(1)
    g = torch.from_numpy(rng.laplace(size=200_000)).float()
    comp = build_compressor("sidco", ratio=0.01, distribution="exponential")
    _, y = roundtrip(comp, g)
    nnz = int((y != 0).sum())
    assert 0.8 * 2000 <= nnz <= 1.2 * 2000
    u = g.abs() / torch.linalg.vector_norm(g)
    two = multistage_threshold(u, 0.01, 2, "exponential")
    assert 0.7 * 2000 <= int((u > two).sum()) <= 1.3 * 2000


def test_sidco_stage_adaptation():
    rng = np.random.default_rng(2)
    # heavy tail: a single exponential fit lets too many through -> more stages
    g = torch.from_numpy(rng.standard_t(1.5, size=50_000)).float()
    comp = build_compressor("sidco", ratio=0.001, stages=1, adapt_every=5)
    state: dict = {}
    for _ in range(5):
        roundtrip(comp, g, state)
    assert state["stages"] == 2


# ----------------------------------------------------------------------------- sketch


def test_sketch_roundtrip_decodes_the_sparse_vector():
    x = torch.randn(20_000, generator=gen(40))
    comp = build_compressor("sketch", ratio=0.01)
    payload, y = roundtrip(comp, x)
    k = 200
    mask = reference_topk_mask(x.numpy(), k)
    np.testing.assert_allclose(y.numpy(), np.where(mask, x.numpy(), 0.0), atol=1e-5)
    width = math.ceil(1.5 * k / 3)
    assert comp.payload_bytes(payload) == math.ceil(20_000 / 8) + 3 * width * 4


def test_peel_decode_with_a_crowded_sketch_falls_back_to_least_squares():
    pos = torch.arange(0, 4000, 40)
    vals = torch.randn(pos.numel(), generator=gen(41), dtype=torch.float64)
    width = 45  # 135 cells for 100 values: peeling stalls, least squares finishes
    cols, signs = sketch_hashes(pos, 3, width, seed=5)
    sk = build_sketch(vals, cols, signs, width)
    torch.testing.assert_close(peel_decode(sk, cols, signs), vals)


# ----------------------------------------------------------------------------- adaptive


def test_adaptive_rule():
    common = dict(numel=1_000_000, elem_bytes=4, index_bytes=4, world_size=4)
    # unknown measurements or a fast link: dense
    assert adaptive_ratio(**common, bandwidth=None, compute_time=0.1) == 1.0
    assert adaptive_ratio(**common, bandwidth=1e11, compute_time=0.1) == 1.0
    # 100 MB/s, 10 ms of compute: k = 0.01 * 1e8 / (4 * 8) = 31250 -> ratio 0.03125
    r = adaptive_ratio(**common, bandwidth=1e8, compute_time=0.01)
    assert math.isclose(r, 0.03125)
    # clamped at min_ratio on a very slow link
    assert adaptive_ratio(**common, bandwidth=1e3, compute_time=0.01, min_ratio=0.001) == 0.001
    comp = build_compressor("adaptive", bandwidth=1e8, compute_time=0.01, memory=False)
    x = torch.randn(1_000_000, generator=gen(50))
    mean, local = comp.aggregate(x, {"key_hash": 1}, SoloCollective())
    assert math.isclose(comp.last_ratio, 0.03125 * 4 / 1, rel_tol=1e-9)  # p = 1 here
    assert 0.5 * comp.last_ratio * 1e6 <= int((mean != 0).sum()) <= 1.5 * comp.last_ratio * 1e6


def test_adaptive_observations_drive_the_ratio():
    comp = build_compressor("adaptive", smoothing=0.5)
    assert comp.choose_ratio(2) == 1.0
    comp.observe_bandwidth(1e6, 1.0)
    comp.observe_compute_time(0.001)
    comp._numels[0] = 1_000_000
    r = comp.choose_ratio(2)
    assert r == comp.min_ratio
    comp.observe_bandwidth(1e12, 1.0)  # EMA: 0.5e6 + 0.5e12
    assert comp.choose_ratio(2) == 1.0


def test_adaptive_measures_the_link_from_the_collective_it_is_handed(monkeypatch):
    """The bandwidth is the payload bytes / seconds of this exchange's own calls on the
    collective it is handed (not the global meter): with a clock that advances 0.25 s in
    each call, B = (vote 2 * 8 bytes + dense tensor 2 * 400 bytes) / 0.5 s."""
    clock = [100.0]
    monkeypatch.setattr(base.time, "perf_counter", lambda: clock[0])

    class SlowSolo(SoloCollective):
        def all_reduce_sum(self, tensors):
            clock[0] += 0.25
            return super().all_reduce_sum(tensors)

        def all_reduce_max(self, tensors):
            clock[0] += 0.25
            return super().all_reduce_max(tensors)

    comp = build_compressor("adaptive", memory=False)
    comp.aggregate(torch.randn(100, generator=gen(51)), {"key_hash": 0}, SlowSolo())
    assert comp.last_ratio == 1.0  # no compute time yet: dense
    assert comp.measured_bandwidth == pytest.approx(816 / 0.5)


# ----------------------------------------------------------------------------- configs and errors


@pytest.mark.parametrize(
    "name,params,key",
    [
        ("topk", {"ratio": 1.5}, "compression.ratio must be a number in (0, 1], got 1.5"),
        ("topk", {"ratio": 0}, "compression.ratio"),
        ("randomk", {"ratio": -0.1}, "compression.ratio"),
        ("dgc", {"ratio": 2}, "compression.ratio"),
        ("dgc", {"memory": True}, "compression.memory must be false for dgc"),
        ("dgc", {"warmup_ratios": [0.25, 3]}, "compression.warmup_ratios"),
        ("powersgd", {"rank": 0}, "compression.rank must be an integer >= 1"),
        ("qsgd", {"levels": 0}, "compression.levels"),
        ("sidco", {"distribution": "cauchy"}, "compression.distribution"),
        ("redsync", {"method": "magic"}, "compression.method"),
        ("topk", {"min_numel": -1}, "compression.min_numel"),
        ("topk", {"memory": "yes"}, "compression.memory"),
        ("topk", {"rank": 2}, "compression.rank is not a parameter"),
        ("adaptive", {"min_ratio": 0.5, "max_ratio": 0.1}, "compression.min_ratio"),
    ],
)
def test_bad_params_fail_fast(name, params, key):
    with pytest.raises(ValueError) as err:
        build_compressor(name, **params)
    assert key in str(err.value)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        build_compressor("zip")
    msg = str(err.value)
    assert "compression.name" in msg and "'powersgd'" in msg and "'dgc'" in msg


def test_every_config_builds_and_every_name_has_a_config():
    names = {p.stem for p in CONF.glob("*.yaml")}
    assert set(compressor_names()) <= names
    for path in sorted(CONF.glob("*.yaml")):
        cfg = OmegaConf.load(path)
        if cfg.get("name") in PLUGINS:
            continue  # a plug-in with its own config rules (optimus_cc)
        assert "min_numel" in cfg and "memory" in cfg, path.name
        comp = build_compressor(**cfg)
        assert comp.name == cfg.name == path.stem


def test_sidco_stage_search_then_target_correction():
    from easgd_lightning.hooks.compressors.sidco import adapt

    state = {"stages": 1}
    adapt(state, 10.0, 0.2, 10)  # off target: try one more stage
    assert state["stages"] == 2 and state["moved"] == 1
    adapt(state, 3.0, 0.2, 10)  # better: keep going
    assert state["stages"] == 3
    adapt(state, 5.0, 0.2, 10)  # worse: undo, end the search, no correction yet
    assert state["stages"] == 2 and state["searching"] is False and "scale" not in state
    adapt(state, 1.1, 0.2, 10)  # within tolerance: nothing
    assert "scale" not in state
    adapt(state, 2.0, 0.2, 10)  # over target: ln c -= 0.3 (r - 1)
    assert state["stages"] == 2 and math.isclose(state["scale"], math.exp(-0.3))
    adapt(state, 0.0, 0.2, 10)  # nothing passed: the step is clamped at r - 1 = -1
    assert math.isclose(state["scale"], 1.0)
    # a bound ends the search at once
    state = {"stages": 1}
    adapt(state, 0.5, 0.2, 1)
    assert state["stages"] == 1 and not state["searching"] and math.isclose(state["scale"], math.exp(0.15))


def reference_multistage(u: np.ndarray, delta: float, stages: int, dist: str, first: float = 0.25) -> float:
    """The paper's multi-stage threshold written out with scipy's laws: stage 1 fits
    ``dist`` on all of u (zeros included); each later stage shifts the survivors by their
    minimum and fits the exponential (for ``exponential``) or a generalized Pareto by moments."""

    def fit(x, d, law):
        if law == "exponential":
            return scipy.stats.expon(scale=x.mean()).isf(d)
        if law == "gamma":
            un = x / np.linalg.norm(x)
            s_ = math.log(un.mean()) - np.log(un + 2.0**-52).mean()
            a = (3 - s_ + math.sqrt((s_ - 3) ** 2 + 24 * s_)) / (12 * s_)
            return scipy.stats.gamma(a, scale=x.mean() / a).isf(d)
        m, v = x.mean(), x.var()
        return scipy.stats.genpareto(c=-(m * m / v - 1) / 2, scale=m * (m * m / v + 1) / 2).isf(d)

    if stages == 1:
        return fit(u, delta, dist)
    per = (delta / first) ** (1 / (stages - 1))
    thr = fit(u, first, dist)
    for _ in range(stages - 1):
        surv = u[u > thr]
        low = surv.min()
        thr = low + fit(surv - low, per, "exponential" if dist == "exponential" else "gpareto")
    return thr


@pytest.mark.parametrize("dist", ["exponential", "gamma", "gpareto"])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_sidco_multistage_is_the_papers_fit(dist, stages):
    """Later stages refit the shifted survivors (GP; exponential stays exponential), and
    exact zeros stay in the fit (a ReLU layer's gradient has many)."""
    rng = np.random.default_rng(4)
    u = np.abs(rng.standard_t(4, size=30_000))
    u[rng.random(30_000) < 0.3] = 0.0
    got = multistage_threshold(torch.from_numpy(u), 0.001, stages, dist)
    assert math.isclose(got, reference_multistage(u, 0.001, stages, dist), rel_tol=1e-7)
    if dist == "exponential" and stages == 1:  # the mean of all entries, zeros included
        assert math.isclose(got, -u.mean() * math.log(0.001), rel_tol=1e-12)


def _digits_mlp_densities(dist: str, ratio: float, steps: int) -> dict[str, list[float]]:
    """Train the digits MLP (SGD, batch 32) with SIDCo and residual error feedback on its
    two weight matrices; achieved / target count per step and tensor."""
    from easgd_lightning.data.digits import load_digits_tensors
    from easgd_lightning.models.factory import mlp

    torch.manual_seed(0)
    xs, ys, _, _ = load_digits_tensors()
    model = mlp(64, 128, 10)
    comp = build_compressor("sidco", ratio=ratio, distribution=dist)
    mem = ResidualMemory()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    states: dict = {}
    out: dict[str, list[float]] = {}
    g = gen(90)
    for _ in range(steps):
        batch = torch.randint(0, xs.shape[0], (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs[batch]), ys[batch]).backward()
        for name, p in model.named_parameters():
            if p.dim() < 2:
                continue
            comp_in = mem.compensate(name, p.grad)
            y = comp.decompress(comp.compress(comp_in, states.setdefault(name, {})), p.shape)
            mem.update(name, comp_in, y)
            out.setdefault(name, []).append(int((y != 0).sum()) / math.ceil(ratio * p.numel()))
            p.grad.copy_(y)
        opt.step()
    return out


@pytest.mark.parametrize("dist", ["exponential", "gamma", "gpareto"])
def test_sidco_adaptation_reaches_the_target_on_digits_mlp_gradients(dist):
    """On a real model's error-compensated gradients (many exact zeros in the first layer)
    the achieved density after the adaptation period (steps 100-250) is within +-20% of
    the target, in each tensor and over each 50-step stretch."""
    for name, ratios in _digits_mlp_densities(dist, 0.01, 250).items():
        assert 0.8 <= float(np.mean(ratios[100:])) <= 1.2, (name, np.mean(ratios[100:]))
        for lo in range(100, 250, 50):
            assert 0.75 <= float(np.mean(ratios[lo:lo + 50])) <= 1.25, (name, lo, ratios[lo:lo + 50])


def test_sidco_reaches_the_target_on_light_tails():
    g = torch.randn(200_000, generator=gen(60))
    comp = build_compressor("sidco", ratio=0.001)
    state: dict = {}
    counts = []
    for _ in range(40):
        _, y = roundtrip(comp, g, state)
        counts.append(int((y != 0).sum()))
    assert 0.5 * 200 <= counts[-1] <= 1.5 * 200, (counts, state["stages"])


# ----------------------------------------------------------------------------- fast paths
# (issue #11: one-pass native kernels, scratch buffers, the residual hand-off, random-k draw)

from easgd_lightning.hooks.compressors import _native  # noqa: E402
from easgd_lightning.hooks.compressors.randomk import shared_random_indices  # noqa: E402
from easgd_lightning.hooks.memory import ResidualMemory  # noqa: E402

needs_native = pytest.mark.skipif(not _native.available(), reason="no C compiler: eager paths only")


@pytest.mark.skipif(
    not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")) or os.environ.get("EASGD_NATIVE_KERNELS"),
    reason="no C compiler on PATH (or the kernels' source set by EASGD_NATIVE_KERNELS)",
)
def test_the_kernels_compile_where_a_compiler_is_present():
    """With a compiler the native tests run on kernels compiled from this checkout's source:
    a source that does not compile fails here rather than turning those tests into skips
    (they skip only where no kernels load at all)."""
    assert _native.source() == "compiled", _native.source()

FAST = [
    ("topk", {"ratio": 0.01}),
    ("topk", {"ratio": 0.01, "exact": True}),
    ("dgc", {"ratio": 0.01, "warmup_ratio_steps": 0}),
    ("dgc", {"ratio": 0.01, "warmup_ratio_steps": 0, "nesterov": True}),
    ("redsync", {"ratio": 0.002, "method": "bisect"}),
    ("redsync", {"ratio": 0.002, "method": "trimmed"}),
    ("sidco", {"ratio": 0.002, "sample_size": 5000}),
    ("sidco", {"ratio": 0.002, "distribution": "gamma", "stages": 2, "sample_size": 0}),
    ("randomk", {"ratio": 0.01}),
    ("randomk", {"ratio": 0.013, "unbiased": True, "memory": False}),
    ("qsgd", {"levels": 127, "bucket_size": 512, "seed": 3}),
    ("qsgd", {"levels": 300, "bucket_size": 100, "seed": 3}),
    ("qsgd", {"levels": 1, "bucket_size": 512, "seed": 3}),
    ("qsgd", {"levels": 15, "bucket_size": 100, "seed": 3}),
    ("qsgd", {"levels": 1, "bucket_size": 512, "seed": 3, "coding": "elias"}),
    ("signsgd", {}),
]


def _payload_equal(a, b) -> None:
    assert len(a.tensors) == len(b.tensors)
    for x, y in zip(a.tensors, b.tensors):
        assert torch.equal(x, y)


def _grads(dtype, steps=4, n=60_000, integer=False):
    g = gen(70)
    out = []
    for _ in range(steps):
        x = torch.randn(n, generator=g, dtype=torch.float64)
        out.append((x * 8).round().to(dtype) if integer else x.to(dtype))
    return out


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name,params", FAST)
def test_native_kernels_match_the_eager_path(name, params, dtype):
    """Same payloads, decodes and residuals with the kernels and with eager ops (integer
    valued inputs, so sums of squares and |x| are exact in both and QSGD's norms agree)."""
    outs = {}
    for native in (True, False):
        comp = build_compressor(name, **params)
        mem = ResidualMemory() if comp.memory else None
        state: dict = {"key_hash": 7}
        rows = []
        with (_native.disabled() if not native else _null()):
            for g in _grads(dtype, integer=True):
                p = mem.compensate("k", g) if mem else g
                payload = comp.compress(p, state)
                y = comp.decompress(payload, g.shape)
                if mem:
                    mem.update("k", p, y)
                payload = base.Payload(tuple(t.clone() for t in payload.tensors), payload.meta)
                rows.append((payload, y.clone(), None if mem is None else mem.residual("k").clone()))
        outs[native] = rows
    for (pa, ya, ra), (pb, yb, rb) in zip(outs[True], outs[False]):
        if name == "signsgd":  # the kernel sums |p| in another order (both in double)
            assert torch.equal(pa.tensors[1], pb.tensors[1])
            torch.testing.assert_close(pa.tensors[0], pb.tensors[0], rtol=1e-6, atol=0)
            torch.testing.assert_close(ya, yb, rtol=1e-6, atol=0)
            torch.testing.assert_close(ra, rb, rtol=1e-5, atol=1e-5)
            continue
        if name == "dgc" or name == "topk" and params.get("exact"):
            # top-k among ties may order the same set differently: compare decodes
            assert comp.payload_bytes(pa) == comp.payload_bytes(pb)
        else:
            _payload_equal(pa, pb)
        assert torch.equal(ya, yb)
        assert (ra is None and rb is None) or torch.equal(ra, rb)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("name,params", FAST)
def test_scratch_reuse_matches_a_fresh_state(name, params):
    """Buffers reused from state["_scratch"] give what a state without them gives (the
    checkpoint helper drops "_scratch"; nothing that must survive a resume lives there)."""
    comp_a, comp_b = build_compressor(name, **params), build_compressor(name, **params)
    state: dict = {"key_hash": 3}
    for g in _grads(torch.float32):
        fresh = {k: (v.clone() if torch.is_tensor(v) else (list(v) if isinstance(v, list) else v))
                 for k, v in state.items() if k != "_scratch"}
        pa = comp_a.compress(g, state)
        pb = comp_b.compress(g, fresh)
        _payload_equal(pa, pb)
        assert torch.equal(comp_a.decompress(pa, g.shape), comp_b.decompress(pb, g.shape))
        for key, value in fresh.items():
            if torch.is_tensor(value):
                assert torch.equal(state[key], value), key
    assert "_scratch" in state or name in ("randomk",)


@pytest.mark.parametrize(
    "name,params",
    [p for p in FAST if build_compressor(p[0], **p[1]).memory],
)
def test_residual_hand_off_is_the_plain_rule(name, params):
    """e_{t+1} = p_t - decompress(C(p_t)) bit for bit, whether the compressor wrote the
    residual into the compensated buffer or the memory subtracted it."""
    comp = build_compressor(name, **params)
    mem = ResidualMemory()
    state: dict = {"key_hash": 5}
    e = torch.zeros(60_000, dtype=torch.float64)
    for g in _grads(torch.float64):
        p = mem.compensate("w", g)
        assert torch.equal(p, g + e)
        p_before = p.clone()
        _, local = comp.aggregate(p, state, SoloCollective())
        mem.update("w", p, local)
        e = p_before - local
        assert torch.equal(mem.residual("w"), e)


def test_residual_memory_reuses_its_two_buffers():
    mem = ResidualMemory()
    comp = build_compressor("topk", ratio=0.1)
    state: dict = {}
    ptrs = set()
    for i in range(6):
        g = torch.randn(1000, generator=gen(80 + i))
        p = mem.compensate("w", g)
        ptrs.add(p.data_ptr())
        _, local = comp.aggregate(p, state, SoloCollective())
        mem.update("w", p, local)
    assert len(ptrs) == 2  # the first step's clone and one more buffer, swapped


def test_randomk_draw_is_shared_sorted_stratified_and_changes_every_step():
    n, k = 10_007, 100
    rank0, rank1 = build_compressor("randomk", ratio=k / n), build_compressor("randomk", ratio=k / n)
    s0, s1 = {"key_hash": 11}, {"key_hash": 11}
    seen = []
    for step in range(5):
        p0 = rank0.compress(torch.randn(n, generator=gen(step)), s0)
        p1 = rank1.compress(torch.randn(n, generator=gen(100 + step)), s1)
        idx = p0.meta["indices"]
        assert torch.equal(idx, p1.meta["indices"])  # two ranks, same seed: same draw
        assert idx.numel() == k and torch.all(idx[1:] > idx[:-1])  # k distinct, sorted
        strata = torch.arange(k + 1) * n // k
        assert torch.all((idx >= strata[:-1]) & (idx < strata[1:]))  # one per stratum
        assert torch.equal(idx, shared_random_indices(n, k, 0, step, 11))
        seen.append(idx)
    assert all(not torch.equal(a, b) for a, b in zip(seen, seen[1:]))  # new draw each step
    other = build_compressor("randomk", ratio=k / n).compress(torch.randn(n), {"key_hash": 12})
    assert not torch.equal(other.meta["indices"], seen[0])  # another tensor, another draw


def test_randomk_uneven_strata_stay_unbiased():
    """n % k != 0: strata of 3 and 4 entries; each index is drawn with probability
    1 / (its stratum's size) and scaled by that size."""
    x = torch.randn(10, generator=gen(81), dtype=torch.float64)
    comp = build_compressor("randomk", ratio=0.3, unbiased=True, memory=False)  # k = 3
    state: dict = {}
    counts = torch.zeros(10)
    total = torch.zeros_like(x)
    steps = 6000
    for _ in range(steps):
        payload, y = roundtrip(comp, x, state)
        counts[payload.meta["indices"]] += 1
        total += y
    sizes = torch.tensor([3, 3, 3, 3, 3, 3, 4, 4, 4, 4], dtype=torch.float64)
    torch.testing.assert_close(counts / steps, 1 / sizes.float(), atol=0.03, rtol=0)
    assert torch.allclose(total / steps, x, atol=0.15 * float(x.abs().max()))


def test_sidco_sampled_fit_is_the_full_fit_on_a_sample():
    """The norm cancels: the threshold fitted on |g| equals the u-threshold times ||g||; the
    sampled fit selects about as many entries as the whole-tensor fit."""
    rng = np.random.default_rng(3)
    g = torch.from_numpy(rng.laplace(size=400_000))
    u = g.abs() / torch.linalg.vector_norm(g)
    for dist in ("exponential", "gamma", "gpareto"):
        thr_u = multistage_threshold(u.double(), 0.01, 2, dist)
        thr_g = multistage_threshold(g.abs(), 0.01, 2, dist)
        assert math.isclose(thr_g, thr_u * float(torch.linalg.vector_norm(g)), rel_tol=1e-6)
    g = g.float()
    full = build_compressor("sidco", ratio=0.01, sample_size=0, adapt_every=0)
    sampled = build_compressor("sidco", ratio=0.01, sample_size=20_000, adapt_every=0)
    n_full = int(full.compress(g, {}).meta["nnz"])
    n_sampled = int(sampled.compress(g, {}).meta["nnz"])
    assert abs(n_sampled - n_full) <= 0.1 * n_full


def test_redsync_sample_guide_keeps_the_rule():
    x = torch.randn(300_000, generator=gen(82))
    for k in (300, 3000):
        idx, thr = threshold_bisect(x.abs(), k)
        assert k <= idx.numel() <= 2 * k
        assert torch.equal(torch.sort(idx).values, torch.nonzero(x.abs() > thr).squeeze(1))
        idx = trimmed_topk(x.abs(), k)
        mask = np.zeros(x.numel(), dtype=bool)
        mask[idx.numpy()] = True
        np.testing.assert_array_equal(mask, reference_topk_mask(x.numpy(), k))


@pytest.mark.parametrize("name", ["topk", "randomk", "dgc"])
def test_reused_outputs_are_cleared_even_after_a_caller_writes_them(name):
    """aggregate() returns per-tensor buffers; clearing only the last decode's entries is
    safe because a buffer modified in place since (version counter) is zeroed in full."""
    params = {"ratio": 0.01}
    if name == "dgc":
        params["warmup_ratio_steps"] = 0
    comp, ref = build_compressor(name, **params), build_compressor(name, **params)
    state, ref_state = {"key_hash": 2}, {"key_hash": 2}
    for step, g in enumerate(_grads(torch.float32, steps=5, n=30_000)):
        mean, local = comp.aggregate(g.clone(), state, SoloCollective())
        payload = ref.compress(g.clone(), ref_state)
        expected = ref.decompress(payload, g.shape)  # a fresh tensor every time
        assert torch.equal(local, expected) and torch.equal(mean, expected)
        if step == 2:
            local.add_(1.0)  # a caller scribbles on the returned buffers
            mean.mul_(3.0)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_kth_largest_abs_is_topk_minimum(dtype):
    """The threshold kernel returns the value torch.topk's minimum gives: spread-out data,
    ties (integers, -0.0), the largest and the smallest k, inf and NaN."""
    g = gen(11)
    cases = [(torch.randn(131072, generator=g, dtype=torch.float64).to(dtype), (1, 1312, 131072))]
    ties = torch.randint(-3, 4, (10_000,), generator=g).to(dtype)
    ties[5] = -0.0
    cases.append((ties, (1, 100, 4000, 9999, 10_000)))
    odd = torch.randn(1000, generator=g, dtype=torch.float64).to(dtype)
    odd[3], odd[10] = float("inf"), -float("inf")
    cases.append((odd, (1, 2, 3, 500)))
    nan = odd.clone()
    nan[9] = float("nan")
    cases.append((nan, (1, 2, 500)))
    for x, ks in cases:
        for k in ks:
            want = torch.topk(x.abs(), k, sorted=False).values.min()
            got = _native.kth_largest_abs(x, k)
            assert got.dtype == dtype
            assert torch.equal(want, got) or (want.isnan() and got.isnan()), (k, want, got)


@pytest.mark.parametrize("name,key", [
    ("topk", "exact"), ("adaptive", "exact"), ("dgc", "nesterov"), ("sparse_gc", "local_update"),
    ("randomk", "unbiased"), ("powersgd", "warm_start"), ("topk", "memory"),
])
def test_a_switch_that_is_not_a_bool_is_refused_naming_its_key(name, key):
    with pytest.raises(ValueError, match=rf"^compression\.{key} must be true or false, got 1$"):
        build_compressor(name, **{key: 1})
    build_compressor(name, **{key: False})  # a real bool is accepted


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("world", [2, 3, 7])
@pytest.mark.parametrize("native", [True, False])
def test_divide_at_is_bitwise_a_dense_division(dtype, world, native):
    """The sparse mean divides only the entries the ranks touched (repeated indices
    included): bitwise what dividing the whole dense sum gives."""
    from easgd_lightning.hooks.compressors import _native
    from easgd_lightning.hooks.compressors.sparse import divide_at

    g = torch.Generator().manual_seed(world)
    total = torch.zeros(10_000, dtype=dtype)
    idx = torch.cat([torch.randperm(10_000, generator=g)[:300] for _ in range(world)])  # repeats across ranks
    total.index_add_(0, idx, torch.randn(idx.numel(), generator=g, dtype=dtype))
    expected = total / world
    with _native.disabled() if not native else contextlib.nullcontext():
        out = divide_at(total, idx, world)
    assert out.data_ptr() == total.data_ptr() and torch.equal(out, expected)
