"""The Python API: what a strategy cannot train is refused in its setup with one line."""

from __future__ import annotations

import re
from pathlib import Path

from tests.helpers import run_python

SCRIPT = Path(__file__).parent / "scripts" / "two_optimizers_run.py"


def test_two_optimizers_are_refused_in_setup_with_one_line() -> None:
    proc = run_python(SCRIPT, ["sync_easgd"], timeout=180)
    assert proc.returncode != 0
    # torch prefixes each rank's traceback lines with "[rankN]: "
    lines = [re.sub(r"^\[rank\d+\]: ", "", ln) for ln in proc.stderr.splitlines()]
    errors = [ln for ln in lines if ln.startswith("ValueError:")]
    assert errors and all(
        ln.startswith("ValueError: strategy=sync_easgd drives exactly one optimizer, but configure_optimizers "
                      "returned 2: return one optimizer") for ln in errors
    ), proc.stderr[-3000:]
