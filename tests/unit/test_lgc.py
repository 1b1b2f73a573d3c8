"""lgc (TNNLS 2021): autoencoder shapes, fit, fallback, and the sum of codes decoding to
the sum of the inputs' reconstructions; two ranks in threads."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks.compressors.lgc import fit_linear_autoencoder, reconstruction_error
from tests.unit.test_acpsgd import ThreadRanks


def test_fit_is_the_best_linear_autoencoder():
    rng = np.random.default_rng(0)
    basis = rng.standard_normal((3, 20))
    x = torch.tensor(rng.standard_normal((40, 3)) @ basis)  # rank 3
    e = fit_linear_autoencoder(x, 3)
    assert e.shape == (20, 3)  # encoder k -> c; decoder = e.T, c -> k
    assert reconstruction_error(x, e) < 1e-10
    # rank-2 code of rank-3 data: the error is the discarded singular value's share
    s = np.linalg.svd(x.numpy(), compute_uv=False)
    e2 = fit_linear_autoencoder(x, 2)
    assert reconstruction_error(x, e2) == pytest.approx(s[2] / np.sqrt((s**2).sum()), rel=1e-9)


def run(comp, grads, steps, world=2):
    ranks = ThreadRanks(world)

    def worker(r):
        st, coll, out = {}, ranks.collective(r), []
        for t in range(steps):
            mean, local = comp.aggregate(grads(r, t), st, coll)
            out.append((st["last_phase"], mean.clone(), local.clone()))
        return out, st

    return ranks.run(worker), ranks


@pytest.mark.parametrize("style", ["ring", "ps"])
def test_codes_after_warmup_and_the_sum_of_codes_decodes_to_the_sum(style):
    """Gradients in a 2-D subspace of the masked entries: after the warm-up the code
    (c = 2 of k = 8) rebuilds the mean exactly; before it, top-k with the leader's mask."""
    n, steps = 800, 10
    base = torch.zeros(2, n, dtype=torch.float64)
    base[0, :8] = torch.arange(8, 0, -1, dtype=torch.float64) * 10
    base[1, :8] = torch.tensor([1.0, -1, 1, -1, 1, -1, 1, -1]) * 3
    rng = np.random.default_rng(1)
    coef = torch.tensor(rng.uniform(0.5, 1.0, (2, steps, 2)))
    comp = build_compressor("lgc", ratio=0.01, code_ratio=0.25, warmup_steps=4, style=style)

    def grads(r, t):
        return coef[r, t] @ base

    (res, ranks) = run(comp, grads, steps)
    out0, st0 = res[0]
    assert [p for p, _, _ in out0] == [1] * 4 + [2] * 6
    assert st0["encoder"].shape == (8, 2) and st0["last_fit_error"] < 1e-10
    for t in range(steps):
        ref = (grads(0, t) + grads(1, t)) / 2
        torch.testing.assert_close(out0[t][1], ref, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(res[1][0][t][1], out0[t][1], rtol=0, atol=0)
    # phase 2 bytes: the leader's 8 indices (int32, received by all) and 2 code values
    assert ranks.sent_bytes[0] > 0


def test_falls_back_to_topk_with_a_logged_reason(caplog):
    comp = build_compressor("lgc", ratio=0.05, code_ratio=0.1, warmup_steps=3, max_error=0.05)
    gens = [torch.Generator().manual_seed(r) for r in range(2)]
    noise = {(r, t): torch.randn(200, dtype=torch.float64, generator=gens[r]) for r in range(2) for t in range(7)}
    with caplog.at_level(logging.WARNING):
        (res, _) = run(comp, lambda r, t: noise[(r, t)], 7)
    out0, st0 = res[0]
    assert [p for p, _, _ in out0] == [1] * 7  # random data: never good enough
    assert st0["last_fit_error"] > 0.05 and "encoder" not in st0
    assert "compression.max_error" in caplog.text
    # the fallback is top-k with the shared mask: the mean of both ranks at the leader's top 10
    idx = torch.topk(noise[(0, 0)].abs(), 10).indices
    ref = torch.zeros(200, dtype=torch.float64)
    ref[idx] = (noise[(0, 0)][idx] + noise[(1, 0)][idx]) / 2
    torch.testing.assert_close(out0[0][1], ref)


def test_bad_params():
    with pytest.raises(ValueError, match=r"compression\.style"):
        build_compressor("lgc", style="mesh")
    with pytest.raises(ValueError, match=r"compression\.code_ratio"):
        build_compressor("lgc", code_ratio=0)
