"""``Trainer(strategy=Pipeline3DStrategy(...))`` on 4 real gloo processes (pp=2, dp=2) with
Optimus-CC: Lightning logging, per-stage checkpoints (checksummed, weights-only), an
exact resume, and a corrupted checkpoint refused on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from easgd_lightning.utils.checkpoint import CHECKSUM_KEY, content_digest
from tests.helpers import launch_ranks

SCRIPT = Path(__file__).parent / "scripts" / "pipeline_lightning_worker.py"
EPOCHS, BATCHES = 2, 5


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("pl_pp2dp2")
    compression = {"name": "optimus_cc", "rank": 4, "dp_rank": 4}
    launch_ranks(
        SCRIPT, 4,
        ["--out", str(out), "--pp", "2", "--batch-size", "8", "--micro-batches", "4",
         "--epochs", str(EPOCHS), "--batches", str(BATCHES), "--compression", json.dumps(compression)],
        timeout=300,
    )
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def test_trains_and_logs_through_lightning(run):
    _, ranks = run
    first = ranks[0]
    assert len(first["train"]) == EPOCHS * BATCHES
    assert all(r["train"] == first["train"] for r in ranks)  # one loss on every rank
    assert first["train"][-1] < first["train"][0] - 1.0
    assert len(first["val"]) == EPOCHS and first["val"][1] < first["val"][0]
    coords = [r["extras"]["coords"] for r in ranks]
    assert [(c["stage"], c["data"]) for c in coords] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["extras"]["layout"] == {"pp": 2, "tp": 1, "dp": 2} for r in ranks)
    for r in ranks[2:]:  # the last stage sends compressed gradients backward
        assert r["extras"]["pipeline"]["grad_sends_compressed"] == EPOCHS * BATCHES * 4
    kinds = set(ranks[0]["meter"]["by_kind"])
    assert {"pipeline", "data_parallel", "embedding"} <= kinds


def test_checkpoint_holds_every_stage_and_resumes_exactly(run):
    out, ranks = run
    ckpt = out / "ckpt" / "ep0.ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "meta.pt",
        "optimus_stage00_tp00_dp000.pt",
        "optimus_stage00_tp00_dp001.pt",
        "optimus_stage01_tp00_dp000.pt",
        "optimus_stage01_tp00_dp001.pt",
        "stage00_tp00.pt",
        "stage01_tp00.pt",
    ]
    for r in ranks:
        # resumed from the end of epoch 0: epoch 1 repeats bit for bit (model, AdamW,
        # LEP residuals, PowerSGD warm starts and errors all restored on every rank)
        assert r["resumed_train"] == r["train"][BATCHES:]
        assert r["resumed_val"] == r["val"][1:]


def test_checkpoint_files_are_checksummed_and_corruption_is_refused_on_every_rank(run):
    out, ranks = run
    for f in (out / "ckpt" / "ep0.ckpt").iterdir():
        part = torch.load(f, weights_only=True)  # tensors and plain data only
        assert part[CHECKSUM_KEY]["digest"] == content_digest(part), f.name
    for rank, r in enumerate(ranks):
        # ranks 2-3 (stage 1) find their shard corrupted; ranks 0-1 stop too, naming it
        damaged = out / f"damaged_rank{max(rank, 2)}" / "stage01_tp00.pt"
        assert r["refused"] is not None and r["refused"].startswith("CheckpointError: "), r["refused"]
        assert f"{damaged} is corrupted" in r["refused"], r["refused"]
        assert ("(rank 2's part)" in r["refused"]) == (rank < 2), r["refused"]
