"""Compressed pushes to the parameter server, one-way and two-way (Zhong et al. 2021), over
real gloo processes (2 workers + 1 server, no Lightning).

The server's service order is replayed here with an independent implementation of the rule
(top-k / scaled sign written with plain torch, a fresh ``torch.optim.Adam``), and error
feedback is checked to lose nothing in either direction: sum_t c_t + e_i = sum_t g_t on each
worker, and sum_t d_t + f_i = w_final - w_start per worker at the server (f_i: the second
residual, which the server keeps per worker).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.distributed.scripts import async_ps_compressed_run as run
from tests.helpers import launch_ranks

SCRIPT = Path(__file__).parent / "scripts" / "async_ps_compressed_run.py"
MODES = ("twoway_topk", "twoway_signsgd", "oneway_topk")



@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("async_compressed")
    launch_ranks(SCRIPT, 3, [",".join(MODES), str(out)], timeout=240)
    return out


def _load(out: Path, mode: str) -> dict[int, dict]:
    return {r: torch.load(out / mode / f"rank{r}.pt", weights_only=False) for r in (0, 1, 2)}


def reference_compress(mode: str, p: torch.Tensor) -> torch.Tensor:
    """C(p) per parameter tensor: exact top-10% by magnitude, or mean|p| * sign(p) (>= 0: +);
    tensors below min_numel unchanged."""
    out, start = torch.empty_like(p), 0
    for n in run.SIZES:
        seg = p[start : start + n]
        if n < run.MIN_NUMEL:
            c = seg.clone()
        elif mode.endswith("topk"):
            k = math.ceil(0.1 * n)
            idx = seg.abs().topk(k).indices
            c = torch.zeros_like(seg)
            c[idx] = seg[idx]
        else:
            c = torch.where(seg >= 0, 1.0, -1.0) * seg.abs().mean()
        out[start : start + n] = c
        start += n
    return out


def replay(mode: str, recs: dict) -> dict:
    """The rule in one process, in the server's order: worker residuals e_i, Adam at the
    server on the decoded pushes, replicas r_i and d = C(w - r_i) for two-way."""
    n = run.N_PARAMS
    w0 = run.start()
    params, offset = [], 0
    for shape, size in zip(run.SHAPES, run.SIZES):
        params.append(w0[offset : offset + size].clone().view(shape))
        offset += size
    adam = torch.optim.Adam(params, lr=run.LR)
    buffer = w0[n:].clone()
    e = {r: torch.zeros(n) for r in run.WORKERS}
    r_i = {r: w0.clone() for r in run.WORKERS}
    sent_up = {r: torch.zeros(n) for r in run.WORKERS}
    k = {r: 0 for r in run.WORKERS}
    for sender in recs[run.SERVER]["order"]:
        g = recs[sender]["sent"][k[sender]]
        p = g[:n] + e[sender]
        c = reference_compress(mode, p)
        e[sender] = p - c
        sent_up[sender] += c
        offset = 0
        for prm, size in zip(params, run.SIZES):
            prm.grad = c[offset : offset + size].view(prm.shape).clone()
            offset += size
        adam.step()
        buffer = g[n:].clone()
        w = torch.cat([prm.detach().reshape(-1) for prm in params] + [buffer])
        if mode.startswith("twoway"):
            d = reference_compress(mode, w[:n] - r_i[sender][:n])
            r_i[sender] = torch.cat([r_i[sender][:n] + d, buffer])
            expect = r_i[sender]
        else:
            expect = w
        torch.testing.assert_close(recs[sender]["got"][k[sender]], expect, rtol=1e-5, atol=1e-6)
        k[sender] += 1
    assert k == {0: run.PUSHES, 1: run.PUSHES}
    return {"center": w, "e": e, "r": r_i, "sent_up": sent_up}


@pytest.mark.parametrize("mode", MODES)
def test_compressed_pushes_match_a_single_process_replay(runs: Path, mode: str) -> None:
    recs = _load(runs, mode)
    server = recs[run.SERVER]
    assert server["updates"] == 2 * run.PUSHES
    ref = replay(mode, recs)
    torch.testing.assert_close(server["center"], ref["center"], rtol=1e-5, atol=1e-6)
    n = run.N_PARAMS
    for r in run.WORKERS:
        torch.testing.assert_close(recs[r]["residual"], ref["e"][r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(recs[r]["final"], server["center"])  # the end of fit: dense center
        # direction 1 (worker -> server): sum_t c_t + e_i = sum_t g_t
        total_g = sum(g[:n] for g in recs[r]["sent"])
        torch.testing.assert_close(ref["sent_up"][r] + recs[r]["residual"], total_g, rtol=1e-5, atol=1e-5)
        # the pushes really were compressed: well under the dense 4 bytes per entry
        dense = 4 * run.N
        limit = 0.35 if mode.endswith("topk") else 0.2  # top-10%: (4 + 4) bytes per kept entry
        assert all(b < limit * dense for b in recs[r]["bytes"]), (recs[r]["bytes"], dense)
    server_state = server["state"]["optimizer"]["state"]
    assert int(server_state[0]["step"]) == 2 * run.PUSHES  # one Adam step per push, at the server


@pytest.mark.parametrize("mode", ["twoway_topk", "twoway_signsgd"])
def test_two_way_replies_lose_nothing(runs: Path, mode: str) -> None:
    """Direction 2 (server -> worker), from what actually travelled: the worker's weight
    changes d_t plus the residual the server still holds for it add up to the center's
    whole move; and each d_t is compressed (top-k: at most k entries per tensor)."""
    recs = _load(runs, mode)
    server = recs[run.SERVER]
    n = run.N_PARAMS
    w0 = run.start()
    moved = server["center"][:n] - w0[:n]
    for r in run.WORKERS:
        got = [w0] + recs[r]["got"]
        ds = [b[:n] - a[:n] for a, b in zip(got, got[1:])]
        f = server["residuals"][r]
        torch.testing.assert_close(sum(ds) + f, moved, rtol=1e-5, atol=1e-5)
        assert float(f.abs().max()) > 0  # something is still owed: the replies were lossy
        if mode.endswith("topk"):
            for d in ds:
                start = 0
                for size in run.SIZES:
                    seg = d[start : start + size]
                    if size >= run.MIN_NUMEL:
                        assert int((seg != 0).sum()) <= math.ceil(0.1 * size)
                    start += size
        else:  # scaled signs: one magnitude per tensor (up to the rounding of w + d - w)
            for d in ds:
                a = d[:128].abs()
                assert float((a - a.mean()).abs().max()) <= 1e-5 * max(1.0, float(a.mean()))


def test_refusals_name_the_key() -> None:
    from easgd_lightning.hooks import build_compressor
    from easgd_lightning.strategies.ps.async_easgd import AsyncEASGDStrategy, AsyncSGDStrategy

    AsyncEASGDStrategy(compression=build_compressor("topk"))  # compressed elastic differences (issue 31)
    with pytest.raises(ValueError, match=r"^compression\.name: async_sgd compresses its pushes with one of"):
        AsyncSGDStrategy(compression=build_compressor("powersgd"))
    AsyncSGDStrategy(compression=build_compressor("topk", two_way=True))  # accepted
