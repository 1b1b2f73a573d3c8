"""Resume through the real CLI (2 ranks, digits, float64): exact for every strategy x
compressor pair that keeps state; checkpoints weights-only and checksummed; a corrupted
or foreign checkpoint refused before launch; a NaN loss stops the run.

Each matrix case trains 4 epochs of 8 steps straight and resumes that run's end-of-epoch-2
checkpoint (``epoch001.ckpt``) for epochs 3-4; tests/e2e/test_cli_foundation.py checks
once that a separate 2-epoch run writes bitwise that checkpoint, which is what makes the
shortcut "2 epochs + resume".
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import compose, run_cli, train_summary
from tests.helpers import one_error_line as _one_error_line

COMMON = [
    "trainer.precision=64-true",
    "trainer.limit_train_batches=8",
    "compression.min_numel=1000",  # digits' MLP: 8192 + 1280 weights compressed, biases dense
]

#: adaptive with a fixed link and compute time (measured ones are wall-clock): density
#: 0.01 s * 1e6 B/s / (2 ranks * 12 B) / N, N = 8192 + 1280 -> 0.044 (0.051 if N were 8192)
ADAPTIVE_FIXED = ["compression.bandwidth=1e6", "compression.compute_time=0.01"]

#: Streaming DiLoCo whose fragment 1 is in flight at step 16 (tau 6, F 2: a fragment every
#: 3 steps, each prepared 2 steps before its synchronisation)
DILOCO_STREAMING = ["strategy.tau=6", "strategy.fragments=2", "strategy.fragment_sync_delay=2"]

#: (strategy, compression, extra overrides, the per-rank state that must be in the checkpoint)
MATRIX = [
    ("ddp", "topk", [], "residuals"),
    ("ddp", "dgc", ["optim.momentum=0"], "v"),
    ("ddp", "powersgd", [], "q"),
    ("sync_easgd", "topk", ["strategy.tau=2"], "residuals"),
    ("sync_easgd", "powersgd", ["strategy.tau=2"], "q"),
    ("local_sgd", "topk", ["strategy.tau=3"], "residuals"),  # epoch ends mid-round
    # compressor-wide state: qsgd's noise generator (seed null), adaptive's tensor sizes
    ("ddp", "qsgd", [], "noise_calls"),
    ("local_sgd", "qsgd", ["strategy.tau=3"], "noise_calls"),
    ("sync_easgd", "adaptive", ["strategy.tau=2", *ADAPTIVE_FIXED], "residuals"),
    # DiLoCo: two fragments, an exchange in flight at the epoch-2 checkpoint (prepared at
    # step 16, applied at 18), the outer momentum; 4-bit QSGD as Streaming DiLoCo sends
    ("diloco", "topk", [*DILOCO_STREAMING], "residuals"),
    ("diloco", "qsgd", [*DILOCO_STREAMING, "compression.levels=7"], "noise_calls"),
]


def _keys_with_tensors(obj, key: str | None = None) -> set[str]:
    """Keys of ``obj`` (nested) under which a tensor is stored."""
    found: set[str] = set()
    if isinstance(obj, torch.Tensor):
        return {key} if key is not None else set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            found |= _keys_with_tensors(v, str(k)) if not isinstance(v, dict) else _keys_with_tensors(v, str(k)) | (
                {str(k)} if any(isinstance(x, torch.Tensor) for x in v.values()) else set()
            )
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            found |= _keys_with_tensors(v, key)
    return found


def _rank_states(ckpt: dict) -> list[dict]:
    if "ddp" in ckpt:
        return [r["hook"] for r in ckpt["ddp"]["ranks"]]
    return [w["extra"] for w in ckpt["easgd"]["workers"]]


def _compressed(summary: dict) -> bool:
    return all(s < d for s, d in zip(summary["comm"]["bytes_sent"], summary["comm"]["dense_bytes"]))


@pytest.mark.slow
@pytest.mark.parametrize("strategy,compression,extra,state_key", MATRIX, ids=[f"{s}-{c}" for s, c, *_ in MATRIX])
def test_resume_is_exact(tmp_path: Path, strategy: str, compression: str, extra: list[str], state_key: str) -> None:
    common = [f"strategy={strategy}", f"compression={compression}", *COMMON, *extra]
    full = train_summary(tmp_path / "full", *common, "trainer.max_epochs=4")
    assert full["status"] == "ok" and full["steps_per_rank"] == [32, 32]
    assert _compressed(full), full["comm"]  # the compressor engaged (else nothing to keep)

    ckpt_path = tmp_path / "full" / "checkpoints" / "epoch001.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=True)  # tensors and plain data only
    states = _rank_states(ckpt)
    assert len(states) == 2
    for state in states:
        if state_key == "noise_calls":  # qsgd: per-tensor call counts + the stream seed, plain ints
            text = json.dumps(state, default=str)
            assert "noise_calls" in text and "stream_seed" in text, text[:2000]
            continue
        assert state_key in _keys_with_tensors(state), sorted(_keys_with_tensors(state))
    # the two ranks' compression state differs (residuals of their own data), so one per rank
    # (qsgd keeps no residuals; its stream seed comes from the same seeded global RNG)
    assert state_key == "noise_calls" or not all(
        torch.equal(a, b)
        for a, b in zip(_tensors(states[0]), _tensors(states[1]))
        if a.shape == b.shape
    )

    resumed = train_summary(tmp_path / "resumed", *common, "trainer.max_epochs=4", f"checkpoint.resume={ckpt_path}")
    assert resumed["status"] == "ok"
    assert resumed["steps_per_rank"] == full["steps_per_rank"] == [32, 32]
    assert resumed["train_loss"] == full["train_loss"]  # bitwise: float64 and same order of operations
    assert resumed["val_acc"] == full["val_acc"]
    assert resumed["val_loss"] == full["val_loss"]
    assert [h["val_acc"] for h in resumed["val_history"]] == [h["val_acc"] for h in full["val_history"][2:]]


@pytest.mark.slow
def test_diloco_resume_is_exact_without_compression(tmp_path: Path) -> None:
    """theta, the outer momentum and the fragment in flight are in the checkpoint: 2 epochs
    + resume to 4 equals 4 straight epochs, bit for bit (float64)."""
    common = ["strategy=diloco", *COMMON, *DILOCO_STREAMING]
    full = train_summary(tmp_path / "full", *common, "trainer.max_epochs=4")
    assert full["status"] == "ok" and full["steps_per_rank"] == [32, 32]
    ckpt_path = tmp_path / "full" / "checkpoints" / "epoch001.ckpt"
    easgd = torch.load(ckpt_path, weights_only=True)["easgd"]
    assert easgd["extra"]["momentum"].abs().max() > 0  # the outer optimizer's state
    for worker in easgd["workers"]:  # fragment 1 was prepared at step 16, is applied at 18
        assert list(worker["extra"]["pending"]) == [1] and worker["extra"]["synced_at"] == [15, 12]
    resumed = train_summary(tmp_path / "resumed", *common, "trainer.max_epochs=4", f"checkpoint.resume={ckpt_path}")
    assert resumed["steps_per_rank"] == [32, 32]
    assert resumed["train_loss"] == full["train_loss"] and resumed["val_loss"] == full["val_loss"]
    assert [h["val_acc"] for h in resumed["val_history"]] == [h["val_acc"] for h in full["val_history"][2:]]
    assert full["extras"][0]["outer_syncs"] == [6, 6]  # 32 steps: 5 + the end's, each fragment


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


# ---------------------------------------------------------------------- refusals (CLI)
@pytest.fixture(scope="module")
def ddp_checkpoint(tmp_path_factory) -> Path:
    """A real 2-rank ddp + topk checkpoint (1 epoch of 4 steps)."""
    run = tmp_path_factory.mktemp("ddp_ckpt")
    train_summary(run, "strategy=ddp", "compression=topk", *COMMON, "trainer.max_epochs=1",
                  "trainer.limit_train_batches=4")
    return run / "checkpoints" / "last.ckpt"


@pytest.mark.slow
@pytest.mark.parametrize(
    "damage,overrides,expected",
    [
        ("corrupt", ["strategy=ddp"], "is corrupted"),
        ("truncate", ["strategy=ddp"], "is not a readable checkpoint"),
        (None, ["strategy=sync_easgd"], "was written by strategy=ddp; this run has strategy=sync_easgd"),
        (None, ["strategy=ddp", "trainer.devices=3"], "was written by 2 processes; this run has 3"),
        (None, ["strategy=ddp", "model.hidden=64"], "holds another model than model=mlp"),
    ],
    ids=["corrupt", "truncated", "strategy", "world", "model"],
)
def test_cli_refuses_bad_resume_before_launch(tmp_path: Path, ddp_checkpoint: Path, damage, overrides, expected) -> None:
    path = ddp_checkpoint
    if damage is not None:
        path = tmp_path / "damaged.ckpt"
        data = bytearray(ddp_checkpoint.read_bytes())
        if damage == "corrupt":  # 64 float64 values overwritten inside the first weight matrix
            weight = torch.load(ddp_checkpoint, weights_only=True)["state_dict"]["net.1.weight"]
            at = data.index(weight.numpy().tobytes()) + weight.numel() * 4
            data[at : at + 64 * 8] = torch.full((64,), 7.0, dtype=torch.float64).numpy().tobytes()
        else:
            data = data[: len(data) // 3]
        path.write_bytes(bytes(data))
    if damage != "corrupt":  # in-process: the check easgd-train runs before launch
        from easgd_lightning.cli.validate import ConfigError, validate_config

        with pytest.raises(ConfigError) as err:
            validate_config(compose([*COMMON, *overrides, f"checkpoint.resume={path}"]))
        line = str(err.value)
        assert "\n" not in line and line.startswith(f"checkpoint.resume: {path}") and expected in line, line
        return
    run = tmp_path / "run"  # one case through the real CLI: exit 2, one line, no worker
    proc = run_cli([f"hydra.run.dir={run}", "logger=none", *COMMON, *overrides, f"checkpoint.resume={path}"],
                   check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_error_line(proc.stderr)
    assert line.startswith(f"easgd-train: error: checkpoint.resume: {path}") and expected in line, line
    assert not (run / "ranks").exists()  # no worker started


# ---------------------------------------------------------------------- NaN loss
@pytest.mark.slow
def test_nan_loss_stops_the_run_naming_the_step(tmp_path: Path) -> None:
    """Rank 1's weights become NaN just before step 5: its loss there is NaN, the run ends
    diverged (exit 1) and the summary says which rank and step; with
    allow_nonfinite_loss=true the same run goes to the end."""
    common = ["strategy=ddp", *COMMON, "trainer.max_epochs=1", "faults.nan_rank=1", "faults.nan_at_step=5",
              "timeout_s=60", "checkpoint.enabled=false"]
    run = tmp_path / "stop"
    proc = run_cli([f"hydra.run.dir={run}", "logger=csv", "trainer.enable_progress_bar=false", *common],
                   check=False, timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["error"].startswith("diverged at step 5 (rank 1): ")
    assert "NonFiniteLossError: train loss is nan at step 5 on rank 1" in summary["rank_errors"]["1"]

    allowed = train_summary(tmp_path / "allowed", *common, "allow_nonfinite_loss=true", timeout=240)
    assert allowed["status"] == "ok" and allowed["steps_per_rank"] == [8, 8]
    assert math.isnan(allowed["train_loss"])  # ddp averaged the NaN gradient into both ranks
