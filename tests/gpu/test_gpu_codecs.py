"""Every codec on CUDA tensors: the output stays on the device, top-k selections equal an
exact ``torch.topk`` on the device, and where the rule is exact arithmetic the result is
bitwise the CPU result (issue 30 item 6)."""

from __future__ import annotations

import pytest
import torch

from easgd_lightning.hooks import build_compressor, compressor_names
from tests.helpers import SoloCollective

#: codecs whose result is exact arithmetic (casts, selections, sign, rounding of bits):
#: bitwise the CPU result; the others (matrix products, least squares, fitted thresholds,
#: learned coders) are compared in relative norm
EXACT = {"none", "fp16", "bf16", "signsgd", "gcomp", "randomk", "qsgd", "sparseloco"}
#: options that make a codec's selection exact (no sampled threshold), or its run short
OPTIONS = {
    "topk": {"exact": True}, "sparseloco": {"exact": True}, "dgc": {"warmup_ratio_steps": 0},
    "lgc": {"coder_warmup_steps": 1000}, "adaptive": {"bandwidth": 1e6, "compute_time": 0.01},
    "qsgd": {"seed": 7},  # the noise stream's seed (null: drawn from the global RNG)
}
#: not a per-tensor codec (pipeline activations) or needs several ranks to mean anything
SKIP = {"optimus_cc", "sgc"}


def _names() -> list[str]:
    return [n for n in compressor_names() if n not in SKIP]


@pytest.mark.parametrize("name", _names())
def test_codec_on_cuda_matches_cpu(name: str) -> None:
    g = torch.Generator().manual_seed(5)
    x_cpu = torch.randn(256, 512, generator=g)
    opts = {"min_numel": 0, **OPTIONS.get(name, {})}
    results = {}
    for device in ("cpu", "cuda"):
        comp = build_compressor(name, **opts)
        state = {"key_hash": 3, "step": 0}
        mean, local = comp.aggregate(x_cpu.to(device), state, SoloCollective())
        assert mean.device.type == device and local.device.type == device, name
        results[device] = mean.cpu()
    cpu, cuda = results["cpu"], results["cuda"]
    if name in EXACT:
        assert torch.equal(cpu, cuda), name
    else:
        err = float((cpu - cuda).norm() / cpu.norm().clamp_min(1e-12))
        assert err < 1e-3, (name, err)


@pytest.mark.parametrize("ratio", [0.001, 0.01, 0.1])
def test_exact_topk_on_cuda_is_torch_topk(ratio: float) -> None:
    x = torch.randn(1 << 20, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    comp = build_compressor("topk", ratio=ratio, exact=True, min_numel=0, memory=False)
    out = comp.decompress(comp.compress(x, {}), x.shape)
    k = int(torch.count_nonzero(out))
    want = torch.zeros_like(x)
    idx = torch.topk(x.abs(), k).indices
    want[idx] = x[idx]
    assert out.device.type == "cuda" and torch.equal(out, want)


def test_a_device_copy_is_the_floor_and_codecs_stay_on_device() -> None:
    """A plain device copy of 25M floats is the floor every codec is measured against
    (bench/compressors.py); here only that the copy and top-k run without host transfers."""
    x = torch.randn(25_000_000, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    comp = build_compressor("topk", ratio=0.01, min_numel=0)
    mean, _ = comp.aggregate(x, {"key_hash": 0}, SoloCollective())
    assert mean.is_cuda and int(torch.count_nonzero(mean)) > 0


def _fused_names() -> list[str]:
    from easgd_lightning.hooks.compressors.base import has_fused_form

    return [n for n in _names() if has_fused_form(build_compressor(n, **OPTIONS.get(n, {})))]


@pytest.mark.parametrize("name", _fused_names())
def test_fused_codec_on_cuda_matches_cpu(name: str) -> None:
    """The fused exchange's codec calls (issue 29 item 2) on a CUDA buffer take the eager
    path of each rule: the output stays on the device, and the exact codecs give bitwise the
    CPU (native kernel) result, the others within rounding."""
    from easgd_lightning.hooks.compressors.segments import Segments

    segs = Segments([0, 3000, 3500, 7100], [3000, 500, 3600, 1900], 9000, [3, 4, 5, 6])
    flat = torch.randn(segs.numel, generator=torch.Generator().manual_seed(6))
    out = {}
    for device in ("cpu", "cuda"):
        comp = build_compressor(name, **{"min_numel": 0, **OPTIONS.get(name, {})})
        state = {"world_size": 2}
        payload = comp.compress_segments(flat.to(device), segs, state)
        mean = torch.zeros(segs.numel, device=device)
        received = [payload.tensors, payload.tensors] if comp.aggregation == "allgather" else [
            t * 2 for t in payload.tensors]
        comp.mean_segments(received, payload.meta, segs, mean, 2)
        local = comp.local_segments(payload, segs, state)
        assert mean.device.type == device and local.device.type == device, name
        out[device] = (mean.cpu(), local.cpu())
    on = torch.zeros(segs.numel, dtype=torch.bool)
    on[segs.index()] = True
    for cpu, cuda in zip(out["cpu"], out["cuda"]):
        if name in EXACT:
            assert torch.equal(cpu[on], cuda[on]), name
        else:
            assert float((cpu[on] - cuda[on]).norm() / cpu[on].norm().clamp_min(1e-12)) < 1e-3, name
