"""gcomp (GComp, SoCC 2024): lossless round trip, rounding against torch's bfloat16 cast,
Huffman code lengths against a reference, real coded size."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
import torch

from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks.compressors.gcomp import canonical_codes, huffman_lengths
from tests.helpers import SoloCollective


def roundtrip(comp, x):
    payload = comp.compress(x, {})
    return payload, comp.decompress(payload, x.shape)


def special_float32(n: int, seed: int) -> torch.Tensor:
    """Random bit patterns (every exponent, NaNs and infinities included) plus zeros of
    both signs, subnormals and negatives."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).clone()
    x[:50] = 0.0
    x[50:60] = -0.0
    x[60:70] = torch.tensor([1e-45, -1e-45, 1e-40, -2.5e-39, 1.1754942e-38, -1.17549435e-38,
                             3.4028235e38, -3.4028235e38, float("inf"), float("-inf")])
    x[70:2000] = torch.randn(1930, generator=g) * 1e-3
    return x


def test_mantissa_bits_23_round_trips_bit_exactly():
    comp = build_compressor("gcomp", mantissa_bits=23)
    x = special_float32(6000, 0)
    payload, y = roundtrip(comp, x.view(60, 100))
    assert torch.equal(y.reshape(-1).view(torch.int32), x.view(torch.int32))
    assert comp.payload_bytes(payload) == payload.tensors[0].numel()


def test_float64_lossless_at_52_bits():
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-(2**62), 2**62, (3000,), generator=g, dtype=torch.int64)
    bits[:100] = 0
    x = bits.view(torch.float64)
    _, y = roundtrip(build_compressor("gcomp", mantissa_bits=52), x)
    assert torch.equal(y.view(torch.int64), bits)


def test_seven_mantissa_bits_round_like_bfloat16():
    """Round to nearest, ties to even, at 7 bits is torch's float32 -> bfloat16 cast."""
    x = torch.randn(20000, generator=torch.Generator().manual_seed(2)) * 3.0
    x[::5] = 0.0
    _, y = roundtrip(build_compressor("gcomp"), x)
    assert torch.equal(y, x.to(torch.bfloat16).float())
    _, y3 = roundtrip(build_compressor("gcomp", mantissa_bits=3), x)
    nz = x != 0
    assert float(((y3 - x)[nz] / x[nz]).abs().max()) <= 2.0**-4 + 1e-7  # half a unit at 3 bits


def reference_huffman_cost(counts: list[int]) -> int:
    """Total bits of an optimal prefix code: sum of the merged weights (textbook Huffman)."""
    heap = list(counts)
    heapq.heapify(heap)
    cost = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        cost += a + b
        heapq.heappush(heap, a + b)
    return cost


def test_huffman_lengths_are_optimal_and_prefix_free():
    rng = np.random.default_rng(3)
    counts = {int(s): int(c) for s, c in zip(rng.choice(257, 40, replace=False), rng.integers(1, 5000, 40))}
    lengths = huffman_lengths(counts)
    assert sum(counts[s] * ln for s, ln in lengths.items()) == reference_huffman_cost(list(counts.values()))
    assert sum(2.0 ** -ln for ln in lengths.values()) == 1.0  # complete code (Kraft equality)
    codes = canonical_codes(lengths)
    words = [format(codes[s], f"0{ln}b")[::-1] for s, ln in lengths.items()]
    assert not any(a != b and b.startswith(a) for a in words for b in words)
    # a skewed histogram is limited to 16 bits
    skewed = {i: 2**i for i in range(30)}
    assert max(huffman_lengths(skewed).values()) == 16


def test_payload_is_the_coded_size_and_zeros_are_pruned():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(50000, generator=g) * 1e-2
    dense = build_compressor("gcomp").compress(x, {})
    x[: 40000] = 0.0
    sparse = build_compressor("gcomp").compress(x, {})
    comp = build_compressor("gcomp")
    # 7 mantissa bits + sign + a few bits of exponent code < 16 bits per entry
    assert comp.payload_bytes(dense) < 0.5 * 4 * x.numel()
    # 80% zeros: those cost about one code bit each
    assert comp.payload_bytes(sparse) < 0.35 * comp.payload_bytes(dense)


def test_aggregate_sums_every_ranks_decoded_payload():
    x = torch.randn(3000, generator=torch.Generator().manual_seed(5))
    mean, local = build_compressor("gcomp", mantissa_bits=23).aggregate(x, {}, SoloCollective())
    assert torch.equal(mean, x) and torch.equal(local, x)


def test_bad_mantissa_bits():
    with pytest.raises(ValueError, match=r"compression\.mantissa_bits"):
        build_compressor("gcomp", mantissa_bits=60)
    with pytest.raises(ValueError, match=r"compression\.mantissa_bits"):
        build_compressor("gcomp", mantissa_bits=-1)


@pytest.mark.parametrize("numel", [1, 10, 64, 65, 1280, 9610])
def test_round_trip_at_every_block_count(numel):
    """One block (n <= 64: the block offsets are a one-entry slice), several, and a partial
    last block all decode; lossless at 23 bits, bfloat16 rounding at 7."""
    from easgd_lightning.hooks.compressors.gcomp import block_size, gcomp_decode, gcomp_encode

    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    x[::3] = 0.0
    assert 64 <= block_size(numel) <= 4096
    y = gcomp_decode(gcomp_encode(x, 23), numel, torch.float32, 23)
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))
    y7 = gcomp_decode(gcomp_encode(x, 7), numel, torch.float32, 7)
    assert torch.equal(y7, x.to(torch.bfloat16).float())


@pytest.mark.parametrize("dtype,bits", [(torch.float32, b) for b in (0, 1, 7, 23)] + [(torch.float64, b) for b in (0, 7, 52)])
def test_a_nan_stays_a_nan(dtype, bits) -> None:
    """A NaN whose payload lies below the kept mantissa bits decoded as +-inf before; it
    has its own symbol now (decoded as the quiet NaN) and infinities stay infinities."""
    from easgd_lightning.hooks.compressors.gcomp import gcomp_decode, gcomp_encode

    low_payload = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32).to(dtype)  # payload bit 0
    x = torch.cat([low_payload, torch.tensor([1.0, -float("nan"), float("inf"), -float("inf"), 3.0], dtype=dtype)])
    y = gcomp_decode(gcomp_encode(x, bits), x.numel(), dtype, bits)
    assert torch.isnan(y[[0, 2]]).all()
    assert y[3] == float("inf") and y[4] == -float("inf") and y[1] == 1.0
