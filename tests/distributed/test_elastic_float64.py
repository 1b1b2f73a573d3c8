"""Real 2-process EASGD runs in float64 against a plain-Python reference of the update rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import launch_ranks

SCRIPT = Path(__file__).parent / "scripts" / "elastic_float64_run.py"
LR, BATCH = 0.05, 8


def _grad(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor):
    """Gradient of mean((x w + b - y)^2) written out by hand."""
    r = x @ w + b - y.squeeze(1)
    n = x.shape[0]
    return 2.0 / n * (x.T @ r), 2.0 / n * r.sum()


def reference(datas, init, steps, tau, alpha, round_robin):
    """The EASGD rule of ALGORITHMS.md section 1 as a loop over workers."""
    p = len(datas)
    w0, b0 = init["lin.weight"].reshape(-1).clone(), init["lin.bias"].reshape(()).clone()
    xs = [(w0.clone(), b0.clone()) for _ in range(p)]
    c = (w0.clone(), b0.clone())
    for t in range(1, steps + 1):
        grads = []
        for i, (x, y) in enumerate(datas):
            sl = slice((t - 1) * BATCH, t * BATCH)
            grads.append(_grad(xs[i][0], xs[i][1], x[sl], y[sl]))
        if t % tau:
            xs = [(w - LR * gw, b - LR * gb) for (w, b), (gw, gb) in zip(xs, grads)]
            continue
        if round_robin:  # master serves ranks in order, c moves after each one
            diffs = []
            for i in range(p):
                d = (alpha * (xs[i][0] - c[0]), alpha * (xs[i][1] - c[1]))
                c = (c[0] + d[0], c[1] + d[1])
                diffs.append(d)
        else:  # simultaneous: all differences against the same c
            diffs = [(alpha * (w - c[0]), alpha * (b - c[1])) for w, b in xs]
            c = (c[0] + sum(d[0] for d in diffs), c[1] + sum(d[1] for d in diffs))
        xs = [(w - LR * gw - dw, b - LR * gb - db) for (w, b), (gw, gb), (dw, db) in zip(xs, grads, diffs)]
    return c


# sync_easgd's center against the reference: in test_sync_easgd_overlap_is_bitwise_exact
# (world 2 tau 1, world 3 tau 4, both overlap settings), which launches those runs anyway
@pytest.mark.parametrize("strategy,tau,alpha", [("easgd_round_robin", 2, 0.3)])
def test_center_matches_reference(tmp_path: Path, strategy: str, tau: int, alpha: float) -> None:
    steps, world = 12, 2
    launch_ranks(SCRIPT, world, [str(tmp_path), strategy, str(tau), str(alpha), str(steps)])
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert all(r["dtype"] == "torch.float64" for r in ranks)
    assert [r["steps"] for r in ranks] == [steps] * world
    c_w, c_b = reference([(r["x"], r["y"]) for r in ranks], ranks[0]["init"], steps, tau, alpha, strategy != "sync_easgd")
    for r in ranks:  # every rank's module holds the center after fit
        torch.testing.assert_close(r["final"]["lin.weight"].reshape(-1), c_w, rtol=0, atol=1e-12)
        torch.testing.assert_close(r["final"]["lin.bias"].reshape(()), c_b, rtol=0, atol=1e-12)
    # and the center moved away from the initial point (the test is not vacuous)
    assert (c_w - ranks[0]["init"]["lin.weight"].reshape(-1)).abs().max() > 0.1


def _overlap_pair(tmp_path: Path, world: int, tau: int, compression: str) -> list[dict]:
    steps = 12
    launch_ranks(
        SCRIPT, world, [str(tmp_path), "sync_easgd", str(tau), "0.3", str(steps), "overlap-pair", compression]
    )
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize(  # each world size, tau and compression twice, each pair of them once
    "world,tau,compression", [(2, 1, "none"), (2, 4, "topk"), (3, 4, "none"), (3, 1, "topk")]
)
def test_sync_easgd_overlap_is_bitwise_exact(tmp_path: Path, world: int, tau: int, compression: str) -> None:
    """overlap=true (exchange behind the next exchange step's forward/backward) gives the
    same bits as overlap=false: every rank's center and every step's train loss. (Two fits
    in the same processes ending on the same bits also show the runs are deterministic.)"""
    ranks = _overlap_pair(tmp_path, world, tau, compression)
    if compression == "none":  # the EASGD rule itself, written out above (ALGORITHMS.md section 1)
        c_w, c_b = reference([(r["x"], r["y"]) for r in ranks], ranks[0]["init"], 12, tau, 0.3, False)
        assert (c_w - ranks[0]["init"]["lin.weight"].reshape(-1)).abs().max() > 0.1  # it moved
        for r in ranks:
            for run in (r[False], r[True]):
                torch.testing.assert_close(run["final"]["lin.weight"].reshape(-1), c_w, rtol=0, atol=1e-12)
                torch.testing.assert_close(run["final"]["lin.bias"].reshape(()), c_b, rtol=0, atol=1e-12)
    for r in ranks:
        blocking, overlapped = r[False], r[True]
        assert blocking["steps"] == overlapped["steps"] == 12
        for key in blocking["final"]:
            assert torch.equal(blocking["final"][key], overlapped["final"][key]), key
        assert torch.equal(blocking["losses"], overlapped["losses"])
        assert blocking["losses"].numel() == 12
        # the overlap happened: every exchange but the last was finished at the next one
        assert blocking["overlapped"] == 0
        assert overlapped["overlapped"] == 12 // tau - 1
        assert blocking["resident"] and overlapped["resident"]  # parameters are buffer views
    # every rank ends on the same center, and it moved (the comparison is not vacuous)
    for key in ranks[0][True]["final"]:
        assert all(torch.equal(ranks[0][True]["final"][key], r[True]["final"][key]) for r in ranks)
    assert (ranks[0][True]["losses"][0] - ranks[0][True]["losses"][-1]).abs() > 0.1
