"""DiLoCo over real gloo processes (2 and 3 ranks, float64), against references written here.

``scripts/diloco_run.py`` trains every mode in one launch per world size; the tests rebuild
the same workers in this process and replay the rules of ALGORITHMS.md section 8 as plain
loops (torch.optim.SGD as the outer optimizer, one per fragment), then compare theta after
every step. The pairs check the two reductions the issue names: ``outer_lr=1,
outer_momentum=0`` is ``local_sgd`` and ``outer=elastic`` is ``sync_easgd``, bit for bit.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.distributed.local_sgd_script import rank_data
from tests.distributed.scripts import diloco_run as S
from tests.helpers import launch_ranks

SCRIPT = Path(S.__file__)
RULE_MODES = ("nesterov", "streaming", "adamw", "elastic_stream", "topk_stream")
PAIR_MODES = ("pair_local_sgd", "pair_local_sgd_fp16", "pair_sync_easgd")
#: the Regression module's tensors (Linear(5, 8), Linear(8, 3)) and their sizes
NUMELS = [40, 8, 24, 3]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """World 2: every mode; world 3: the pairs and the streaming rule (imports paid once each)."""
    out = {}
    for world, modes in ((2, RULE_MODES + PAIR_MODES), (3, ("streaming", *PAIR_MODES))):
        out[world] = tmp_path_factory.mktemp(f"diloco{world}")
        launch_ranks(SCRIPT, world, [",".join(modes), str(out[world])], timeout=400)
    return out


def records(root: Path, mode: str, world: int) -> list[dict]:
    return [torch.load(root / mode / f"rank{r}.pt", weights_only=False) for r in range(world)]


# ---------------------------------------------------------------------- the reference
def _workers(init: torch.Tensor, world: int, optimizer: str, lr: float):
    models, opts = [], []
    for _ in range(world):
        m = S.Module(optimizer, lr).double()
        torch.nn.utils.vector_to_parameters(init.clone(), m.parameters())
        models.append(m)
        opts.append(m.configure_optimizers())
    return models, opts


def _inner_step(model, opt, rank: int, t: int, before_update=None) -> None:
    x, y = rank_data(rank, S.N, 5, 3)
    sl = slice((t - 1) * S.BATCH, t * S.BATCH)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model.net(x[sl]), y[sl]).backward()
    if before_update is not None:
        before_update()
    opt.step()


def _fragments(count: int) -> list[list[int]]:
    """Tensor indices of each fragment: 1 -> all; 2 -> the first weight, then the rest
    (sizes 40 and 35, the nearest cut to half of 75)."""
    return [[0, 1, 2, 3]] if count == 1 else [[0], [1, 2, 3]]


def _topk_with_residual(u: torch.Tensor, residual: torch.Tensor, ratio: float) -> torch.Tensor:
    """Exact top-k of p = u + e (k = ceil(ratio * n)); the rest becomes the residual."""
    p = u + residual
    k = math.ceil(ratio * p.numel())
    keep = torch.zeros_like(p).reshape(-1)
    idx = torch.topk(p.reshape(-1).abs(), k).indices
    keep[idx] = p.reshape(-1)[idx]
    keep = keep.view_as(p)
    residual.copy_(p - keep)
    return keep


def reference_diloco(init, world, options, optimizer, lr, steps, topk=None):
    """DiLoCo / Streaming DiLoCo written as a loop: theta after every step, and at the end.
    ``topk``: the ratio of an exact top-k of each tensor's u_i = theta_i - theta, with
    error feedback (one residual per rank and tensor)."""
    tau, count = options["tau"], options.get("fragments", 1)
    delay, a = options.get("fragment_sync_delay", 0), options.get("fragment_update_alpha", 0.0)
    models, opts = _workers(init, world, optimizer, lr)
    params = [list(m.parameters()) for m in models]
    theta = [p.detach().clone() for p in params[0]]
    frags = _fragments(count)
    outer = [
        torch.optim.SGD(
            [theta[j] for j in frag], lr=options.get("outer_lr", 0.7), momentum=options.get("outer_momentum", 0.9),
            nesterov=options.get("outer_nesterov", True) and options.get("outer_momentum", 0.9) > 0,
        )
        for frag in frags
    ]
    slot, pending, synced, history = tau // count, {}, [0] * count, []

    residuals = [[torch.zeros_like(t) for t in theta] for _ in range(world)]

    def delta(f):  # mean_i (theta - x_i) per tensor of fragment f
        if topk is None:
            return {j: sum(theta[j] - params[i][j].detach() for i in range(world)) / world for j in frags[f]}
        sent = {j: sum(_topk_with_residual(params[i][j].detach() - theta[j], residuals[i][j], topk)
                       for i in range(world)) for j in frags[f]}
        return {j: -(sent[j] / world) for j in frags[f]}

    def sync(f, d, t):
        with torch.no_grad():
            for j in frags[f]:
                theta[j].grad = d[j]
            outer[f].step()
            for i in range(world):
                for j in frags[f]:
                    params[i][j].copy_(torch.lerp(theta[j], params[i][j], a))
        synced[f] = t

    for t in range(1, steps + 1):
        for i in range(world):
            _inner_step(models[i], opts[i], i, t)
        if (t + delay) % slot == 0:  # the k-th sync is at (k + 1) * slot, of fragment k % F
            pending[(t + delay) // slot - 1] = delta(((t + delay) // slot - 1) % count)
        if t % slot == 0:
            k = t // slot - 1
            sync(k % count, pending.pop(k), t)
        history.append(torch.cat([p.reshape(-1) for p in theta]))
    for k in sorted(pending):  # end of fit: what is in flight, then every unsynced fragment
        sync(k % count, pending.pop(k), steps)
    for f in range(count):
        if synced[f] < steps:
            sync(f, delta(f), steps)
    return history, torch.cat([p.reshape(-1) for p in theta])


def reference_elastic(init, world, options, optimizer, lr, steps):
    """The elastic outer rule per fragment: d_i = alpha (x_i - c) at the gradient's point,
    x_i <- step(x_i) - d_i, c <- c + sum_i d_i."""
    tau, count, alpha = options["tau"], options.get("fragments", 1), options["alpha"]
    models, opts = _workers(init, world, optimizer, lr)
    params = [list(m.parameters()) for m in models]
    center = [p.detach().clone() for p in params[0]]
    frags, slot, history = _fragments(count), tau // count, []
    for t in range(1, steps + 1):
        f = (t // slot - 1) % count if t % slot == 0 else None
        diffs = [None] * world
        for i in range(world):
            def form(i=i, f=f, diffs=diffs):  # called at once, inside this iteration
                if f is not None:
                    diffs[i] = {j: alpha * (params[i][j].detach() - center[j]) for j in frags[f]}
            _inner_step(models[i], opts[i], i, t, form)
        if f is not None:
            with torch.no_grad():
                for i in range(world):
                    for j in frags[f]:
                        params[i][j].sub_(diffs[i][j])
                for j in frags[f]:
                    center[j].add_(sum(diffs[i][j] for i in range(world)))
        history.append(torch.cat([p.reshape(-1) for p in center]))
    return history, history[-1]


# ---------------------------------------------------------------------- the rules
@pytest.mark.parametrize(
    "mode,world",
    [("nesterov", 2), ("streaming", 2), ("streaming", 3), ("adamw", 2), ("elastic_stream", 2), ("topk_stream", 2)],
)
def test_theta_follows_the_rule(runs: dict[int, Path], mode: str, world: int) -> None:
    recs = records(runs[world], mode, world)
    options, optimizer, lr, steps = S.MODES[mode]
    init = recs[0]["diloco"]["init"]
    for rec in recs:  # the strategy broadcast rank 0's weights (the script seeds each rank apart)
        assert torch.equal(rec["diloco"]["init"], init)
        assert rec["diloco"]["steps"] == steps
    if options.get("outer") == "elastic":
        history, final = reference_elastic(init, world, options, optimizer, lr, steps)
    else:
        topk = 0.3 if mode == "topk_stream" else None
        history, final = reference_diloco(init, world, options, optimizer, lr, steps, topk=topk)
    for rec in recs:
        got = rec["diloco"]
        assert len(got["thetas"]) == steps
        for t in range(steps):
            torch.testing.assert_close(got["thetas"][t], history[t], rtol=0, atol=1e-12, msg=f"step {t + 1}")
        torch.testing.assert_close(got["final"], final, rtol=0, atol=1e-12)
    assert torch.equal(recs[0]["diloco"]["final"], recs[-1]["diloco"]["final"])
    # not vacuous: theta moved, and the outer rule is not plain averaging (momentum shows)
    assert (final - init).abs().max() > 0.05
    extras = recs[0]["diloco"]["extras"]
    assert extras["fragment_numels"] == ([75] if options.get("fragments", 1) == 1 else [40, 35])


def test_streaming_sends_one_fragment_per_exchange(runs: dict[int, Path]) -> None:
    """F = 2: each exchange carries one fragment, so the largest exchange is the larger
    fragment (40 of 75 tensors' elements), and both fragments were synchronised in turn."""
    rec = records(runs[2], "streaming", 2)[0]["diloco"]
    assert rec["extras"]["peak_exchange_dense_bytes"] == 40 * 8
    # 13 steps, one fragment every 2: f0 at 2,6,10 (+ the one in flight at 13), f1 at 4,8,12 (+ end)
    assert rec["extras"]["outer_syncs"] == [4, 4]
    kind = rec["comm"]["by_kind"]["pseudo_gradient"]
    assert kind["dense_bytes"] == (4 * 40 + 4 * 35) * 8  # float64, one rank's sends
    assert kind["calls"] == 8


def test_nesterov_differs_from_averaging(runs: dict[int, Path]) -> None:
    """The outer optimizer matters: the nesterov run's theta is not the workers' mean."""
    recs = records(runs[2], "nesterov", 2)
    init = recs[0]["diloco"]["init"]
    history, _ = reference_diloco(init, 2, {"tau": 4, "outer_lr": 1.0, "outer_momentum": 0.0}, "sgd", 0.05, 12)
    assert (recs[0]["diloco"]["thetas"][7] - history[7]).abs().max() > 1e-3


# ---------------------------------------------------------------------- the reductions
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", PAIR_MODES)
def test_reduces_bitwise(runs: dict[int, Path], mode: str, world: int) -> None:
    """outer_lr=1, outer_momentum=0 (and outer=average, with fp16 pseudo-gradients) is
    local_sgd; outer=elastic with one fragment is sync_easgd: the same bits, every step."""
    _, _, _, steps = S.MODES[mode]
    for rec in records(runs[world], mode, world):
        mine, other = rec["diloco"], rec["other"]
        assert mine["steps"] == other["steps"] == steps
        assert torch.equal(mine["init"], other["init"])
        assert torch.equal(mine["final"], other["final"])
        for t in range(steps):
            assert torch.equal(mine["thetas"][t], other["thetas"][t]), f"step {t + 1}"
        assert (mine["final"] - mine["init"]).abs().max() > 0.05  # they trained
        if mode == "pair_local_sgd_fp16":  # the pseudo-gradients travelled in fp16
            kind = mine["comm"]["by_kind"]["pseudo_gradient"]
            assert kind["bytes_sent"] * 4 == kind["dense_bytes"]


# ---------------------------------------------------------------------- the outside oracle
@pytest.mark.parametrize("mode", ["nesterov", "streaming"])
def test_theta_matches_torchfts_diloco(runs: dict[int, Path], tmp_path: Path, mode: str) -> None:
    """torchft's DiLoCo (a real lighthouse, a Manager per replica over gloo) on the same
    workers gives the same theta after every step of the whole rounds, to 1e-12 (float64;
    the sums are taken in another order). Streaming: two fragments, delay 1, alpha 0.5."""
    pytest.importorskip("torchft", reason="torchft is installed by `make venv` (extra ft)")
    import subprocess
    import sys

    from torchft._torchft import LighthouseServer

    from tests.helpers import base_env, communicate_all

    mine = records(runs[2], mode, 2)
    init = tmp_path / "init.pt"
    torch.save(mine[0]["diloco"]["init"], init)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=10000)
    script = SCRIPT.parent / "diloco_torchft_run.py"
    try:
        procs = [
            subprocess.Popen([sys.executable, str(script), lighthouse.address(), str(i), mode, str(init),
                              str(tmp_path / f"tft{i}.pt")], env=base_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
            for i in range(2)
        ]
        for r in communicate_all(procs, 180):
            assert r.returncode == 0, r.stderr[-4000:]
    finally:
        lighthouse.shutdown()
    tau = S.MODES[mode][0]["tau"]
    steps = (S.MODES[mode][3] // tau) * tau
    for i in range(2):
        oracle = torch.load(tmp_path / f"tft{i}.pt")
        assert oracle["participants"] == 2 and len(oracle["thetas"]) == steps
        for t in range(steps):
            torch.testing.assert_close(mine[i]["diloco"]["thetas"][t], oracle["thetas"][t], rtol=0, atol=1e-12,
                                       msg=f"replica {i}, step {t + 1}")
    assert (oracle["thetas"][-1] - mine[0]["diloco"]["init"]).abs().max() > 0.05  # theta moved
