"""lgc (TNNLS 2021): the non-linear block autoencoder's shapes, the learned phase, the sum
of the codes decoding to the sum of the inputs (checked against an independent float64
evaluation of the shared coder), the fallback and its logged reason; two ranks in threads."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks.compressors.lgc import BlockAutoencoder
from easgd_lightning.utils.checkpoint import to_plain
from tests.unit.hooks.compressors.test_acpsgd import ThreadRanks


def test_block_autoencoder_shapes():
    ae = BlockAutoencoder(300, 0.25, hidden=16, block=128, seed=0)
    assert (ae.b, ae.blocks, ae.cb, ae.code_size) == (128, 3, 32, 96)
    z = ae.encode(torch.randn(5, 300))
    assert z.shape == (5, 96) and ae.decode(z).shape == (5, 300)
    assert ae.encode(torch.randn(2, 4, 300)).shape == (2, 4, 96)
    small = BlockAutoencoder(8, 0.25, hidden=4, block=128, seed=0)
    assert (small.b, small.blocks, small.code_size) == (8, 1, 2)
    # the seed fixes the initial weights (every rank starts from the same coder)
    again = BlockAutoencoder(300, 0.25, hidden=16, block=128, seed=0)
    for a, b in zip(ae.parameters(), again.parameters()):
        assert torch.equal(a, b)


def run(comp, grads, steps, world=2):
    ranks = ThreadRanks(world)

    def worker(r):
        st, coll, out = {}, ranks.collective(r), []
        for t in range(steps):
            mean, local = comp.aggregate(grads(r, t), st, coll)
            out.append((st["last_phase"], mean.clone(), local.clone()))
        return out, st

    return ranks.run(worker), ranks


def mlp(x, seq):
    """Linear, LeakyReLU(0.1), Linear in float64 numpy from a torch Sequential's weights."""
    w1, b1 = seq[0].weight.detach().double().numpy(), seq[0].bias.detach().double().numpy()
    w2, b2 = seq[2].weight.detach().double().numpy(), seq[2].bias.detach().double().numpy()
    h = x @ w1.T + b1
    h = np.where(h > 0, h, 0.1 * h)
    return h @ w2.T + b2


def subspace_grads(steps, n=800):
    """Gradients whose 8 largest entries lie in a 2-D subspace (k = 8 at ratio 0.01)."""
    base = np.zeros((2, n))
    base[0, :8] = np.arange(8, 0, -1) * 10.0
    base[1, :8] = np.array([1.0, -1, 1, -1, 1, -1, 1, -1]) * 3
    coef = np.random.default_rng(1).uniform(0.5, 1.0, (2, steps, 2))
    return lambda r, t: torch.tensor(coef[r, t] @ base)


@pytest.mark.parametrize("style", ["ring", "ps"])
def test_learned_phase_and_the_sum_of_codes_decodes_to_the_sum(style):
    """After the warm-up the coder (c = 2 of k = 8) is used; the mean every rank gets is
    s D(E(x_0 / s) + E(x_1 / s)) / 2 evaluated independently, and it is within the stated
    (held-out) error bound of the true mean."""
    steps, warm = 30, 10
    grads = subspace_grads(steps)
    comp = build_compressor("lgc", ratio=0.01, code_ratio=0.25, coder_warmup_steps=warm, max_error=0.2,
                            style=style, hidden=16, train_iters=400)
    (res, _) = run(comp, grads, steps)
    (out0, st0), (out1, st1) = res
    assert [p for p, _, _ in out0] == [1] * warm + [2] * (steps - warm)
    assert st0["last_fit_error"] <= 0.2
    torch.testing.assert_close(st0["coder_weights"], st1["coder_weights"], rtol=0, atol=0)  # shared
    ae = comp.coder(st0, 8)
    assert ae.code_size == 2
    num = den = 0.0
    for t in range(warm, steps):
        g0, g1 = grads(0, t).numpy(), grads(1, t).numpy()
        leader = (g0, g1)[t % 2]
        mask = np.argsort(-np.abs(leader), kind="stable")[:8]
        s = np.float32(np.linalg.norm(leader[mask].astype(np.float32)) / np.sqrt(8))
        z = sum(mlp(g[mask] / s, ae.enc) for g in (g0, g1))
        ref = np.zeros(800)
        ref[mask] = mlp(z, ae.dec) * s / 2
        np.testing.assert_allclose(out0[t][1].numpy(), ref, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(out1[t][1].numpy(), out0[t][1].numpy())
        # this rank's own decoded contribution (the error-feedback input)
        own = np.zeros(800)
        own[mask] = mlp(mlp(g0[mask] / s, ae.enc), ae.dec) * s
        np.testing.assert_allclose(out0[t][2].numpy(), own, rtol=1e-4, atol=1e-4)
        true = (g0 + g1) / 2
        num += float(np.sum((out0[t][1].numpy() - true) ** 2))
        den += float(np.sum(true**2))
    assert np.sqrt(num / den) <= 0.2
    assert comp.run_stats()["lgc_learned_fraction"] == pytest.approx((steps - warm) / steps)
    to_plain(st0)  # the per-tensor state checkpoints (the module lives in scratch)


def test_falls_back_to_topk_with_a_logged_reason(caplog):
    comp = build_compressor("lgc", ratio=0.05, code_ratio=0.1, coder_warmup_steps=3, max_error=0.05, train_iters=20)
    gens = [torch.Generator().manual_seed(r) for r in range(2)]
    noise = {(r, t): torch.randn(200, dtype=torch.float64, generator=gens[r]) for r in range(2) for t in range(7)}
    with caplog.at_level(logging.WARNING):
        (res, _) = run(comp, lambda r, t: noise[(r, t)], 7)
    out0, st0 = res[0]
    assert [p for p, _, _ in out0] == [1] * 7  # random data: never good enough
    assert st0["last_fit_error"] > 0.05 and st0.get("coder_weights") is None
    assert "compression.max_error" in caplog.text
    # the fallback is top-k with the shared mask: the mean of both ranks at the leader's top 10
    idx = torch.topk(noise[(0, 0)].abs(), 10).indices
    ref = torch.zeros(200, dtype=torch.float64)
    ref[idx] = (noise[(0, 0)][idx] + noise[(1, 0)][idx]) / 2
    torch.testing.assert_close(out0[0][1], ref)
    torch.testing.assert_close(out0[0][2], torch.zeros(200, dtype=torch.float64).index_copy(0, idx, noise[(0, 0)][idx]))


def test_learned_phase_falls_back_when_the_running_error_grows(caplog):
    """Codes trained on subspace gradients; then the gradients turn to noise: the running
    error crosses max_error and the compressor goes back to top-k (logged)."""
    warm, steps = 10, 40
    sub = subspace_grads(steps)
    gens = [torch.Generator().manual_seed(r) for r in range(2)]
    noise = {(r, t): torch.randn(800, dtype=torch.float64, generator=gens[r]) * 30 for r in range(2) for t in range(steps)}
    comp = build_compressor("lgc", ratio=0.01, code_ratio=0.25, coder_warmup_steps=warm, max_error=0.2,
                            hidden=16, train_iters=400)
    with caplog.at_level(logging.WARNING):
        (res, _) = run(comp, lambda r, t: sub(r, t) if t < 15 else noise[(r, t)], steps)
    phases = [p for p, _, _ in res[0][0]]
    assert phases[warm:15] == [2] * 5 and 1 in phases[15:]
    assert "running reconstruction error" in caplog.text


def test_bad_params():
    with pytest.raises(ValueError, match=r"compression\.style"):
        build_compressor("lgc", style="mesh")
    with pytest.raises(ValueError, match=r"compression\.code_ratio"):
        build_compressor("lgc", code_ratio=0)
    with pytest.raises(ValueError, match=r"compression\.hidden"):
        build_compressor("lgc", hidden=0)
