"""sparse_gc (Sun et al., DASFAA 2019) against a hand-written float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from easgd_lightning.hooks import build_compressor
from easgd_lightning.hooks.compressors.sparse_gc import SparseGCCompressor
from tests.helpers import SoloCollective


def reference_sparse_gc(grads, k, momentum, local_update):
    """The rule step by step (one worker): v += g; send the k largest |v|; v = 0 there;
    M = m M + sent; G = M + (g - sent) (or M)."""
    v = np.zeros_like(grads[0])
    M = np.zeros_like(grads[0])
    out = []
    for g in grads:
        v = v + g
        top = np.argsort(-np.abs(v), kind="stable")[:k]
        sent = np.zeros_like(v)
        sent[top] = v[top]
        v[top] = 0.0
        M = momentum * M + sent
        out.append(M + (g - sent) if local_update else M.copy())
    return out, v, M


@pytest.mark.parametrize("local_update", [True, False])
def test_compensation_on_a_constant_gradient(local_update):
    n, ratio, steps, m = 400, 0.01, 30, 0.9  # k = 4 of 400
    g = torch.linspace(-1.0, 2.0, n, dtype=torch.float64) + 1e-3 * torch.arange(n, dtype=torch.float64) ** 0.5
    comp = SparseGCCompressor(ratio=ratio, momentum=m, local_update=local_update, sample_ratio=1.0)
    assert comp.bind_training([], None) == []
    state: dict = {}
    got = [comp.aggregate(g.clone(), state, SoloCollective())[0].clone() for _ in range(steps)]
    ref, v, M = reference_sparse_gc([g.numpy()] * steps, 4, m, local_update)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(state["v"].numpy(), v, atol=1e-12)
    np.testing.assert_allclose(state["M"].numpy(), M, atol=1e-12)
    # the long-term compensation reaches coordinates never sent this step: M is dense
    assert np.count_nonzero(state["M"].numpy()) > 4 * 5


def test_mass_is_conserved_and_momentum_compensates():
    """sum of sends + v = T g; with m > 0, M has more mass than the sends alone."""
    n, steps = 300, 25
    g = torch.linspace(0.1, 1.0, n, dtype=torch.float64)
    comp = SparseGCCompressor(ratio=0.02, momentum=0.5, local_update=False, sample_ratio=1.0)
    comp.bind_training([], None)
    state: dict = {}
    sent_sum = torch.zeros(n, dtype=torch.float64)
    prev_M = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        M = comp.aggregate(g.clone(), state, SoloCollective())[0].clone()
        sent_sum += M - 0.5 * prev_M  # M_t - m M_{t-1} = the mean of the sends
        prev_M = M
    torch.testing.assert_close(sent_sum + state["v"], steps * g, rtol=1e-12, atol=1e-12)


def test_without_binding_it_is_accumulate_and_sparsify():
    """Under sync_easgd / local_sgd (no bind_training): the mean of the sends, no M."""
    g = torch.randn(500, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    comp = SparseGCCompressor(ratio=0.01, sample_ratio=1.0)
    state: dict = {}
    mean, local = comp.aggregate(g.clone(), state, SoloCollective())
    assert "M" not in state and int((mean != 0).sum()) == 5
    torch.testing.assert_close(mean, local)
    torch.testing.assert_close(mean + state["v"], g)


def test_dense_part_and_bind_training():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    comp = build_compressor("sparse_gc")
    assert comp.ratio == 1e-4 and comp.momentum == 0.9 and comp.local_update
    assert comp.dense_part(torch.ones(4), {}, 2).tolist() == [1.0] * 4  # not bound: as is
    notes = comp.bind_training([opt], 10)
    assert opt.param_groups[0]["momentum"] == 0 and "momentum was set to 0" in notes[0]
    state: dict = {}
    u = np.zeros(4)
    for t in range(3):
        g = np.arange(4.0) + t
        sent = comp.dense_part(torch.tensor(g), state, 2).numpy()
        u = 0.9 * u + g
        np.testing.assert_allclose(sent, u)
    assert comp.state_dict() == {"gradient_mode": True}


@pytest.mark.parametrize("params,key", [({"ratio": 0}, "compression.ratio"),
                                         ({"momentum": 1.0}, "compression.momentum"),
                                         ({"local_update": "yes"}, "compression.local_update"),
                                         ({"memory": True}, "compression.memory must be false")])
def test_bad_params(params, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_compressor("sparse_gc", **params)


def test_bind_exchange_undoes_gradient_mode():
    """The elastic strategies bind it as accumulate-and-sparsify (no M, small tensors as is)."""
    comp = build_compressor("sparse_gc")
    comp.bind_training([], None)
    assert comp.bind_exchange(10, lambda: 0) == []
    assert not comp.gradient_mode and comp.state_dict() == {"gradient_mode": False}
    assert comp.dense_part(torch.ones(4), {}, 2).tolist() == [1.0] * 4
