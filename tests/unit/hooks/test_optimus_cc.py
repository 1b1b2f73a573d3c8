"""Optimus-CC pure parts: low-rank factors, LEP bookkeeping, epilogue rule, stage choice."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.pipe import schedule

from easgd_lightning.hooks.compressors.powersgd import PowerSGDCompressor, power_iteration
from easgd_lightning.hooks.optimus_cc import (
    ActivationGradCompressor,
    OptimusCCConfig,
    auto_selective_stages,
    is_epilogue_send,
    resolve_selective_stages,
)


def test_power_iteration_is_exact_on_low_rank_matrices():
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(40, 3, generator=gen, dtype=torch.float64) @ torch.randn(
        3, 12, generator=gen, dtype=torch.float64
    )
    p, q = power_iteration(m, torch.randn(12, 4, generator=gen, dtype=torch.float64))
    assert torch.allclose(p.t() @ p, torch.eye(4, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(p @ q.t(), m, atol=1e-10)


def test_power_iteration_is_a_projection():
    """P Q^T = P P^T M: the orthogonal projection of M, so it never grows the norm."""
    gen = torch.Generator().manual_seed(1)
    m = torch.randn(30, 20, generator=gen)
    p, q = power_iteration(m, torch.randn(20, 5, generator=gen))
    approx = p @ q.t()
    assert torch.allclose(approx, p @ (p.t() @ m), atol=1e-5)
    assert approx.norm() <= m.norm() + 1e-5
    assert torch.allclose((m - approx).t() @ p, torch.zeros(20, 5), atol=1e-4)


def test_lazy_error_propagation_telescopes():
    """With LEP the messages sum to the gradients minus the last residual (nothing is lost)."""
    comp = ActivationGradCompressor(rank=2, lazy_error_propagation=True, seed=3)
    gen = torch.Generator().manual_seed(4)
    grads = [torch.randn(4, 8, 16, generator=gen, dtype=torch.float64) for _ in range(6)]
    sent = []
    for i, g in enumerate(grads):
        if i == 3:
            sent.append(comp.dense(g))  # a dense message spends the residual
        else:
            p, q = comp.compress(g)
            assert p.shape == (32, 2) and q.shape == (16, 2)
            sent.append(comp.decompress(p, q, g.shape))
    residual = comp.residual
    assert torch.allclose(sum(sent), sum(grads) - residual, atol=1e-9)
    assert comp.stats == {"compressed": 5, "dense": 1}


def test_without_lep_residual_is_dropped():
    comp = ActivationGradCompressor(rank=2, lazy_error_propagation=False)
    g = torch.randn(8, 16)
    comp.compress(g)
    assert comp.residual is None
    assert torch.equal(comp.dense(g), g)


def test_cb_factors_are_one_power_iteration_of_the_token_by_hidden_matrix():
    """CB's (P, Q) against the rule written here: M = grad as (batch * seq, hidden),
    P = orth(M Q0), Q = M^T P, with Q0 the codec's seeded start; the next call starts
    from that Q (warm start); the residual is M - P Q^T."""
    comp = ActivationGradCompressor(rank=3, lazy_error_propagation=True, seed=5)
    gen = torch.Generator().manual_seed(6)
    g1, g2 = (torch.randn(2, 10, 12, generator=gen, dtype=torch.float64) for _ in range(2))
    q0 = comp.codec._initial_q(12, 3, {}, g1)
    p1, q1 = comp.compress(g1)
    m1 = g1.reshape(20, 12)
    ref_p = torch.linalg.qr(m1 @ q0, mode="reduced")[0]
    assert torch.allclose(p1, ref_p, atol=1e-12) and torch.allclose(q1, m1.t() @ ref_p, atol=1e-12)
    assert torch.allclose(comp.residual, g1 - (ref_p @ q1.t()).reshape(g1.shape), atol=1e-12)
    p2, q2 = comp.compress(g2)
    m2 = g2.reshape(20, 12) + (m1 - ref_p @ q1.t())
    ref_p2 = torch.linalg.qr(m2 @ q1, mode="reduced")[0]
    assert torch.allclose(p2, ref_p2, atol=1e-10) and torch.allclose(q2, m2.t() @ ref_p2, atol=1e-10)


def test_factor_shapes_only_when_smaller():
    comp = ActivationGradCompressor(rank=16)
    assert comp.factor_shapes((4, 64, 128)) == ((256, 16), (128, 16))
    assert comp.factor_shapes((2, 8, 16)) is None  # 16*(16+16) >= 16*16
    codec = PowerSGDCompressor(16, matrix_view="trailing")
    assert not codec.compresses((16, 16)) and codec.compresses((256, 128))


def _epilogue_from_schedule(micro_batches: int, stages: int, stage: int) -> list[bool]:
    """Which SendGrad commands of DeepSpeed's TrainSchedule follow the stage's last forward."""
    cmds = [c for step in schedule.TrainSchedule(micro_batches, stages, stage).steps() for c in step]
    last_fwd = max(i for i, c in enumerate(cmds) if isinstance(c, schedule.ForwardPass))
    return [i > last_fwd for i, c in enumerate(cmds) if isinstance(c, schedule.SendGrad)]


@pytest.mark.parametrize("micro_batches", [1, 2, 4, 7])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_epilogue_rule_matches_deepspeed_schedule(micro_batches, stages):
    for stage in range(1, stages):
        expected = _epilogue_from_schedule(micro_batches, stages, stage)
        got = [is_epilogue_send(m, micro_batches, stages, stage) for m in range(micro_batches)]
        assert got == expected, (stage, got, expected)


def test_selective_stages():
    assert auto_selective_stages(1) == [0]
    assert auto_selective_stages(2) == [0]
    assert auto_selective_stages(5) == [0, 1, 2]
    assert resolve_selective_stages("all", 3) == [0, 1, 2]
    assert resolve_selective_stages("none", 3) == []
    assert resolve_selective_stages([2, 0, 2], 3) == [0, 2]
    with pytest.raises(ValueError, match=r"compression.selective_stages lists stage\(s\) \[5\]"):
        resolve_selective_stages([5], 2)


def test_config_validation():
    cfg = OptimusCCConfig.from_mapping({"name": "optimus_cc", "rank": 8, "selective_stages": [1]})
    assert cfg.rank == 8 and cfg.selective_stages == [1]
    with pytest.raises(ValueError, match="unknown compression key"):
        OptimusCCConfig.from_mapping({"rnak": 3})
    with pytest.raises(ValueError, match="compression.rank must be an integer >= 1"):
        OptimusCCConfig(rank=0)
    with pytest.raises(ValueError, match="compression.selective_stages"):
        OptimusCCConfig(selective_stages="some")
    with pytest.raises(ValueError, match="compression.epilogue_only must be true or false"):
        OptimusCCConfig(epilogue_only="yes")


def test_aggregate_many_is_aggregate_per_tensor():
    """SC's batched exchange (all P in one all-reduce, then all Q) gives each tensor what
    the per-tensor exchange gives it, on a one-rank collective."""
    from tests.helpers import SoloCollective

    codec = PowerSGDCompressor(2, matrix_view="trailing", seed=1)
    gen = torch.Generator().manual_seed(7)
    tensors = [torch.randn(6, 5, 8, generator=gen), torch.randn(40, 9, generator=gen)]
    many = codec.aggregate_many(tensors, [{"key_hash": 0}, {"key_hash": 1}], SoloCollective())
    for i, t in enumerate(tensors):
        mean, local = codec.aggregate(t, {"key_hash": i}, SoloCollective())
        assert torch.allclose(many[i][0], mean, atol=1e-6) and torch.allclose(many[i][1], local, atol=1e-6)
        m = t.reshape(-1, t.shape[-1])
        p = torch.linalg.qr(m @ codec._initial_q(m.shape[1], 2, {"key_hash": i}, m))[0]
        assert torch.allclose(mean, (p @ p.t() @ m).reshape(t.shape), atol=1e-5)
