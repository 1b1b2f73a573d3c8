"""Test helpers shared by the test files and the table scripts (``python -m tests.feature_matrix``):
compose the config as ``easgd-train`` does, read the CLI's one error line, run the real CLI
and real multi-process scripts in subprocesses. (The tiers, markers by directory, live in
tests/conftest.py; this module is importable outside pytest too.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from easgd_lightning.utils.rank_env import clean_env, free_port, rank_env

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def base_env(**extra: str) -> dict[str, str]:
    """The environment a test's subprocess runs in: no rendezvous variables, this checkout
    first on PYTHONPATH, W&B offline (:func:`easgd_lightning.utils.rank_env.clean_env`)."""
    return clean_env(repo=REPO, WANDB_MODE="offline", **extra)


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


def compose(overrides: list[str], *, hydra_config: bool = False):
    """The config ``easgd-train`` would build from ``overrides`` (Hydra's compose over the
    package's config tree, the recipe resolvers registered), without checking it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from easgd_lightning.cli.train import CONF_DIR  # also registers the recipe resolvers

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=list(overrides), return_hydra_config=hydra_config)


def one_error_line(stderr: str) -> str:
    """The CLI's refusal: exactly one ``easgd-train: error:`` line and no traceback."""
    lines = [ln for ln in stderr.splitlines() if ln.startswith("easgd-train: error:")]
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def start_ranks(script: Path, world: int, args: list[str]) -> list[subprocess.Popen]:
    """Start ``script`` as ``world`` ranks (torchrun-style environment); pipes for out/err."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = rank_env(base_env(), rank, world, port)
        procs.append(
            subprocess.Popen([PY, str(script), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return procs


def launch_ranks(script: Path, world: int, args: list[str], *, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Run ``script`` as ``world`` ranks (torchrun-style environment) and wait for all."""
    procs = start_ranks(script, world, args)
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


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_valid_png(path: Path) -> None:
    """A real, non-blank PNG: signature, size, decodable by matplotlib, not one flat colour."""
    import matplotlib.image as mpimg

    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > 5_000, (path, len(data))
    pixels = mpimg.imread(str(path))
    assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert float(pixels[..., :3].std()) > 0.01  # axes, labels and data, not a blank canvas


class SoloCollective:
    """world_size = 1: each collective returns this rank's own tensors (nothing to exchange)."""

    world_size = 1

    def all_reduce_sum(self, tensors):
        return [t.clone() for t in tensors]

    def all_reduce_max(self, tensors):
        return [t.clone() for t in tensors]

    def all_gather(self, tensors):
        return [[t.clone() for t in tensors]]
