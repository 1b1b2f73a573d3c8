"""The parameter-server protocol over real gloo processes (4 ranks, no Lightning).

Checks first-come-first-served service (a slow worker does not hold the others back and is
not served in rank order), the server's arithmetic against a plain-torch replay of its own
service order, and that a worker that dies without saying "done", or freezes (SIGSTOP) in
the middle of a request, neither hangs the server nor holds up the remaining workers. The SGD rule steps the user's optimizer at the server: Adam with
two parameter groups (one with lr 0) and a frozen parameter is replayed here with a fresh
``torch.optim.Adam`` in one process, in the server's service order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import communicate_all, launch_ranks, start_ranks

SCRIPT = Path(__file__).parent / "scripts" / "async_ps_run.py"
WORKERS = (0, 1, 2)


def _load(out: Path, mode: str, ranks=(0, 1, 2, 3)) -> dict[int, dict]:
    return {r: torch.load(out / mode / f"rank{r}.pt", weights_only=False) for r in ranks}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("async_ps")
    ranks = launch_ranks(SCRIPT, 4, ["fcfs,sgd,adam,adamfree,lockfree,overlap,dead", str(out)], timeout=240)
    (out / "server.err").write_text(ranks[3].stderr)  # the server's warnings (how it noticed the dead)
    return out


def test_fcfs_serves_whoever_arrives_and_matches_replay(runs: Path) -> None:
    recs = _load(runs, "fcfs")
    server = recs[3]
    order = server["order"]
    assert sorted(order) == sorted([0] * 12 + [1] * 12 + [2] * 12)
    assert server["done"] and sorted(server["done"]) == [0, 1, 2]
    # FCFS, not rank order: the fast workers 0 and 2 are done long before slow worker 1
    last = {r: max(i for i, s in enumerate(order) if s == r) for r in WORKERS}
    assert last[0] < last[1] and last[2] < last[1]
    assert order[:6].count(1) <= 2, order  # the slow worker did not set the pace
    # replay the server's order with an independent reference: d = alpha (x - c); c += d
    alpha = 0.25
    c = torch.zeros(257)
    k = {r: 0 for r in WORKERS}
    for sender in order:
        x = recs[sender]["sent"][k[sender]]
        d = (x - c) * alpha
        c = c + d
        torch.testing.assert_close(recs[sender]["got"][k[sender]], d, rtol=1e-6, atol=1e-6)
        k[sender] += 1
    torch.testing.assert_close(server["center"], c, rtol=1e-6, atol=1e-6)
    for r in WORKERS:  # everyone ends with the server's final center
        torch.testing.assert_close(recs[r]["final"], server["center"])


def test_overlapped_requests_charge_only_the_wait_as_exposed_time(runs: Path) -> None:
    """A request sent before COMPUTE_S of computation and collected after it: its time spans
    the computation, but only the wait in ``end`` (after the computation) is exposed, so the
    two differ by at least the computation. Blocking requests: the loop waited for them."""
    compute_s = 0.6  # the script's COMPUTE_S
    recs = _load(runs, "overlap")
    for r in WORKERS:
        over, block = recs[r]["overlapped"], recs[r]["blocking"]
        assert over["time_s"] >= 2 * compute_s, over  # two requests, each spanning a sleep
        # not exposed: the computation between begin and end (charging since begin: 0)
        assert over["time_s"] - over["exposed_s"] >= 2 * compute_s, over
        assert 0.0 < block["exposed_s"] <= block["time_s"], block
    # the overlapped exchanges are still the elastic rule, replayed in the server's order
    server, c, k = recs[3], torch.zeros(257), {r: 0 for r in WORKERS}
    for sender in server["order"]:
        d = (recs[sender]["sent"][k[sender]] - c) * 0.25
        c = c + d
        torch.testing.assert_close(recs[sender]["got"][k[sender]], d, rtol=1e-6, atol=1e-6)
        k[sender] += 1
    assert k == {0: 4, 1: 4, 2: 4}
    torch.testing.assert_close(server["center"], c, rtol=1e-6, atol=1e-6)


def test_sgd_server_with_momentum_matches_replay(runs: Path) -> None:
    recs = _load(runs, "sgd")
    server = recs[3]
    lr, mu, wd, n_params = 0.1, 0.5, 0.01, 256
    w = torch.zeros(257)
    buf = None
    k = {r: 0 for r in WORKERS}
    for sender in server["order"]:
        g = recs[sender]["sent"][k[sender]]
        step = g[:n_params] + wd * w[:n_params]
        buf = step.clone() if buf is None else mu * buf + step
        w = torch.cat([w[:n_params] - lr * buf, g[n_params:]])  # buffers are overwritten
        torch.testing.assert_close(recs[sender]["got"][k[sender]], w, rtol=1e-5, atol=1e-6)
        k[sender] += 1
    assert server["updates"] == 24
    torch.testing.assert_close(server["center"], w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(server["state"]["momentum"], buf, rtol=1e-5, atol=1e-6)


def test_user_adam_at_the_server_matches_a_single_process_replay(runs: Path) -> None:
    """The server runs the user's Adam (its groups, per-request lrs, its state); the replay is
    an independent Adam over fresh tensors fed the same gradients in the server's order."""
    from tests.distributed.scripts import async_ps_run as run

    recs = _load(runs, "adam")
    server = recs[3]
    start = run.adam_start()
    shapes = run.SHAPES
    sizes = [torch.Size(s).numel() for s in shapes]
    params, offset = [], 0
    for shape, n in zip(shapes, sizes):
        params.append(start[offset : offset + n].clone().view(shape))
        offset += n
    adam = torch.optim.Adam(
        [{"params": [params[0], params[2]], "lr": run.ADAM_LR, "weight_decay": run.ADAM_WD},
         {"params": [params[1]], "lr": 0.0}]
    )
    k = {r: 0 for r in WORKERS}
    for sender in server["order"]:
        g = recs[sender]["sent"][k[sender]]
        params[0].grad = g[: sizes[0]].view(shapes[0]).clone()
        params[1].grad = g[sizes[0] : sizes[0] + sizes[1]].clone()
        params[2].grad = None  # the workers had no gradient for it
        adam.param_groups[0]["lr"] = run.adam_lr(k[sender])
        adam.step()
        w = torch.cat([p.detach().reshape(-1) for p in params] + [g[256:]])
        torch.testing.assert_close(recs[sender]["got"][k[sender]], w, rtol=1e-6, atol=1e-7)
        k[sender] += 1
    assert server["updates"] == 24
    center = server["center"]
    torch.testing.assert_close(center, w, rtol=1e-6, atol=1e-7)
    # the lr-0 group and the frozen parameter are bitwise where they started; the rest moved
    lo, hi = sizes[0], sizes[0] + sizes[1]
    assert torch.equal(center[lo:hi], start[lo:hi])
    assert torch.equal(center[hi:256], start[hi:256])
    assert not torch.equal(center[:lo], start[:lo])
    # the server holds Adam's state (moments and step count), as the replay's
    state = server["state"]["optimizer"]["state"]
    assert int(state[0]["step"]) == 24 and 1 not in state  # state id 1: the frozen one, never stepped
    torch.testing.assert_close(state[0]["exp_avg"], adam.state[params[0]]["exp_avg"], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(state[0]["exp_avg_sq"], adam.state[params[0]]["exp_avg_sq"], rtol=1e-6, atol=1e-10)


def test_lockfree_server_applies_every_update(runs: Path) -> None:
    """Hogwild on a server: no exact replay (updates race), but none is lost and the center
    stays a convex mix of the start and what the workers sent."""
    recs = _load(runs, "lockfree")
    server = recs[3]
    assert server["updates"] == 36 and sorted(server["done"]) == [0, 1, 2]
    sent = torch.stack([x for r in WORKERS for x in recs[r]["sent"]])
    low = torch.minimum(sent.min(0).values, torch.zeros(257))
    high = torch.maximum(sent.max(0).values, torch.zeros(257))
    margin = 0.1 * (high - low)  # stale reads may overshoot a little; that is Hogwild
    assert bool(((server["center"] >= low - margin) & (server["center"] <= high + margin)).all())
    for r in WORKERS:
        torch.testing.assert_close(recs[r]["final"], server["center"])


def test_lockfree_server_steps_the_users_adam_for_every_push(runs: Path) -> None:
    """Hogwild SGD on a server: Adam's steps race with the replies' reads (no exact replay),
    but every push is one Adam step and lr 0 / frozen parameters never move."""
    recs = _load(runs, "adamfree")
    server = recs[3]
    assert server["updates"] == 24 and sorted(server["done"]) == [0, 1, 2]
    state = server["state"]["optimizer"]["state"]
    assert int(state[0]["step"]) == 24 and 1 not in state
    start = torch.randn(257, generator=torch.Generator().manual_seed(7))  # the script's adam_start()
    center = server["center"]
    assert torch.equal(center[128:256], start[128:256])  # the lr-0 group and the frozen parameter
    assert not torch.equal(center[:128], start[:128])
    for r in WORKERS:
        torch.testing.assert_close(recs[r]["final"], center)


def test_dead_worker_neither_hangs_server_nor_others(runs: Path) -> None:
    recs = _load(runs, "dead", ranks=(0, 1, 3))
    assert not (runs / "dead" / "rank2.pt").exists()
    server = recs[3]
    assert server["dead"] == [2] and sorted(server["done"]) == [0, 1]
    assert server["order"].count(2) == 3 and server["updates"] == 23
    # the survivors got the final center; the server stopped waiting for the dead one when
    # its channel (its own process group) closed, not through a timeout (heartbeats: 2 s,
    # the process group's: 60 s), and recorded the loss
    for r in (0, 1):
        torch.testing.assert_close(recs[r]["final"], server["center"])
    (lost,) = server["lost"]
    assert lost["rank"] == 2 and lost["cause"] == "connection lost" and lost["updates"] <= 23, lost
    # closed (FIN) or reset (RST: it died with bytes unread), as gloo reports either
    assert "Connection closed by peer" in lost["error"] or "Connection reset by peer" in lost["error"], lost
    assert "lost worker 2 (connection lost" in (runs / "server.err").read_text()


@pytest.fixture(scope="module")
def frozen(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("async_ps_frozen")
    results = communicate_all(start_ranks(SCRIPT, 4, ["frozen", str(out)]), timeout=240)
    codes = [r.returncode for r in results]
    assert codes == [0, 0, -9, 0], (codes, results[3].stderr[-3000:])  # the server killed the frozen one
    return _load(out, "frozen", ranks=(0, 1, 3))


def test_a_frozen_worker_holds_nobody_up_and_is_dropped_by_its_heartbeat(frozen: dict[int, dict]) -> None:
    """Worker 2 stops itself in the middle of a request (SIGSTOP). Issue 31: the server
    blocked on it and the others timed out. Now the others are served all along, it is
    dropped when its heartbeat has been silent for dead_after_s (2 s), and the others end
    with the final center."""
    server = frozen[3]
    (lost,) = server["lost"]
    assert lost["rank"] == 2 and lost["cause"] == "heartbeat stopped" and server["dead"] == [2]
    frozen_at, dropped_at = server["frozen_at"], lost["at"]
    assert dropped_at - frozen_at >= 2.0  # its heartbeat decided, not its channel
    for r in (0, 1):
        while_frozen = [t for t in frozen[r]["times"] if frozen_at < t < dropped_at]
        assert len(while_frozen) >= 20, (r, len(while_frozen))  # served while worker 2 was frozen
        assert any(t > dropped_at for t in frozen[r]["times"])  # and after it was dropped
        torch.testing.assert_close(frozen[r]["final"], server["center"])
    assert sorted(server["done"]) == [0, 1]
    # its 4th request froze with it in the middle of sending (gloo moves a payload only once
    # the receiver asks for it, on the sender's stopped thread): applied only if it got out
    assert server["order"].count(2) in (3, 4)


REJOIN_SCRIPT = Path(__file__).parent / "scripts" / "async_ps_rejoin_run.py"


@pytest.fixture(scope="module")
def rejoined(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Worker 2 SIGKILLs itself after 3 requests; once workers 0 and 1 are done, a new process
    of it (joining no process group) is re-admitted by the server, which waited for it, and
    sends 6 more (scripts/async_ps_rejoin_run.py)."""
    from easgd_lightning.utils.rank_env import free_port
    from tests.helpers import start_rank

    out = tmp_path_factory.mktemp("async_ps_rejoin")
    port = free_port()
    procs = start_ranks(REJOIN_SCRIPT, 4, [str(out)], port=port)
    procs.append(start_rank(REJOIN_SCRIPT, 2, 4, [str(out)], port=port, extra_env={"LATE": "1"}))
    results = communicate_all(procs, timeout=240)
    codes = [r.returncode for r in results]
    assert codes == [0, 0, -9, 0, 0], (codes, results[3].stderr[-3000:], results[4].stderr[-3000:])
    recs = {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1, 3)}
    recs["late"] = torch.load(out / "rank2-late.pt", weights_only=False)
    return recs


def test_a_restarted_worker_is_readmitted_and_the_float64_replay_stays_exact(rejoined: dict) -> None:
    """The server's service order, replayed here in float64 with d = alpha (x - c), c += d:
    every reply and the final center are bitwise the replay's, across the loss and the
    rejoin; the rejoined process pulled exactly the replay's center at the update count its
    state names, and went on from the step the server had recorded for its first start. The
    server, with no worker active (0 and 1 done, 2 lost), waited for it instead of ending."""
    from tests.distributed.scripts import async_ps_rejoin_run as run

    server, late = rejoined[3], rejoined["late"]
    (lost,) = server["lost"]
    assert lost["rank"] == 2 and lost["cause"] in ("connection lost", "restarted"), lost
    assert lost["restarted"] == 1 and lost["back_at"] >= lost["at"]
    (join,) = server["rejoins"]
    assert join["rank"] == 2 and join["attempt"] == 1
    assert server["dead"] == [] and sorted(server["done"]) == [0, 1, 2]
    assert [m["members"] for m in server["membership"]] == [[0, 1, 2], [0, 1], [0, 1, 2]]
    state = late["state"]
    assert state["worker_steps"][2] == run.FIRST  # the step of its last served request
    assert late["state_bytes"] > state["center"].numel() * 8  # the center and the server's state
    assert server["served"][2] == server["worker_steps"][2] == run.FIRST + run.AFTER
    # what each worker sent, and got back, in its order; worker 2's first start died with its
    # records: its messages are regenerated here, its replies are unknown (None)
    sent = {r: list(rejoined[r]["sent"]) for r in (0, 1)}
    got = {r: list(rejoined[r]["got"]) for r in (0, 1)}
    sent[2] = [run.x_of(2, k) for k in range(run.FIRST)] + list(late["sent"])
    got[2] = [None] * run.FIRST + list(late["got"])
    assert server["order"].count(2) == len(sent[2]) == run.FIRST + run.AFTER
    assert server["order"][-run.AFTER:] == [2] * run.AFTER  # served after the others were done
    assert state["updates"] == run.FIRST + 2 * run.OTHERS  # it pulled the center they left
    c = torch.zeros(257, dtype=torch.float64)
    k = {0: 0, 1: 0, 2: 0}
    for i, sender in enumerate(server["order"]):
        if i == state["updates"]:
            assert torch.equal(state["center"], c)  # the center it started from
        d = 0.25 * (sent[sender][k[sender]] - c)
        c = c + d
        if got[sender][k[sender]] is not None:
            assert torch.equal(got[sender][k[sender]], d), (i, sender)
        k[sender] += 1
    assert run.FIRST <= state["updates"] < len(server["order"])
    assert torch.equal(server["center"], c)
    for rec in (rejoined[0], rejoined[1], late):  # every worker, the rejoined one too, ends with it
        assert torch.equal(rec["final"], c)
