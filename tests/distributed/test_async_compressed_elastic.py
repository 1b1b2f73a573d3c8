"""Compressed elastic differences for ``async_easgd`` / ``async_measgd`` (issue 31 section 8),
over real gloo processes (2 workers + 1 server, no Lightning), in float64.

The server's service order is replayed in one process with an independent implementation:
per worker the server's estimate x~_i of its variable (the start center at first); the push
is C(x_i - x~_i) (exact top-10% or scaled signs written with plain torch), added to x~_i;
the server applies the EASGD rule to x~_i and replies with the dense d, which both x_i and
x~_i lose. Error feedback loses nothing: x~_i + e_i = x_i after every push, e_i = the part
of x_i - x~_i the push left out.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.scripts import async_ps_compressed_run as run
from tests.distributed.test_async_compressed import reference_compress
from tests.helpers import launch_ranks

SCRIPT = Path(__file__).parent / "scripts" / "async_ps_compressed_run.py"
MODES = ("elastic_topk", "elastic_signsgd")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("async_compressed_elastic")
    launch_ranks(SCRIPT, 3, [",".join(MODES), str(out)], timeout=240)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_compressed_elastic_exchanges_match_a_float64_replay(runs: Path, mode: str) -> None:
    recs = {r: torch.load(runs / mode / f"rank{r}.pt", weights_only=False) for r in (0, 1, 2)}
    server = recs[run.SERVER]
    n, alpha = run.N_PARAMS, run.ALPHA
    assert server["updates"] == 2 * run.PUSHES
    # top-k keeps float64 values exactly; the scaled sign's magnitude is computed in float32
    tol = {"rtol": 1e-12, "atol": 1e-12} if mode.endswith("topk") else {"rtol": 1e-6, "atol": 1e-7}
    c = run.start().double()
    est = {w: c.clone() for w in run.WORKERS}
    k = {w: 0 for w in run.WORKERS}
    for sender in server["order"]:
        x = recs[sender]["sent"][k[sender]]
        q = x[:n] - est[sender][:n]
        cq = reference_compress(mode, q)
        est[sender] = torch.cat([est[sender][:n] + cq, x[n:]])
        e = q - cq
        # error feedback: the server's picture plus what is still owed is exactly x
        torch.testing.assert_close(recs[sender]["residuals"][k[sender]], e, **tol)
        torch.testing.assert_close(est[sender][:n] + e, x[:n], rtol=1e-12, atol=1e-12)
        d = alpha * (est[sender] - c)
        c = c + d
        est[sender] = est[sender] - d
        torch.testing.assert_close(recs[sender]["got"][k[sender]], d, **tol)
        k[sender] += 1
    assert k == {0: run.PUSHES, 1: run.PUSHES}
    torch.testing.assert_close(server["center"], c, **tol)
    for w in run.WORKERS:
        rec = recs[w]
        # worker and server hold the same estimate, bitwise (the same operations on the same values)
        assert torch.equal(rec["estimate"], server["estimates"][w])
        torch.testing.assert_close(rec["estimate"], est[w], **tol)
        torch.testing.assert_close(rec["final"], server["center"])
        # compressed up, dense down: 8-byte entries; top-10% keeps (8 + 8) bytes per entry
        dense = 8 * run.N
        limit = 0.35 if mode.endswith("topk") else 0.2
        assert all(b < limit * dense for b in rec["bytes"]), (rec["bytes"], dense)
        assert rec["traffic"]["pushes"] == run.PUSHES
        assert rec["traffic"]["bytes_down"] == run.PUSHES * dense
    assert all(float(recs[w]["residuals"][-1].abs().max()) > 0 for w in run.WORKERS)  # lossy pushes


def test_refusals_say_what_is_compressed() -> None:
    from easgd_lightning.hooks import build_compressor
    from easgd_lightning.strategies.ps.async_easgd import AsyncEASGDStrategy, AsyncMEASGDStrategy
    from easgd_lightning.strategies.ps.hogwild import HogwildEASGDStrategy, HogwildSGDStrategy
    from easgd_lightning.strategies.round_robin import RoundRobinEASGDStrategy

    AsyncEASGDStrategy(compression=build_compressor("topk"))  # accepted now
    AsyncMEASGDStrategy(compression=build_compressor("signsgd"))
    with pytest.raises(ValueError, match=r"^compression\.two_way: async_easgd compresses the workers' elastic"):
        AsyncEASGDStrategy(compression=build_compressor("topk", two_way=True))
    for cls in (HogwildEASGDStrategy, HogwildSGDStrategy):
        with pytest.raises(ValueError, match=r"^compression: hogwild_\w+ applies its updates lock-free") as err:
            cls(compression=build_compressor("topk"))
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="async_easgd, async_measgd") as err:
        RoundRobinEASGDStrategy(compression=build_compressor("topk"))
    assert "\n" not in str(err.value)
