"""Error feedback: sum of transmitted + final residual == sum of inputs (nothing is lost)."""

from __future__ import annotations

import pytest
import torch

from easgd_lightning.hooks import NoMemory, ResidualMemory, build_compressor, make_memory
from tests.helpers import SoloCollective


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
