"""Test helpers: run the real CLI and real multi-process scripts in subprocesses."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def run_cli(args: list[str], *, timeout: float = 300, check: bool = True, cwd: Path | None = None):
    """Run ``easgd-train ARGS`` (via ``python -m``); returns the CompletedProcess."""
    cmd = [PY, "-m", "easgd_lightning.cli.train", *args]
    proc = subprocess.run(cmd, env=base_env(), cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"easgd-train failed ({proc.returncode}):\n{' '.join(args)}\n"
            f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def train_summary(run_dir: Path, *overrides: str, timeout: float = 300) -> dict:
    """Train through the CLI into ``run_dir`` and return its summary.json."""
    run_cli(
        [f"hydra.run.dir={run_dir}", "logger=csv", "trainer.enable_progress_bar=false", *overrides],
        timeout=timeout,
    )
    return json.loads((run_dir / "summary.json").read_text())


def launch_ranks(script: Path, world: int, args: list[str], *, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Run ``script`` as ``world`` ranks (torchrun-style environment) and wait for all."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = base_env(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), NODE_RANK="0",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen([PY, str(script), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r in results:
        if r.returncode != 0:
            raise AssertionError(f"rank failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return results


class SoloCollective:
    """world_size = 1: each collective returns this rank's own tensors (nothing to exchange)."""

    world_size = 1

    def all_reduce_sum(self, tensors):
        return [t.clone() for t in tensors]

    def all_reduce_max(self, tensors):
        return [t.clone() for t in tensors]

    def all_gather(self, tensors):
        return [[t.clone() for t in tensors]]
