"""The parameter server's push messages: a codec with a fused form (top-k, EF-signSGD, QSGD)
(and GComp) encodes the whole parameter part in one codec call, and the message decodes, on the other
side, to what the per-tensor messages decode to -- the same numbers, fewer codec calls."""

from __future__ import annotations

import pytest
import torch

from easgd_lightning.hooks.compressors import build_compressor
from easgd_lightning.strategies.ps.compressed import MessageCodec

SIZES = [300, 20, 1200, 7, 640]  # compressed and dense (< min_numel) interleaved
CASES = {
    "topk": {"ratio": 0.05, "min_numel": 100},
    "signsgd": {"min_numel": 100},
    "qsgd": {"levels": 7, "bucket_size": 64, "seed": 4, "min_numel": 100},
    "gcomp": {"mantissa_bits": 7, "min_numel": 100},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_push_decodes_to_the_per_tensor_push(name, monkeypatch):
    fused_codec = MessageCodec(build_compressor(name, **CASES[name]), SIZES)
    plain = build_compressor(name, **CASES[name])
    monkeypatch.setattr(type(plain), "fused_segments", False)  # the per-tensor messages
    plain_codec = MessageCodec(plain, SIZES)
    assert fused_codec.fused and not plain_codec.fused
    calls = []
    inner = fused_codec.compressor
    monkeypatch.setattr(inner, "compress", lambda *a: calls.append(a) or pytest.fail("per-tensor call"))
    buffers = 5
    fused_states, plain_states = fused_codec.new_states(), plain_codec.new_states()
    for step in range(3):  # codec state carried (QSGD's noise count)
        vec = torch.randn(sum(SIZES) + buffers, generator=torch.Generator().manual_seed(step))
        msg_f, sent_f = fused_codec.encode(vec.clone(), fused_states)
        msg_p, sent_p = plain_codec.encode(vec.clone(), plain_states)
        got_f = fused_codec.decode(msg_f, vec.dtype, vec.numel())
        got_p = plain_codec.decode(msg_p, vec.dtype, vec.numel())
        assert torch.equal(sent_f, sent_p) and torch.equal(got_f, got_p)
        assert torch.equal(got_f[: sum(SIZES)], sent_f) and torch.equal(got_f[-buffers:], vec[-buffers:])
        assert msg_f.numel() <= msg_p.numel()  # one header entry per payload tensor, not per tensor
    assert calls == []
    dense = torch.zeros(sum(SIZES), dtype=torch.bool)
    dense[300:320], dense[1520:1527] = True, True
    assert torch.equal(sent_f[dense], vec[: sum(SIZES)][dense])  # under min_numel: as is
