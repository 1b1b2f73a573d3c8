"""CommMeter accounting and crash-safe writes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from easgd_lightning.cli.summary import build_summary
from easgd_lightning.comm.meter import CommMeter
from easgd_lightning.utils.atomic import atomic_torch_save, atomic_write_json


def test_meter_totals_and_kinds() -> None:
    m = CommMeter()
    m.record("elastic", sent=100, recv=100, seconds=0.5)
    m.record("data_parallel", sent=10, recv=30, dense=400, seconds=0.25)
    m.add_time("elastic", 0.25)
    snap = m.snapshot()
    assert snap["bytes_sent"] == 110 and snap["bytes_recv"] == 130
    assert snap["dense_bytes"] == 500  # dense defaults to the bytes sent
    assert snap["time_s"] == pytest.approx(1.0)
    assert snap["by_kind"]["data_parallel"]["dense_bytes"] == 400
    assert snap["by_kind"]["elastic"]["calls"] == 1
    # blocking records and add_time are exposed in full
    assert snap["exposed_s"] == pytest.approx(1.0)
    assert snap["by_kind"]["elastic"]["exposed_s"] == pytest.approx(0.75)
    m.reset()
    assert m.snapshot()["bytes_sent"] == 0


def test_meter_async_exposed_is_the_wait_only() -> None:
    m = CommMeter()
    m.record("elastic", sent=8, recv=8, seconds=0.4, exposed=0.0)  # an async call completed
    m.add_exposed("elastic", 0.05)  # the loop waited 50 ms on its handle
    m.add_time("parameter_server", 0.3, exposed=0.1)
    snap = m.snapshot()
    assert snap["by_kind"]["elastic"]["time_s"] == pytest.approx(0.4)
    assert snap["by_kind"]["elastic"]["exposed_s"] == pytest.approx(0.05)
    assert snap["time_s"] == pytest.approx(0.7) and snap["exposed_s"] == pytest.approx(0.15)
    assert snap["by_kind"]["elastic"]["calls"] == 1  # add_exposed is not a call


def test_summary_exposed_fields() -> None:
    def report(wall, time_s, exposed_s):
        comm = {"bytes_sent": 1, "bytes_recv": 1, "dense_bytes": 1, "time_s": time_s, "exposed_s": exposed_s,
                "by_kind": {"elastic": {"bytes_sent": 1, "bytes_recv": 1, "dense_bytes": 1,
                                        "time_s": time_s, "exposed_s": exposed_s, "calls": 1}}}
        return {"status": "ok", "wall_time_s": wall, "steps": 1, "comm": comm}

    s = build_summary({}, [report(10.0, 6.0, 1.0), report(5.0, 4.0, 2.0)])
    comm = s["comm"]
    assert comm["exposed_time_s"] == [1.0, 2.0]
    assert comm["exposed_fraction"] == pytest.approx((0.1 + 0.4) / 2)
    assert comm["time_fraction"] == pytest.approx((0.6 + 0.8) / 2)  # unchanged meaning
    assert comm["by_kind"]["elastic"]["exposed_s"] == pytest.approx(3.0)


def test_atomic_write_keeps_old_file_when_writer_fails(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    atomic_write_json(path, {"v": 1})

    class Boom:
        def __reduce__(self):
            raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_torch_save({"payload": torch.zeros(1000), "boom": Boom()}, path)
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temp file left


def test_atomic_torch_save_roundtrip(tmp_path: Path) -> None:
    path = tmp_path / "x.ckpt"
    atomic_torch_save({"w": torch.arange(5)}, path)
    assert torch.equal(torch.load(path)["w"], torch.arange(5))
    assert oct(os.stat(path).st_mode)[-3:] == oct(0o666 & ~_umask())[-3:]


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old
