"""Measure the README's feature table: every strategy x feature through ``Trainer(strategy=...)``.

    python -m tests.feature_matrix [STRATEGY ...]     # from the repository root; ~20 s a cell

Each cell is tests/distributed/scripts/feature_run.py in its own processes (90 s limit: a
metric under a parameter server hangs). Prints a markdown table: ``ok`` with the optimizer
steps (``s``) and the largest weight change (``m``), ``refused`` with the first line of the
error, or ``hung``; for manual optimization also whether it ends bitwise equal to automatic.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tests.helpers import PY, base_env

SCRIPT = Path(__file__).parent / "distributed" / "scripts" / "feature_run.py"
STRATEGIES = ["ddp_compressed", "sync_easgd", "easgd_round_robin", "local_sgd", "diloco", "async_easgd", "async_measgd",
              "async_sgd", "async_msgd", "hogwild_easgd", "hogwild_sgd"]
FEATURES = ["auto", "manual", "two_opt", "accum", "clip", "sched", "metric", "bf16-mixed", "64-true"]


def _cell(strategy: str, feature: str, out: Path) -> str:
    proc = subprocess.Popen([PY, str(SCRIPT), strategy, feature, str(out)], env=base_env(), cwd=out,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks Lightning started
        proc.wait()
        return "hung"
    path = out / f"{strategy}-{feature}-rank0.json"
    if not path.exists():
        return "no report"
    r = json.loads(path.read_text())
    if r["status"] != "ok":
        return "refused: " + r["error"].splitlines()[0].replace("|", "/")
    cell = f"ok s{r['steps']} m{r['moved']:.2g}"
    if feature == "manual" and (out / f"{strategy}-auto-rank0.pt").exists():
        same = torch.equal(torch.load(out / f"{strategy}-auto-rank0.pt"), torch.load(out / f"{strategy}-manual-rank0.pt"))
        cell += ", = auto" if same else ", != auto"
    return cell


def main() -> None:
    strategies = sys.argv[1:] or STRATEGIES
    print("| strategy | " + " | ".join(FEATURES) + " |")
    print("|---" * (len(FEATURES) + 1) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in strategies:
            cells = [_cell(strategy, feature, Path(tmp)) for feature in FEATURES]
            print(f"| {strategy} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
