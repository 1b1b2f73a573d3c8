"""Faults and state of the asynchronous family through the real CLI: a worker that dies,
and resuming the center together with the server's state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from easgd_lightning.utils.checkpoint import CHECKSUM_KEY, load_checkpoint_file
from tests.e2e.test_faults import pid_alive
from tests.helpers import run_cli, train_summary


def _accuracy_of(state_dict: dict) -> float:
    """Val accuracy of the default MLP loaded with ``state_dict`` (computed here)."""
    from easgd_lightning.data.digits import load_digits_tensors
    from easgd_lightning.models import ClassifierModule, build_model

    module = ClassifierModule(build_model("mlp", in_features=64, num_classes=10))
    module.load_state_dict(state_dict)
    _, _, x_va, y_va = load_digits_tensors()
    with torch.no_grad():
        return float((module(x_va).argmax(-1) == y_va).float().mean())


@pytest.mark.slow
@pytest.mark.parametrize("strategy,devices", [("async_easgd", 4), ("hogwild_easgd", 3)])
def test_a_dead_worker_neither_hangs_the_server_nor_the_others(tmp_path: Path, strategy: str, devices: int) -> None:
    run = tmp_path / strategy
    proc = run_cli(
        [
            f"hydra.run.dir={run}", "logger=csv", "trainer.enable_progress_bar=false",
            f"strategy={strategy}", f"trainer.devices={devices}", "trainer.max_epochs=6",
            "faults.crash_rank=1", "faults.crash_at_step=8",
            "strategy.worker_timeout_s=3", "strategy.checkpoint_every_s=0.5", "timeout_s=200",
        ],
        check=False,
        timeout=400,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]  # the run is reported failed...
    s = json.loads((run / "summary.json").read_text())
    assert s["status"] == "failed" and s["failed_ranks"] == [1]
    # the summary names the rank that died and how (faults.crash_rank exits with code 17)
    assert s["first_failure"]["rank"] == 1 and s["first_failure"]["exitcode"] == 17, s["first_failure"]
    assert s["exit_codes"][1] == 17 and s["error"].startswith("rank 1 failed first: exit code 17")
    # and no process of the run is left
    pids = json.loads((run / "ranks" / "launch.json").read_text())["worker_pids"]
    assert [p for p in pids if pid_alive(p)] == []
    # ...but it finished with the remaining workers: they reported (the launcher did not have
    # to terminate them after timeout_s) and their center converged
    survivors = [r for r in range(devices) if r != 1]
    assert all(s["steps_per_rank"][r] is not None for r in survivors)
    workers = [r for r in survivors if s["roles"][r] == "worker"]
    assert len(workers) == 2
    assert max(s["steps_per_rank"][r] for r in workers) == 6 * 15  # a survivor did all its epochs
    assert min(s["steps_per_rank"][r] for r in workers) > 8  # and every survivor went on
    assert s["val_acc"] >= 0.85
    if strategy == "async_easgd":
        server = s["extras"][3]
        assert server["dead_workers"] == [1] and sorted(server["done_workers"]) == [0, 2]
    else:
        assert s["extras"][0]["dead_workers"] == [1]
    # the center checkpoint (written atomically, periodically, with its checksum) is intact,
    # holds tensors and plain data only, and its checksum verifies
    center_file = run / "checkpoints" / "center.ckpt"
    assert CHECKSUM_KEY in torch.load(center_file, weights_only=True)
    ckpt = load_checkpoint_file(center_file)
    assert ckpt["easgd"]["strategy"] == strategy
    assert _accuracy_of(ckpt["state_dict"]) >= 0.85
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    assert _accuracy_of(last["state_dict"]) > 0.5
    assert not list((run / "checkpoints").glob(".*.tmp"))  # no partial files left


@pytest.mark.slow
def test_resume_restores_center_and_server_state(tmp_path: Path) -> None:
    common = ["strategy=async_msgd", "trainer.devices=4", "strategy.stop_policy=all"]
    first = train_summary(tmp_path / "a", *common, "trainer.max_epochs=2")
    assert first["status"] == "ok"
    ckpt_path = tmp_path / "a" / "checkpoints" / "last.ckpt"
    ckpt = load_checkpoint_file(ckpt_path)  # weights_only=True, checksum verified
    # the server's own center file after a normal run: checksummed, no temporary file left
    center_file = load_checkpoint_file(ckpt_path.parent / "center.ckpt")
    assert CHECKSUM_KEY in center_file and center_file["easgd"]["strategy"] == "async_msgd"
    assert not list(ckpt_path.parent.glob(".*.tmp"))
    easgd = ckpt["easgd"]
    assert easgd["strategy"] == "async_msgd" and easgd["server_rank"] == 3
    momentum = easgd["server"]["momentum"]
    assert momentum is not None and momentum.abs().sum() > 0  # the server's state is in the file
    assert easgd["server"]["updates"] > 0
    # the module weights saved are the center
    n = 0
    for value in ckpt["state_dict"].values():
        torch.testing.assert_close(value.reshape(-1), easgd["center"][n : n + value.numel()])
        n += value.numel()

    second = train_summary(tmp_path / "b", *common, "trainer.max_epochs=3", f"checkpoint.resume={ckpt_path}")
    assert second["status"] == "ok"
    resumed = second["extras"][3]["resumed"]
    assert resumed["updates"] == easgd["server"]["updates"]
    assert resumed["center_sum"] == pytest.approx(float(easgd["center"].double().sum()), rel=1e-9, abs=1e-9)
    assert resumed["momentum_sum"] == pytest.approx(float(momentum.double().sum()), rel=1e-9, abs=1e-9)
    # the update counter and the step counters went on from the checkpoint
    assert second["extras"][3]["updates"] > easgd["server"]["updates"]
    assert second["steps_per_rank"][0] > easgd["steps"][0] >= 30
    # one more epoch of asynchronous momentum SGD may oscillate: only a sanity bound here
    assert second["val_acc"] >= 0.5
