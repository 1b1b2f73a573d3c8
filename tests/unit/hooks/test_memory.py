"""Error feedback: sum of transmitted + final residual == sum of inputs (nothing is lost)."""

from __future__ import annotations

import pytest
import torch

from easgd_lightning.hooks import NoMemory, ResidualMemory, build_compressor, make_memory
from easgd_lightning.hooks._exchange import exchange_tensors, key_hash, start_exchange_tensors
from tests.helpers import MeteredSoloCollective, SoloCollective


@pytest.mark.parametrize(
    "name,params",
    [
        ("topk", {"ratio": 0.05}),
        ("randomk", {"ratio": 0.1}),
        ("redsync", {"ratio": 0.02}),
        ("sidco", {"ratio": 0.02}),
        ("signsgd", {}),
        ("powersgd", {"rank": 1}),
        ("sketch", {"ratio": 0.05}),
        ("qsgd", {"levels": 3, "memory": True}),
        ("fp16", {"memory": True}),
    ],
)
def test_transmitted_plus_residual_equals_inputs(name, params):
    comp = build_compressor(name, **params)
    mem = make_memory(comp)
    assert isinstance(mem, ResidualMemory)
    gen = torch.Generator().manual_seed(0)
    state: dict = {}
    sum_in = torch.zeros(40, 30, dtype=torch.float64)
    sum_sent = torch.zeros_like(sum_in)
    for _ in range(25):
        g = torch.randn(40, 30, generator=gen, dtype=torch.float64)
        sum_in += g
        p = mem.compensate("w", g)
        _, sent = comp.aggregate(p, state, SoloCollective())
        mem.update("w", p, sent)
        sum_sent += sent
    torch.testing.assert_close(sum_sent + mem.residual("w"), sum_in, rtol=1e-10, atol=1e-10)


def test_residual_memory_state_dict_roundtrip_and_keys():
    mem = ResidualMemory()
    a = torch.ones(3)
    mem.update("a", mem.compensate("a", a), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(mem.compensate("a", a), torch.tensor([1.0, 2.0, 2.0]))
    torch.testing.assert_close(mem.compensate("b", a), a)  # other keys untouched
    other = ResidualMemory()
    other.load_state_dict(mem.state_dict())
    torch.testing.assert_close(other.residual("a"), torch.tensor([0.0, 1.0, 1.0]))
    other.reset()
    assert other.residual("a") is None


def test_no_memory_and_defaults():
    x = torch.randn(5)
    nm = NoMemory()
    assert torch.equal(nm.compensate("k", x), x)
    nm.update("k", x, torch.zeros(5))
    assert torch.equal(nm.compensate("k", x), x)
    assert isinstance(make_memory(build_compressor("qsgd")), NoMemory)
    assert isinstance(make_memory(build_compressor("dgc")), NoMemory)
    assert isinstance(make_memory(build_compressor("powersgd")), ResidualMemory)
    assert isinstance(make_memory(None), NoMemory)
    with pytest.raises(ValueError, match="memory_decay"):
        ResidualMemory(decay=2.0)


def test_adopt_takes_a_residual_kept_elsewhere_without_copying():
    mem = ResidualMemory()
    owed = torch.tensor([0.5, -1.0, 0.0])
    mem.adopt("w", owed)
    assert mem.residual("w") is owed
    p = mem.compensate("w", torch.ones(3))
    assert p.tolist() == [1.5, 0.0, 1.0] and owed.tolist() == [0.5, -1.0, 0.0]
    mem.update("w", p, torch.tensor([1.5, 0.0, 0.0]))
    assert mem.residual("w").tolist() == [0.0, 0.0, 1.0]
    mem.adopt("w", mem.residual("w"))  # the one it holds: nothing changes
    assert mem.residual("w").tolist() == [0.0, 0.0, 1.0]


def _powersgd_reference(grads: list[torch.Tensor], rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """PowerSGD on one rank, written from the rule (float64): M = g + e; P = orth(M Q);
    Q <- M^T P; sent = P Q^T; e <- M - sent. Q starts as the codec's seeded draw."""
    codec = build_compressor("powersgd", rank=rank)
    n, m = grads[0].shape
    q = codec._initial_q(m, rank, {"key_hash": key_hash("w")}, grads[0])
    e = torch.zeros_like(grads[0])
    sent = []
    for g in grads:
        mat = g + e
        p, _ = torch.linalg.qr(mat @ q, mode="reduced")
        q = mat.T @ p
        sent.append(p @ q.T)
        e = mat - sent[-1]
    return sent, e


@pytest.mark.parametrize("want_locals", [False, True])
def test_powersgd_in_place_residual_matches_the_rule(want_locals):
    """Through the exchange (as the DDP hook and the elastic exchange run it): without a
    request for this rank's part, the residual M - P Q^T is written into the compensated
    buffer in place; means and residuals equal the rule's (float64), both ways."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(48, 40, generator=gen, dtype=torch.float64) for _ in range(5)]
    ref_sent, ref_e = _powersgd_reference(grads, rank=2)
    comp = build_compressor("powersgd", rank=2, min_numel=0)
    mem, states = ResidualMemory(), {}
    for g, expected in zip(grads, ref_sent):
        locals_out: list | None = [] if want_locals else None
        (mean,), _ = exchange_tensors([g.clone()], ["w"], comp, mem, states, MeteredSoloCollective("data_parallel"), locals_out=locals_out)
        torch.testing.assert_close(mean, expected, atol=1e-12, rtol=1e-10)
        if want_locals:
            torch.testing.assert_close(locals_out[0], expected, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(mem.residual("w"), ref_e, atol=1e-12, rtol=1e-10)
    assert (states["w"]["_scratch"]["want_local"]) is want_locals


@pytest.mark.parametrize("name", ["powersgd", "acpsgd"])
def test_low_rank_in_place_residual_conserves_mass(name):
    """sum of means + final residual == sum of inputs when the codec writes the residual
    in place (world of one: the mean is what was sent); the in-place path is the one taken
    (no local part is formed)."""
    gen = torch.Generator().manual_seed(4)
    comp = build_compressor(name, rank=1, min_numel=0)
    mem, states = ResidualMemory(), {}
    sum_in = torch.zeros(30, 20, dtype=torch.float64)
    sum_sent = torch.zeros_like(sum_in)
    for _ in range(8):
        g = torch.randn(30, 20, generator=gen, dtype=torch.float64)
        sum_in += g
        pending = start_exchange_tensors([g], ["w"], comp, mem, states, MeteredSoloCollective("data_parallel"))
        (mean,), (local,), _ = pending.finish()
        assert local is None
        sum_sent += mean
    torch.testing.assert_close(sum_sent + mem.residual("w"), sum_in, atol=1e-10, rtol=0)
