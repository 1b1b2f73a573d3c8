"""``CompressionHookState``'s copies for ``ft=torchft`` (easgd_lightning/hooks/ddp.py): a
snapshot undoes an iteration bit for bit, and a joiner forgets only its own error feedback."""

from __future__ import annotations

import torch

from easgd_lightning.hooks.compressors import DGCCompressor, PowerSGDCompressor, TopKCompressor
from easgd_lightning.hooks.ddp import CompressionHookState


def _residual_state() -> CompressionHookState:
    state = CompressionHookState(TopKCompressor(ratio=0.5, memory=True))
    g = torch.arange(6, dtype=torch.float64)
    p = state.memory.compensate("w", g)
    state.memory.update("w", p, torch.tensor([0, 0, 0, 3, 4, 5], dtype=torch.float64))
    state.tensor_states["w"] = {"key_hash": 7, "last_nnz": 3}
    state.iteration = 4
    return state


def test_snapshot_restores_residuals_counters_and_capacities() -> None:
    state = _residual_state()
    state.collective.load_capacities({("w", 0): 128})
    snap = state.snapshot()
    # an iteration that is then undone: residual, codec state, counter and capacity all move
    p = state.memory.compensate("w", torch.ones(6, dtype=torch.float64))
    state.memory.update("w", p, torch.zeros(6, dtype=torch.float64))
    state.tensor_states["w"]["last_nnz"] = 6
    state.iteration = 5
    state.collective.load_capacities({("w", 0): 256})
    state.restore(snap)
    assert torch.equal(state.memory.residual("w"), torch.tensor([0, 1, 2, 0, 0, 0], dtype=torch.float64))
    assert state.tensor_states["w"] == {"key_hash": 7, "last_nnz": 3}
    assert state.iteration == 4 and state.collective.capacities() == {("w", 0): 128}


def test_forget_worker_state_keeps_what_every_rank_holds_alike() -> None:
    state = _residual_state()
    state.forget_worker_state()
    assert state.memory.residual("w") is None  # the residual memory: this worker's own
    assert state.tensor_states["w"] == {"key_hash": 7, "last_nnz": 3}

    dgc = CompressionHookState(DGCCompressor())
    u, v = torch.ones(4), torch.full((4,), 2.0)
    dgc.tensor_states["w"] = {"u": u, "v": v, "step": 9}
    dgc.forget_worker_state()
    assert dgc.tensor_states["w"] == {"step": 9}  # momentum correction and accumulation dropped

    power = CompressionHookState(PowerSGDCompressor())
    q = torch.randn(8, 2)
    power.tensor_states["w"] = {"q": q, "step": 3}
    power.forget_worker_state()
    assert power.tensor_states["w"]["q"] is q and power.tensor_states["w"]["step"] == 3  # Q: the same on every rank
