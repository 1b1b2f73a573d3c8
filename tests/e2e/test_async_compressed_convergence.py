"""Compressed pushes through the asynchronous parameter server train digits like dense ones
(real CLI; ``strategy=async_sgd``, 2 workers + the server rank, AdamW stepped at the server).

One-way (compressed pushes, dense replies) and two-way (``compression.two_way``: the server
compresses each reply with the residual it keeps per worker) against the dense run with the
same seed, data and epochs, top-k at 10% over 10 epochs (batch 32). The server applies pushes
in arrival order, so each run is its own trajectory: val_acc of 5 runs each on idle cores
(2026-12-06, these three runs repeated) dense 0.953-0.961, one-way 0.947-0.969, two-way 0.942-0.956; of 6
runs each beside two busy loops dense 0.944-0.969, one-way 0.936-0.969, two-way
0.947-0.961 (std ~0.01 per run). The two runs compared here differ by up to 0.033 with no
defect (a two-worker suite failed at 0.025 below dense), so both are held to
``RUN_SPREAD`` = 0.05 of dense, which still fails a lost residual or a wrong replica (those
end below 0.5). At 1% and 5 epochs both trail by ~0.06-0.08 (dense 0.953, one-way 0.892,
two-way 0.875), as the ring does at that setting (bench/compression_digits.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import train_summary

COMMON = ["strategy=async_sgd", "trainer.devices=3", "trainer.max_epochs=10", "checkpoint.enabled=false",
          "seed=0", "optim.optimizer=adamw", "optim.lr=0.003"]
RATIO = "0.1"
RUN_SPREAD = 0.05  # what two runs of the same configuration differ by (module docstring)


@pytest.mark.slow
def test_compressed_pushes_train_like_dense_pushes(tmp_path: Path) -> None:
    dense = train_summary(tmp_path / "dense", *COMMON, "compression=none", timeout=600)
    assert dense["status"] == "ok" and dense["val_acc"] >= 0.9, dense.get("error")
    for way in ("one", "two"):
        s = train_summary(tmp_path / way, *COMMON, "compression=topk", f"compression.ratio={RATIO}",
                          "compression.min_numel=0", f"compression.two_way={str(way == 'two').lower()}", timeout=600)
        assert s["status"] == "ok", s.get("error")
        assert s["val_acc"] >= dense["val_acc"] - RUN_SPREAD, (way, s["val_acc"], dense["val_acc"])
        push = s["extras"][0]["compressed_pushes"]
        assert push["compressor"] == "topk" and push["two_way"] == (way == "two") and push["pushes"] > 0
        dense_per_push = push["dense_bytes_per_direction"]
        # up: ~RATIO of the entries as (index, value) pairs, plus a header
        assert push["bytes_up"] < 4 * float(RATIO) * dense_per_push * push["pushes"]
        if way == "two":
            assert push["bytes_down"] < 4 * float(RATIO) * dense_per_push * push["pushes"]
        else:
            assert push["bytes_down"] == dense_per_push * push["pushes"]
