"""The real CLI: convergence (one multirun over three strategies), round-robin order, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import run_cli, train_summary

STRATEGIES = ("ddp", "sync_easgd", "easgd_round_robin")


@pytest.fixture(scope="module")
def digits_sweep(tmp_path_factory) -> dict[str, Path]:
    """One Hydra multirun over the three strategies (2 ranks, digits, 5 epochs: each one is
    past 0.92 validation accuracy there; chance is 0.1): {strategy: its job directory}. The
    convergence checks and the multirun's own checks (every job its own workers and
    directory) read the same jobs."""
    sweep = tmp_path_factory.mktemp("digits") / "sweep"
    proc = run_cli(
        ["-m", f"strategy={','.join(STRATEGIES)}", "trainer.devices=2",
         "trainer.max_epochs=5", "logger=csv", "trainer.enable_progress_bar=false", f"hydra.sweep.dir={sweep}"],
        check=False, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    summaries = sorted(sweep.rglob("summary.json"))
    assert len(summaries) == len(STRATEGIES)
    return {json.loads(p.read_text())["strategy"]: p.parent for p in summaries}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_convergence_on_digits(digits_sweep: dict[str, Path], strategy: str) -> None:
    s = json.loads((digits_sweep[strategy] / "summary.json").read_text())
    assert s["status"] == "ok"
    assert s["strategy"] == strategy and s["world_size"] == 2
    assert s["val_acc"] >= 0.90, s["val_acc"]
    assert len(s["steps_per_rank"]) == 2 and min(s["steps_per_rank"]) > 0
    assert all(b > 0 for b in s["comm"]["bytes_sent"])
    assert 0.0 < s["comm"]["time_fraction"] < 1.0
    assert 0.0 < s["comm"]["exposed_fraction"] <= s["comm"]["time_fraction"] + 1e-6
    assert len(s["comm"]["exposed_time_s"]) == 2
    assert all(0.0 < e <= t + 1e-6 for e, t in zip(s["comm"]["exposed_time_s"], s["comm"]["time_s"]))
    assert s["comm"]["dense_bytes"] == s["comm"]["bytes_sent"]  # no compression
    if strategy == "sync_easgd":
        # one all-reduce of the flat float32 elastic vector per step (+ the initial broadcast)
        n_params = 64 * 128 + 128 + 128 * 10 + 10
        steps = s["steps_per_rank"][1]
        assert s["comm"]["bytes_sent"][1] == steps * n_params * 4
        assert s["comm"]["bytes_sent"][0] == steps * n_params * 4 + n_params * 4
    for key in ("train_loss", "val_loss", "wall_time_s", "samples_per_s", "config"):
        assert s[key] is not None


@pytest.mark.slow
def test_round_robin_serves_in_rank_order(tmp_path: Path) -> None:
    s = train_summary(
        tmp_path / "rr", "strategy=easgd_round_robin", "trainer.devices=3", "trainer.max_epochs=1",
        "trainer.limit_train_batches=6", "faults.slow_rank=1", "faults.slow_ms=40", "checkpoint.enabled=false",
    )
    master = s["extras"][0]
    assert master["service_order"] == [0, 1, 2] * 6
    # worker 2 is never served before the slow worker 1 in the same round. Compared with the
    # master's own stamp of serving worker 1, taken before its send to 1 and so before its
    # receive from 2 and its reply to 2, which worker 2's stamp follows: cause and effect,
    # whatever the scheduler does (worker 1's own stamp, after its receive returns, may
    # be taken late when that process is not scheduled).
    served = {(step, rank): t for step, rank, t in master["service_log"]}
    t2 = dict((step, t) for step, t in s["extras"][2]["exchange_times"])
    assert sorted(t2) == sorted(step for step, rank in served if rank == 1)
    assert all(served[(k, 1)] <= served[(k, 2)] <= t2[k] for k in t2)
    # so fast worker 2 ends up at the slow worker's pace: equal step counts
    assert s["steps_per_rank"] == [6, 6, 6]


@pytest.mark.slow
def test_resume_reaches_the_same_train_loss(tmp_path: Path) -> None:
    common = ["strategy=sync_easgd", "strategy.tau=2", "trainer.precision=64-true", "trainer.limit_train_batches=8"]
    full = train_summary(tmp_path / "full", *common, "trainer.max_epochs=3")  # ranks forked (default)
    train_summary(tmp_path / "half", *common, "trainer.max_epochs=2", "launcher.start_method=spawn")
    for run, method in (("full", "fork"), ("half", "spawn")):
        assert json.loads((tmp_path / run / "ranks" / "launch.json").read_text())["start_method"] == method
    ckpt = tmp_path / "half" / "checkpoints" / "last.ckpt"
    payload = torch.load(ckpt, weights_only=True)  # tensors and plain data only
    assert payload["easgd"]["world_size"] == 2 and len(payload["easgd"]["workers"]) == 2
    # a 2-epoch run's last.ckpt is bitwise the 3-epoch run's end-of-epoch-2 checkpoint, so
    # tests/e2e/test_resume_matrix.py may resume the latter as "2 epochs + resume"; and
    # spawned ranks train bitwise as forked ones do
    straight = torch.load(tmp_path / "full" / "checkpoints" / "epoch001.ckpt", weights_only=True)
    assert torch.equal(straight["easgd"]["center"], payload["easgd"]["center"])
    for a, b in zip(straight["easgd"]["workers"], payload["easgd"]["workers"]):
        assert torch.equal(a["flat"], b["flat"])
    # the module weights in the checkpoint are the center
    center = payload["easgd"]["center"]
    flat = torch.cat([v.reshape(-1) for k, v in payload["state_dict"].items()])
    torch.testing.assert_close(flat, center)
    resumed = train_summary(tmp_path / "resumed", *common, "trainer.max_epochs=3", f"checkpoint.resume={ckpt}")
    assert resumed["steps_per_rank"] == full["steps_per_rank"] == [24, 24]
    assert resumed["train_loss"] == full["train_loss"]  # bitwise (float64)
    assert resumed["val_acc"] == full["val_acc"]


# bad input: in-process in tests/unit/cli/test_validation.py; the CLI itself (exit 2, one line,
# no worker): tests/e2e/test_bad_input_cli.py


@pytest.mark.slow
def test_multirun_jobs_get_their_own_workers_and_dirs(digits_sweep: dict[str, Path]) -> None:
    assert set(digits_sweep) == set(STRATEGIES)
    assert len(set(digits_sweep.values())) == len(STRATEGIES)  # a directory per job
    for strategy, job_dir in digits_sweep.items():
        s = json.loads((job_dir / "summary.json").read_text())
        assert s["status"] == "ok" and s["steps_per_rank"] == [115, 115]  # 5 epochs of ceil(1437 / 2 / 32)
        assert s["config"]["strategy"]["name"] == strategy
        assert (job_dir / "ranks" / "rank1.json").exists()
