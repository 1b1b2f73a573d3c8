"""Local SGD over real gloo processes (2 ranks), checked against references computed here.

``local_sgd_script.py`` runs once per rank as a subprocess (RANK / WORLD_SIZE / MASTER_* in
the environment) and trains every scripted case in turn, in float64; the tests compare
what the ranks recorded with plain-torch references.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from tests.distributed import local_sgd_script as S  # the constants of the scripted runs
from tests.helpers import launch_ranks

SCRIPT = Path(S.__file__)
WORLD = 2
MODES = ("constant", "overlap", "qsr_cosine", "qsr_step", "compressed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All scripted runs in one launch of 2 ranks (imports are paid once)."""
    out = tmp_path_factory.mktemp("local_sgd")
    launch_ranks(SCRIPT, WORLD, [",".join(MODES), str(out)], timeout=240)
    return out


def records(runs: Path, mode: str) -> list[dict]:
    return [torch.load(runs / mode / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_constant_period_averages_exactly(runs: Path) -> None:
    recs = records(runs, "constant")
    period, steps = 3, 10
    for rec in recs:
        assert rec["steps"] == steps
        assert len(rec["pre"]) == len(rec["post"]) == steps
        assert rec["periods"] == [period] * math.ceil(steps / period)
    # the strategy broadcast rank 0's initial weights
    assert torch.equal(recs[0]["init"], recs[1]["init"])
    assert torch.equal(recs[1]["init"], recs[0]["init_local"])
    assert not torch.equal(recs[1]["init_local"], recs[0]["init_local"])
    for t in range(steps):
        pre = [rec["pre"][t] for rec in recs]
        post = [rec["post"][t] for rec in recs]
        if (t + 1) % period == 0:
            mean = torch.stack(pre).mean(dim=0)
            for p in post:
                torch.testing.assert_close(p, mean, rtol=1e-13, atol=1e-13)
            assert torch.equal(post[0], post[1])
        else:
            for a, b in zip(pre, post):
                assert torch.equal(a, b)  # no communication inside a round
            assert not torch.allclose(post[0], post[1])
    # the last, partial round (step 10) is averaged at the end of fit
    final_mean = torch.stack([rec["pre"][-1] for rec in recs]).mean(dim=0)
    for rec in recs:
        torch.testing.assert_close(rec["final"], final_mean, rtol=1e-13, atol=1e-13)
    assert recs[0]["extras"]["rounds"] == 4


def _lr_cosine(step: int) -> float:
    if step < S.QSR_WARMUP:
        return S.QSR_LR * (step + 1) / S.QSR_WARMUP
    s = step - S.QSR_WARMUP
    return S.QSR_LR * 0.5 * (1 + math.cos(math.pi * s / (S.QSR_STEPS - S.QSR_WARMUP)))


def _lr_step(step: int) -> float:
    return S.QSR_LR * S.QSR_STEP_GAMMA ** (step // S.QSR_STEP_SIZE)


def _expected_periods(lr_at, warmup: int) -> list[tuple[int, int]]:
    """(start step, H) of every round under QSR, recomputed from the formula."""
    out, step = [], 0
    while step < S.QSR_STEPS:
        if step < warmup:
            h = S.QSR_H_BASE
        else:
            h = max(S.QSR_H_BASE, int(math.floor((S.QSR_GAMMA / lr_at(step)) ** 2)))
        h = min(h, S.QSR_STEPS - step)
        out.append((step, h))
        step += h
    return out


@pytest.mark.parametrize("schedule", ["cosine", "step"])
def test_qsr_periods_follow_the_rule(runs: Path, schedule: str) -> None:
    recs = records(runs, f"qsr_{schedule}")
    lr_at = _lr_cosine if schedule == "cosine" else _lr_step
    expected = _expected_periods(lr_at, S.QSR_WARMUP if schedule == "cosine" else 0)
    hs = [h for _, h in expected]
    assert len(set(hs)) >= 3, hs  # the schedule really changed the period
    for rec in recs:
        assert rec["periods"] == hs
        assert rec["steps"] == S.QSR_STEPS
    # what the logger got: one row per round, at the round's first step
    with open(runs / f"qsr_{schedule}" / "csv" / "metrics.csv") as f:
        logged = [
            (int(row["step"]), int(float(row["local_sgd/tau"])))
            for row in csv.DictReader(f)
            if row.get("local_sgd/tau")
        ]
    assert logged == expected
    # every round ends with identical parameters on both ranks
    ends = [s + h - 1 for s, h in expected]
    for t in ends:
        assert torch.equal(recs[0]["post"][t], recs[1]["post"][t])


def _cocod_reference(
    recs: list[dict], period: int, steps: int, lr: float, overlap: bool = True
) -> torch.Tensor:
    """CoCoD-SGD on the recorded data in plain torch: SGD on a linear least-squares model.

    ``overlap=False`` gives plain local SGD (blocking average at every boundary).
    """
    init = recs[0]["init"].clone()
    data = [rec["data"] for rec in recs]
    d = data[0][0].shape[1]

    def grad(theta: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        w, b = theta[:d], theta[d]
        r = (x @ w + b - y[:, 0]) * (2.0 / len(y))
        return torch.cat([x.T @ r, r.sum().reshape(1)])

    xs = [init.clone() for _ in recs]
    snaps: list[torch.Tensor] | None = None
    pending: torch.Tensor | None = None  # mean of the snapshots in flight
    since = 0
    for t in range(1, steps + 1):
        xs = [x - lr * grad(x, *dat) for x, dat in zip(xs, data)]
        since += 1
        if t % period == 0 and not overlap:
            mean = sum(xs) / len(xs)
            xs = [mean.clone() for _ in xs]
            since = 0
        elif t % period == 0:
            if pending is not None:
                xs = [pending + (x - s) for x, s in zip(xs, snaps)]
            snaps = [x.clone() for x in xs]
            pending = sum(snaps) / len(snaps)
            since = 0
    if pending is not None:
        xs = [pending + (x - s) for x, s in zip(xs, snaps)]
    if since:
        mean = sum(xs) / len(xs)
        xs = [mean.clone() for _ in xs]
    return xs[0]


def test_overlap_matches_cocod_reference(runs: Path) -> None:
    recs = records(runs, "overlap")
    ref = _cocod_reference(recs, period=3, steps=11, lr=0.05)
    for rec in recs:
        assert rec["steps"] == 11
        torch.testing.assert_close(rec["final"], ref, rtol=1e-12, atol=1e-12)
    # plain local SGD lands elsewhere: the comparison tells the two rules apart
    blocking = _cocod_reference(recs, period=3, steps=11, lr=0.05, overlap=False)
    assert (blocking - ref).abs().max() > 1e-4
    assert recs[0]["extras"]["cocod"] is True
    # first boundary (step 3): nothing merged yet, parameters stay local
    assert not torch.allclose(recs[0]["post"][2], recs[1]["post"][2])


def test_compressed_differences_keep_ranks_identical(runs: Path) -> None:
    recs = records(runs, "compressed")
    for rec in recs:
        assert rec["steps"] == 10 and rec["periods"] == [2] * 5
    for t in range(10):
        pre = [rec["pre"][t] for rec in recs]
        post = [rec["post"][t] for rec in recs]
        if t % 2 == 1:  # H = 2: rounds end at steps 2, 4, ...
            assert torch.equal(post[0], post[1])
            mean = torch.stack(pre).mean(dim=0)
            torch.testing.assert_close(post[0], mean, rtol=0, atol=5e-3)  # fp16 differences
            if t == 1:  # first round: no residual yet, the error is fp16 rounding alone
                assert not torch.equal(post[0], mean)
        else:
            assert torch.equal(pre[0], post[0]) and not torch.allclose(post[0], post[1])
    kind = recs[1]["comm"]["by_kind"]["model_averaging"]
    assert kind["bytes_sent"] * 4 == kind["dense_bytes"]  # float64 differences sent as fp16
