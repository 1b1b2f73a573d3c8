"""``CompressionHookState``'s copies for ``ft=torchft`` (easgd_lightning/hooks/ddp.py): a
snapshot undoes an iteration bit for bit, and a joiner receives its peer's codec state but
not the peer's own error feedback."""

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


def _joiner_of(peer: CompressionHookState, compressor) -> CompressionHookState:
    joiner = CompressionHookState(compressor)
    joiner.restore(peer.snapshot(shared_only=True))
    return joiner


def test_joiner_gets_what_every_rank_holds_alike_not_the_peers_error_feedback() -> None:
    peer = _residual_state()
    joiner = _joiner_of(peer, TopKCompressor(ratio=0.5, memory=True))
    assert joiner.memory.residual("w") is None  # the peer's residual stays the peer's
    assert joiner.tensor_states["w"] == {"key_hash": 7, "last_nnz": 3} and joiner.iteration == 4
    assert torch.equal(peer.memory.residual("w"), torch.tensor([0, 1, 2, 0, 0, 0], dtype=torch.float64))

    dgc = CompressionHookState(DGCCompressor())
    dgc.tensor_states["w"] = {"u": torch.ones(4), "v": torch.full((4,), 2.0), "step": 9}
    assert _joiner_of(dgc, DGCCompressor()).tensor_states["w"] == {"step": 9}  # momentum correction dropped
    assert set(dgc.tensor_states["w"]) == {"u", "v", "step"}

    power = CompressionHookState(PowerSGDCompressor())
    q = torch.randn(8, 2)
    power.tensor_states["w"] = {"q": q, "step": 3}
    got = _joiner_of(power, PowerSGDCompressor()).tensor_states["w"]
    assert torch.equal(got["q"], q) and got["step"] == 3  # Q: the same on every rank
