"""bench/compression_digits.py's table: the comm share it reads and how its header names it."""

from __future__ import annotations

import argparse

import pytest


@pytest.fixture(scope="module")
def digits():
    from bench import compression_digits

    return compression_digits


def _row(name: str, share: float, source: str) -> dict:
    return {"compressor": name, "status": "ok", "val_acc": 0.95, "ratio": 2.0, "codec_share": 0.01,
            "comm_share": share, "comm_share_source": source, "wall_time_s": 1.0, "command": "-m x", "extra": ""}


def test_comm_share_is_the_exposed_fraction_and_the_header_says_so(digits):
    from bench._tables import comm_share_of

    assert comm_share_of({"comm": {"exposed_fraction": 0.2, "time_fraction": 1.09}}) == (0.2, "exposed")
    assert comm_share_of({"comm": {"time_fraction": 1.09}}) == (1.09, "total")
    args = argparse.Namespace(seed=0, batch_size=8, epochs=1)
    md = digits.markdown([_row("acpsgd", 0.2, "exposed")], args).splitlines()
    assert "| comm share (exposed) |" in md[4] and "| 20.0% |" in md[6]
    md = digits.markdown([_row("acpsgd", 0.2, "exposed"), _row("old", 1.09, "total")], args).splitlines()
    assert "comm share (exposed; * total)" in md[4] and "| 109.0%* |" in md[7] and "| 20.0% |" in md[6]
    md = digits.markdown([_row("old", 1.09, "total")], args).splitlines()
    assert "comm share (total)" in md[4] and "| 109.0% |" in md[6]


def test_dgc_row_is_the_default_command(digits):
    """DGC sets the optimizer's momentum to 0 itself: the row does not override it."""
    assert not any(o.startswith("optim.momentum") for o in digits.EXTRA["dgc"])
