"""``logger=tensorboard|csv``: the run's metrics, the communication series among them
(bytes sent, exposed communication, per traffic kind), land where the README says."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.helpers import run_cli

COMMON = ["strategy=sync_easgd", "trainer.max_epochs=2", "trainer.log_every_n_steps=5",
          "trainer.enable_progress_bar=false", "checkpoint.enabled=false"]


@pytest.mark.slow
def test_tensorboard_and_csv_get_the_comm_series(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_cli([f"hydra.run.dir={tmp_path / 'tb'}", "logger=tensorboard", *COMMON], timeout=240)
    events = tmp_path / "tb" / "tensorboard"
    assert list(events.glob("events.out.tfevents.*")), list((tmp_path / "tb").rglob("*"))
    acc = EventAccumulator(str(events))  # every event file of the directory (fit, final validation)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("comm/bytes_sent", "comm/exposed_fraction", "comm/elastic/bytes_sent", "val/acc", "train/loss"):
        assert tag in tags, sorted(tags)
    sent = [e.value for e in acc.Scalars("comm/bytes_sent")]
    assert len(sent) >= 4 and sent == sorted(sent) and sent[-1] > sent[0] > 0  # running totals

    run_cli([f"hydra.run.dir={tmp_path / 'csv'}", "logger=csv", *COMMON], timeout=240)
    rows = list(csv.DictReader((tmp_path / "csv" / "csv" / "metrics.csv").open()))
    kinds = [float(r["comm/elastic/bytes_sent"]) for r in rows if r.get("comm/elastic/bytes_sent")]
    assert len(kinds) >= 4 and kinds[-1] > kinds[0] > 0
