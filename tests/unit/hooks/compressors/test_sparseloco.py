"""``sparseloco`` (top-k, 2-bit values, error feedback) against a reference written here."""

from __future__ import annotations

import torch

from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks.memory import make_memory


def reference(p: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest |p|; each kept value becomes sign * (mean |kept| of its half, split
    at the median of the kept magnitudes, ties to the upper half)."""
    order = torch.argsort(p.abs(), descending=True)[:k]
    mags = p.abs()[order]
    med = torch.sort(mags).values[(k - 1) // 2]  # torch.median: the lower middle
    hi = mags >= med
    m_hi, m_lo = mags[hi].mean(), (mags[~hi].mean() if (~hi).any() else mags[hi].mean())
    out = torch.zeros_like(p)
    out[order] = torch.where(hi, m_hi, m_lo) * torch.sign(p[order])
    return out


def test_codes_two_magnitudes_and_sends_about_four_bits_and_a_quarter_per_kept_entry() -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4000, generator=g, dtype=torch.float64)
    c = build_compressor("sparseloco", ratio=0.02, exact=True, min_numel=0)
    payload = c.compress(x, {})
    got = c.decompress(payload, x.shape)
    torch.testing.assert_close(got, reference(x, 80), rtol=0, atol=1e-15)
    assert (got != 0).sum() == 80 and got[got != 0].abs().unique().numel() == 2
    assert c.payload_bytes(payload) == 8 + 2 * 8 + 80 * 4 + 80 * 2 // 8  # count, scales, indices, codes
    assert c.payload_bytes(payload) * 20 < x.numel() * 8  # >20x below dense float64


def test_error_feedback_loses_nothing() -> None:
    """Over many rounds, what was sent plus the residual equals everything offered."""
    g = torch.Generator().manual_seed(11)
    c = build_compressor("sparseloco", ratio=0.05, exact=True, min_numel=0)
    memory, state = make_memory(c), {}
    offered, sent = torch.zeros(600, dtype=torch.float64), torch.zeros(600, dtype=torch.float64)
    for _ in range(30):
        v = torch.randn(600, generator=g, dtype=torch.float64)
        offered += v
        p = memory.compensate("t", v)
        out = c.decompress(c.compress(p, state), p.shape).clone()
        memory.update("t", p, out)
        sent += out
    torch.testing.assert_close(sent + memory.residual("t"), offered, rtol=0, atol=1e-11)
    assert memory.residual("t").abs().max() < offered.abs().max()  # the residual stays bounded


def test_the_elastic_exchange_sends_its_two_bit_values(tmp_path) -> None:
    """Through the attach point (DiLoCo's outer exchange, one rank): every compressed
    tensor arrives as at most two magnitudes, +-m_lo / +-m_hi -- not top-k's raw values
    (SparseLoCo inherits top-k's fused form but overrides its per-tensor rule, so
    ``has_fused_form`` sends it the per-tensor way)."""
    from datetime import timedelta

    import torch.distributed as dist

    from easgd_lightning.hooks.elastic import exchange_sum

    store = dist.FileStore(str(tmp_path / "store"), 1)
    store.set_timeout(timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        shapes = [(40, 50), (30,), (3000,)]
        diff = torch.randn(2000 + 30 + 3000, generator=torch.Generator().manual_seed(4))
        comp = build_compressor("sparseloco", ratio=0.05, min_numel=100)
        total = exchange_sum(diff.clone(), compressor=comp, state={}, shapes=shapes)
    finally:
        dist.destroy_process_group()
    for piece in (total[:2000], total[2030:]):
        mags = piece[piece != 0].abs().unique()
        assert 1 <= mags.numel() <= 2, mags
    assert torch.equal(total[2000:2030], diff[2000:2030])  # under min_numel: dense
