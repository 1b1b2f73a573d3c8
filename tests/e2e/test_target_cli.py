"""A user's own strategy class through the real CLI: ``strategy._target_`` names a subclass
(defined in tests/unit/cli/test_targets.py) in a config directory of one's own
(``hydra.searchpath``), with an argument of its own; two ranks train on digits and the
summary shows that this class ran, with the user's value."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import train_summary


def test_a_users_strategy_subclass_runs_through_the_cli(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    (conf / "strategy").mkdir(parents=True)
    (conf / "strategy" / "noted.yaml").write_text(
        "defaults:\n  - sync_easgd\n  - _self_\n"
        "_target_: tests.unit.cli.test_targets.NotedSyncEASGD\n"
        "note: lab-7\n"
    )
    summary = train_summary(
        tmp_path / "run", f"hydra.searchpath=[file://{conf}]", "strategy=noted", "strategy.tau=2",
        "trainer.devices=2", "trainer.max_epochs=1", "trainer.max_steps=4", "trainer.limit_val_batches=2",
        "checkpoint.enabled=false",
    )
    assert summary["strategy"] == "sync_easgd" and summary["world_size"] == 2  # the name stays
    extras = summary["extras"]
    assert [e.get("note") for e in extras] == ["lab-7", "lab-7"]  # the subclass ran, on both ranks
    assert summary["config"]["strategy"]["_target_"] == "tests.unit.cli.test_targets.NotedSyncEASGD"
    assert summary["steps_per_rank"] == [4, 4]
