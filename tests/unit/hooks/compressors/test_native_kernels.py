"""The vector paths of _kernels.c (AVX-512 or AVX2, whichever this CPU builds) against the
portable build of the same file (no -march: the scalar loops), bit for bit, on lengths that
are not multiples of the vector width, -0.0, NaN and infinities.

The sums of |x| are the one place the paths may differ: the vector code adds in 16 double
lanes (the AVX2 path in the AVX-512 lanes and reduction order), the portable code in its
own order; on integer-valued data both are exact, elsewhere the vector sum must be the
16-lane one emulated here.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from easgd_lightning.hooks.compressors import _native

pytestmark = pytest.mark.skipif(
    not _native.available() or shutil.which("cc") is None, reason="no C compiler: eager paths only"
)

LENGTHS = (0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1003, 65_549)


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels") / "portable.so"
    subprocess.run(["cc", *_native._FLAGS, "-o", str(out), str(_native._SRC), "-lm"], check=True)
    portable = ctypes.CDLL(str(out))
    for name, (res, args) in _native._SIGNATURES.items():
        fn = getattr(portable, name)
        fn.restype, fn.argtypes = res, args
    return _native.lib(), portable


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _buffer(n: int, dtype, offset: int) -> np.ndarray:
    """n entries starting `offset` entries past a 64-byte boundary."""
    size = np.dtype(dtype).itemsize
    raw = np.zeros((n + offset) * size + 64, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset * size
    return raw[start : start + n * size].view(dtype)


def _inputs(dtype):
    rng = np.random.default_rng(17)
    for n in LENGTHS:
        x = rng.standard_normal(n).astype(dtype)
        yield "randn", x
        # magnitudes 2^0 .. 2^60: the rounding of a sum then depends on its order
        yield "spread", (x * 2.0 ** rng.integers(0, 60, n)).astype(dtype)
        yield "integers", np.round(x * 8)
        if n:
            y = x.copy()
            for value, share in ((-0.0, 8), (0.0, 8), (np.nan, 30), (-np.nan, 30), (np.inf, 30), (-np.inf, 30)):
                y[rng.integers(0, n, max(1, n // share))] = value
            yield "special", y


def _lane_sum(a: np.ndarray, pairwise: bool) -> float:
    """sum of a (float64) in 16 lanes; the lanes added as the f32 kernels' reduction
    (pairwise halves) or in order (sign_pack_f64); then the tail in order."""
    m = a.size - a.size % 16
    lanes = np.cumsum(a[:m].reshape(-1, 16), axis=0)[-1] if m else np.zeros(16)
    if pairwise:
        h = lanes[:8] + lanes[8:]
        h = h[4:] + h[:4]
        h = h[2:] + h[:2]
        s = h[0] + h[1]
    else:
        s = 0.0
        for v in lanes:
            s += v
    t = 0.0
    for v in a[m:]:
        t += v
    return s + t


def _same(a, b) -> bool:
    return np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_select_abs_matches_the_scalar_loop(libs, dtype):
    native, portable = libs
    sfx = "f32" if dtype == np.float32 else "f64"
    for _, x in _inputs(dtype):
        n = x.size
        for thr in (0.0, 0.5, 2.0, np.inf, np.nan):
            for ge in (0, 1):
                for cap in (n, n // 3, 0):
                    got = []
                    for lib in (native, portable):
                        idx = np.full(n + 1, -7, np.int64)
                        val = np.full(n + 1, 99, dtype)
                        c = getattr(lib, f"select_abs_{sfx}")(_ptr(x), n, thr, ge, cap, _ptr(idx), _ptr(val))
                        got.append((c, idx, val))
                    (ca, ia, va), (cb, ib, vb) = got
                    # the contract: the count, the first min(count, cap) entries, and nothing
                    # written at or past cap (the AVX-512 path stores whole vectors, so the
                    # entries between the count and cap are scratch)
                    k = min(ca, cap)
                    assert ca == cb and np.array_equal(ia[:k], ib[:k]) and va[:k].tobytes() == vb[:k].tobytes(), (n, thr, ge, cap)
                    for i, v in ((ia, va), (ib, vb)):
                        assert (i[cap:] == -7).all() and (v[cap:] == 99).all(), (n, thr, ge, cap)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sign_pack_and_unpack_match_the_scalar_loop(libs, dtype):
    native, portable = libs
    sfx = "f32" if dtype == np.float32 else "f64"
    for kind, x in _inputs(dtype):
        n = x.size
        packed, sums = [], []
        for lib in (native, portable):
            p = np.full((n + 7) // 8 + 1, 0xAB, np.uint8)
            sums.append(getattr(lib, f"sign_pack_{sfx}")(_ptr(x), n, _ptr(p)))
            packed.append(p)
        assert np.array_equal(packed[0], packed[1]), (kind, n)
        lane = _lane_sum(np.abs(x.astype(np.float64)), pairwise=dtype == np.float32)
        assert _same(sums[0], lane) or _same(sums[0], sums[1]), (kind, n)
        if kind in ("integers", "special"):
            assert _same(sums[0], sums[1]), (kind, n)
        for offset in (0, 1, 8):
            outs = []
            for lib in (native, portable):
                out = _buffer(n, dtype, offset)
                getattr(lib, f"sign_unpack_{sfx}")(_ptr(packed[0]), n, 0.75, _ptr(out))
                outs.append(out)
            assert outs[0].tobytes() == outs[1].tobytes(), (kind, n, offset)


def _lane_max(a: np.ndarray) -> np.float32:
    """max |x| as the vector paths take it: 16 lanes of maxps (the second operand when
    unordered, so a NaN can survive), reduced as GCC's _mm512_reduce_max_ps, then the tail."""
    def mx(p, q):
        return np.where(p > q, p, q)

    m = a.size - a.size % 16
    lanes = np.zeros(16, np.float32)
    for i in range(0, m, 16):
        lanes = mx(lanes, a[i : i + 16])
    h = mx(lanes[8:], lanes[:8])
    h = mx(h[4:], h[:4])
    h = mx(h, h[[2, 3, 0, 1]])
    h = mx(h, h[[1, 0, 1, 0]])
    tail = np.float32(0)
    for v in a[m:]:
        tail = v if v > tail else tail
    return tail if tail > h[0] else h[0]


def test_abs_sum_max_matches_the_scalar_loop(libs):
    native, portable = libs
    for kind, x in _inputs(np.float32):
        got = []
        for lib in (native, portable):
            s, m = ctypes.c_double(), ctypes.c_float()
            lib.abs_sum_max_f32(_ptr(x), x.size, ctypes.addressof(s), ctypes.addressof(m))
            got.append((s.value, np.float32(m.value)))
        (sa, ma), (sb, mb) = got
        lane = _lane_sum(np.abs(x.astype(np.float64)), pairwise=True)
        assert _same(sa, lane) or _same(sa, sb), (kind, x.size)
        if kind == "special":  # the scalar loop skips NaN; the vector lanes may keep one
            assert _same(ma, _lane_max(np.abs(x))) or _same(ma, mb), x.size
        else:
            assert _same(sa, sb) or kind in ("randn", "spread"), (kind, x.size)
            assert ma == mb, (kind, x.size)


def test_qsgd_float32_int8_matches_the_scalar_loop(libs):
    native, portable = libs
    for kind, x in _inputs(np.float32):
        n = x.size
        for b in (512, 100, 16, 8, 3):
            for levels in (127.0, 15.0, 1.0):
                nb = max(1, (n + b - 1) // b)
                got = []
                for lib in (native, portable):
                    norms, q = np.zeros(nb, np.float32), np.zeros(max(n, 1), np.int8)
                    lib.qsgd_quantize_f32_i8(_ptr(x), n, b, levels, 12345, 0xDEADBEEF, _ptr(norms), _ptr(q))
                    outs = []
                    for offset in (0, 1, 8):
                        out = _buffer(n, np.float32, offset)
                        lib.qsgd_dequantize_f32_i8(_ptr(q), n, b, _ptr(norms), levels, _ptr(out))
                        outs.append(out)
                    got.append((norms, q, outs))
                (na, qa, oa), (nb_, qb, ob) = got
                where = (kind, n, b, levels)
                # a NaN norm's sign bit follows the compiler's vectorization of the sum
                assert _same(na, nb_) and np.array_equal(qa, qb), where
                assert all(_same(u, v) for u, v in zip(oa, ob)), where
