"""Compressed parameter-server pushes through the real CLI, metered as compressed (issue 31
section 8): ``easgd-train strategy=S compression=topk compression.min_numel=0
trainer.devices=3 trainer.max_epochs=1 logger=none``.

For each worker, ``comm.dense_bytes - comm.bytes_sent`` (its parameter-server traffic) is
exactly what its pushes saved: pushes x the dense size of one push minus the bytes the
compressed pushes took (``extras[r].compressed_pushes``), and the pushes are many times
smaller than dense. Before the fix ``dense_bytes == bytes_sent`` (ratio 1.0 in the report).
The server's replies are dense (one-way), so its dense and sent bytes are equal. With
``async_easgd`` the pushes are compressed elastic differences (they were refused before).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_cli


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["async_sgd", "async_easgd"])
def test_compressed_pushes_are_metered_against_their_dense_size(tmp_path: Path, strategy: str) -> None:
    run_dir = tmp_path / strategy
    run_cli([f"strategy={strategy}", "compression=topk", "compression.min_numel=0", "trainer.devices=3",
             "trainer.max_epochs=1", "logger=none", f"hydra.run.dir={run_dir}"], timeout=500)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "ok", s.get("error")
    per_rank = s["comm"]["by_kind_per_rank"]
    for r in (0, 1):  # the workers
        ps = per_rank[r]["parameter_server"]
        push = s["extras"][r]["compressed_pushes"]
        assert push["compressor"] == "topk" and push["pushes"] == s["extras"][r]["exchanges"] > 0
        dense_pushes = push["pushes"] * push["dense_bytes_per_direction"]
        assert ps["dense_bytes"] - ps["bytes_sent"] == dense_pushes - push["bytes_up"], (ps, push)
        assert dense_pushes >= 20 * push["bytes_up"], push  # top-k at its default ratio: ~45x
        assert s["comm"]["dense_bytes"][r] > s["comm"]["bytes_sent"][r]
    server = per_rank[2]["parameter_server"]
    assert server["dense_bytes"] == server["bytes_sent"] > 0  # dense replies
