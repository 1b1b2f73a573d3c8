"""The one-pass CPU kernels of ``_kernels.c``: built on first use, loaded with ctypes.

Why native code: on the CPU the eager form of a threshold sparsifier is
``abs -> compare -> nonzero -> gather``, four passes and a bool mask, about 7x the time
of a plain copy of the tensor at 25M floats; ``torch.compile`` fuses the element-wise part
but cannot emit the compaction (``nonzero``) and its per-block reductions were slower
than eager on this CPU (bench/README.md, "Compressors"). The kernels here do each rule's
work in one pass. They cover contiguous float32 / float64 CPU tensors; everything else
(CUDA, half precision, no C compiler) takes the eager path of the same rule, which the
unit tests compare against the kernels.

Where the library comes from, in order (:func:`source` says which):

1. ``compiled``: built for this CPU (``-march=native``: the AVX-512 / AVX2 paths) once per
   source / compiler / CPU into ``$EASGD_KERNEL_CACHE`` (default
   ``~/.cache/easgd_lightning``), renamed into place atomically so concurrent processes
   can race safely -- where a C compiler is present;
2. ``prebuilt``: the portable build the package carries (``_kernels_built*.so``, compiled
   when the package was built: pyproject's ``ext-modules``), so an installed wheel runs the
   kernels without a compiler;
3. neither: every codec takes its eager path (the same numbers, slower), with one warning
   naming the reason.

``EASGD_NATIVE_KERNELS=0`` turns the kernels off (eager everywhere);
``EASGD_NATIVE_KERNELS=prebuilt`` skips step 1.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["available", "use", "disabled", "lib", "source", "fn", "add_into", "scatter_into", "scatter_add_into", "zero_at", "kth_largest_abs"]

_SRC = Path(__file__).with_name("_kernels.c")
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_source: str | None = None
_failed = False
_off = 0  # nesting depth of ``disabled()``

_i64, _f32p, _f64p = ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p
_SIGNATURES = {
    # name: (restype, argtypes); pointers are passed as integers (tensor.data_ptr())
    "count_abs_f32": (ctypes.c_int64, [ctypes.c_void_p, _i64, ctypes.c_float, ctypes.c_int]),
    "count_abs_f64": (ctypes.c_int64, [ctypes.c_void_p, _i64, ctypes.c_double, ctypes.c_int]),
    "select_abs_f32": (ctypes.c_int64, [ctypes.c_void_p, _i64, ctypes.c_float, ctypes.c_int, _i64,
                                        ctypes.c_void_p, ctypes.c_void_p]),
    "select_abs_f64": (ctypes.c_int64, [ctypes.c_void_p, _i64, ctypes.c_double, ctypes.c_int, _i64,
                                        ctypes.c_void_p, ctypes.c_void_p]),
    "abs_sum_max_f32": (None, [ctypes.c_void_p, _i64, ctypes.c_void_p, ctypes.c_void_p]),
    "abs_sum_max_f64": (None, [ctypes.c_void_p, _i64, ctypes.c_void_p, ctypes.c_void_p]),
    "momentum_f32": (None, [ctypes.c_void_p] * 3 + [_i64, ctypes.c_float, ctypes.c_int]),
    "momentum_f64": (None, [ctypes.c_void_p] * 3 + [_i64, ctypes.c_double, ctypes.c_int]),
    "sign_pack_f32": (ctypes.c_double, [ctypes.c_void_p, _i64, ctypes.c_void_p]),
    "sign_pack_f64": (ctypes.c_double, [ctypes.c_void_p, _i64, ctypes.c_void_p]),
    "sign_unpack_f32": (None, [ctypes.c_void_p, _i64, ctypes.c_float, ctypes.c_void_p]),
    "sign_unpack_f64": (None, [ctypes.c_void_p, _i64, ctypes.c_double, ctypes.c_void_p]),
    "sign_residual_f32": (None, [ctypes.c_void_p, _i64, ctypes.c_float]),
    "sign_residual_f64": (None, [ctypes.c_void_p, _i64, ctypes.c_double]),
}
for _t, _c in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
    _SIGNATURES[f"sign_pack_segments_{_t}"] = (None, [ctypes.c_void_p, _i64] + [ctypes.c_void_p] * 5)
    _SIGNATURES[f"sign_residual_segments_{_t}"] = (None, [ctypes.c_void_p, _i64] + [ctypes.c_void_p] * 3)
    _SIGNATURES[f"sign_unpack_add_segments_{_t}"] = (None, [ctypes.c_void_p, _i64] + [ctypes.c_void_p] * 5)
    _SIGNATURES[f"add_out_{_t}"] = (None, [ctypes.c_void_p] * 3 + [_i64])
    _SIGNATURES[f"scatter_i32_{_t}"] = (None, [ctypes.c_void_p] * 3 + [_i64])
    _SIGNATURES[f"scatter_i64_{_t}"] = (None, [ctypes.c_void_p] * 3 + [_i64])
    _SIGNATURES[f"scatter_add_i64_{_t}"] = (None, [ctypes.c_void_p] * 3 + [_i64])
    _SIGNATURES[f"zero_at_{_t}"] = (None, [ctypes.c_void_p] * 2 + [_i64])
    _SIGNATURES[f"kth_largest_abs_{_t}"] = (ctypes.c_int, [ctypes.c_void_p, _i64, _i64, ctypes.c_void_p])
    _SIGNATURES[f"momentum_select_{_t}"] = (
        ctypes.c_int64, [ctypes.c_void_p] * 3 + [_i64, _c, ctypes.c_int, _c, _i64,
                                                 ctypes.c_void_p, ctypes.c_void_p])
    _SIGNATURES[f"momentum_sample_{_t}"] = (
        None, [ctypes.c_void_p] * 3 + [_i64, _i64, _c, ctypes.c_int, ctypes.c_void_p])
    _SIGNATURES[f"topk_segments_{_t}"] = (
        ctypes.c_int64, [ctypes.c_void_p, _i64] + [ctypes.c_void_p] * 6 + [ctypes.c_int, _i64] + [ctypes.c_void_p] * 3)
    _SIGNATURES[f"dgc_segments_{_t}"] = (
        ctypes.c_int64, [ctypes.c_void_p] * 3 + [_i64] + [ctypes.c_void_p] * 5
        + [_c, ctypes.c_int, ctypes.c_int, _i64, ctypes.c_double, ctypes.c_double, _i64] + [ctypes.c_void_p] * 5)
    _SIGNATURES[f"randomk_gather_{_t}"] = (
        None, [ctypes.c_void_p, _i64, _i64, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int,
               ctypes.c_void_p, ctypes.c_void_p])
    _SIGNATURES[f"randomk_segments_{_t}"] = (
        None, [ctypes.c_void_p, _i64] + [ctypes.c_void_p] * 4 + [_i64, _i64, ctypes.c_int,
               ctypes.c_void_p, ctypes.c_void_p])
    for _name in (_t, f"{_t}_i16"):  # int8 levels (s <= 127), int16 levels
        _SIGNATURES[f"qsgd_segments_{_name}"] = (
            None, [ctypes.c_void_p, _i64] + [ctypes.c_void_p] * 3 + [_i64, _c, ctypes.c_uint64,
                   ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p])
        _SIGNATURES[f"qsgd_dequantize_add_segments_{_name}"] = (
            None, [ctypes.c_void_p, _i64] + [ctypes.c_void_p] * 2 + [_i64, ctypes.c_void_p, _c, ctypes.c_void_p])
    for _q in ("i8", "i16"):
        _SIGNATURES[f"qsgd_quantize_{_t}_{_q}"] = (
            None, [ctypes.c_void_p, _i64, _i64, _c, ctypes.c_uint32, ctypes.c_uint32,
                   ctypes.c_void_p, ctypes.c_void_p])
        _SIGNATURES[f"qsgd_dequantize_{_t}_{_q}"] = (
            None, [ctypes.c_void_p, _i64, _i64, ctypes.c_void_p, _c, ctypes.c_void_p])
    _SIGNATURES[f"qsgd_dequantize_packed_{_t}"] = (
        None, [ctypes.c_void_p, _i64, _i64, ctypes.c_void_p, _c, ctypes.c_int, ctypes.c_void_p])
    _SIGNATURES[f"qsgd_elias_decode_{_t}"] = (
        _i64, [ctypes.c_void_p, _i64, _i64, _i64, ctypes.c_void_p, _c, ctypes.c_void_p])
for _q in ("i8", "i16"):
    _SIGNATURES[f"qsgd_pack_{_q}"] = (None, [ctypes.c_void_p, _i64, ctypes.c_int, ctypes.c_void_p])
    _SIGNATURES[f"qsgd_elias_encode_{_q}"] = (_i64, [ctypes.c_void_p, _i64, ctypes.c_void_p, _i64])
for _q in ("i8", "i16"):
    _SIGNATURES[f"qsgd_unpack_{_q}"] = (None, [ctypes.c_void_p, _i64, ctypes.c_int, ctypes.c_void_p])
    _SIGNATURES[f"qsgd_elias_levels_{_q}"] = (_i64, [ctypes.c_void_p, _i64, _i64, _i64, ctypes.c_void_p])

SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(lines[:2])


def _bind(path: Path) -> ctypes.CDLL | None:
    """Load the library at ``path`` and declare every kernel's signature (None: unloadable)."""
    try:
        lib = ctypes.CDLL(str(path))
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
    except (OSError, AttributeError):
        return None
    return lib


def _prebuilt() -> ctypes.CDLL | None:
    """The portable library built with the package, if it is there."""
    for path in sorted(Path(__file__).parent.glob("_kernels_built*.so")):
        lib = _bind(path)
        if lib is not None:
            return lib
    return None


def _load() -> tuple[ctypes.CDLL | None, str | None, str]:
    """(library, where it came from, why there is none)."""
    why = "EASGD_NATIVE_KERNELS=prebuilt"
    if os.environ.get("EASGD_NATIVE_KERNELS") != "prebuilt":
        try:
            lib = _build()
        except (OSError, subprocess.SubprocessError) as exc:
            lib, why = None, f"compiling failed: {exc}"
        else:
            why = "no C compiler (cc, gcc or $CC)" if lib is None else why
        if lib is not None:
            return lib, "compiled", ""
    lib = _prebuilt()
    if lib is not None:
        return lib, "prebuilt", ""
    return None, None, f"{why}, and the package carries no prebuilt kernel library that loads"


def _build() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or not _SRC.is_file():
        return None
    src = _SRC.read_bytes()
    cache = Path(os.environ.get("EASGD_KERNEL_CACHE", Path.home() / ".cache" / "easgd_lightning"))
    errors = []
    for extra in (["-march=native"], []):
        flags = _FLAGS + extra
        tag = hashlib.sha256(src + " ".join([cc, *flags, _cpu_id()]).encode()).hexdigest()[:16]
        path = cache / f"codec_kernels_{tag}.so"
        if not path.exists():
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            proc = subprocess.run(
                [cc, *flags, "-o", tmp, str(_SRC), "-lm"], capture_output=True, text=True, timeout=120
            )
            if proc.returncode != 0:
                os.unlink(tmp)
                errors.append((proc.stderr.strip().splitlines() or ["?"])[0])
                continue
            os.replace(tmp, path)
        lib = _bind(path)
        if lib is not None:
            return lib
    if errors:  # a compiler that rejects the source: say so (not "no compiler")
        raise subprocess.SubprocessError(f"{cc} rejected {_SRC.name}: {errors[-1]}")
    return None


def lib() -> ctypes.CDLL | None:
    """The loaded kernel library, or None (turned off, or neither compiled nor prebuilt:
    warned once with the reason)."""
    global _lib, _source, _failed
    if _off or os.environ.get("EASGD_NATIVE_KERNELS", "1") == "0":
        return None
    if _lib is None and not _failed:
        with _lock:
            if _lib is None and not _failed:
                _lib, _source, why = _load()
                _failed = _lib is None
                if _failed:
                    warnings.warn(f"codec kernels unavailable ({why}); the codecs use their eager "
                                  "path (the same numbers, slower)", stacklevel=2)
    return _lib


def source() -> str | None:
    """Where the kernels in use come from: ``compiled`` (for this CPU), ``prebuilt`` (the
    package's portable build) or None (eager)."""
    return _source if lib() is not None else None


def available() -> bool:
    """Whether the kernels are built and on."""
    return lib() is not None


def use(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library when every tensor is a contiguous CPU tensor of one float dtype it covers."""
    if not tensors:
        return None
    dt = tensors[0].dtype
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != dt or dt not in SUFFIX or not t.is_contiguous():
            return None
    return lib()


@contextlib.contextmanager
def disabled():
    """Within the block every codec takes its eager path (for tests and comparisons)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """``mix32`` of _kernels.c on int64 tensors holding uint32 values (exact emulation)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def hash_uniform24(counter: torch.Tensor, s0: int, s1: int) -> torch.Tensor:
    """The kernels' uniform noise in eager ops: mix32((i + s0) ^ s1) / 2^32 rounded down to
    24 bits, in [0, 1), float64 (exact), for int64 counters ``i`` < 2^32."""
    h = _mix32(((counter + s0) & _M32) ^ s1)
    return (h >> 8).to(torch.float64) / 16777216.0


def fn(lib: ctypes.CDLL, name: str, dtype: torch.dtype):
    """``lib``'s kernel ``name`` for ``dtype`` (``name_f32`` / ``name_f64``)."""
    return getattr(lib, f"{name}_{SUFFIX[dtype]}")


def add_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out <- a + b (same arithmetic as ``torch.add``; streaming stores when native)."""
    lib = use(out, a, b)
    if lib is None or out.shape != a.shape or a.shape != b.shape:
        return torch.add(a, b, out=out)
    fn(lib, "add_out", out.dtype)(a.data_ptr(), b.data_ptr(), out.data_ptr(), out.numel())
    return out


def scatter_into(out: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """out[idx] <- val for 1-D ``out`` and unique int32 / int64 ``idx``."""
    lib = use(out, val)
    if lib is None or idx.dtype not in (torch.int32, torch.int64) or not idx.is_contiguous() or (
        idx.device.type != "cpu"
    ):
        out.index_put_((idx.long(),), val)
        return out
    bits = "i32" if idx.dtype == torch.int32 else "i64"
    fn(lib, f"scatter_{bits}", out.dtype)(out.data_ptr(), idx.data_ptr(), val.data_ptr(), idx.numel())
    return out


def scatter_add_into(out: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """out[idx] += val in order (repeated indices add up), for 1-D ``out`` and int64 ``idx``."""
    lib = use(out, val)
    if lib is None or idx.dtype != torch.int64 or not idx.is_contiguous() or idx.device.type != "cpu":
        return out.index_add_(0, idx, val)
    fn(lib, "scatter_add_i64", out.dtype)(out.data_ptr(), idx.data_ptr(), val.data_ptr(), idx.numel())
    return out


def zero_at(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[idx] <- 0 for 1-D ``x`` and int64 ``idx``."""
    lib = use(x)
    if lib is None or idx.dtype != torch.int64 or not idx.is_contiguous():
        return x.index_fill_(0, idx, 0)
    fn(lib, "zero_at", x.dtype)(x.data_ptr(), idx.data_ptr(), idx.numel())
    return x


def kth_largest_abs(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th largest |x_i| (1 <= k <= numel) as a 0-d tensor of x's dtype: the minimum
    of ``torch.topk(x.abs(), k).values``, the same value (two passes in the kernel instead
    of topk's selection; topk where the kernel does not apply)."""
    flat = x.reshape(-1)
    lib = use(flat)
    if lib is not None:
        out = torch.empty((), dtype=flat.dtype)
        if fn(lib, "kth_largest_abs", flat.dtype)(flat.data_ptr(), flat.numel(), int(k), out.data_ptr()) == 0:
            return out
    return torch.topk(flat.abs(), int(k), sorted=False).values.min()
