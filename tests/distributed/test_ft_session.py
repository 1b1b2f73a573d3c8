"""The quorum exchange of ``ft=torchft`` (easgd_lightning/ft/worker.py, ``FTSession``) with
real processes and a real lighthouse: three workers, one SIGKILLed inside an exchange after
the quorum formed and before its all-reduce. The survivors' collective of that step fails;
they do not commit it (torchft's ``should_commit`` is False, nothing is applied), retry it
with the next quorum -- the two of them -- and commit the average of the two.

The compressed DDP hook's exchange (top-k with residuals) on the quorum, as ``ddp`` runs it
under ``ft=torchft``: the step the victim dies in is not committed and leaves the survivors'
residuals bitwise as they were before it; the next steps are top-k with error feedback over
the two survivors, as a reference computed here says.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tests.helpers import REPO, base_env

pytest.importorskip("torchft")

SCRIPTS = REPO / "tests" / "distributed" / "scripts"


def _wait_all(procs: list[subprocess.Popen], lighthouse) -> list[int | None]:
    """The workers' exit codes (each waited for at most 180 s; one still running then is
    killed), and the lighthouse shut down."""
    try:
        return [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        lighthouse.shutdown()


def _three_workers(tmp_path: Path, script: str, steps: int, victim: int, kill_step: int) -> list[dict]:
    """Run ``script`` as three workers on a real lighthouse; the survivors' result files."""
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=5000,
                                  heartbeat_timeout_ms=1000)
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    procs = []
    try:
        for r in range(3):
            env = base_env(EASGD_FT_RANK=str(r), EASGD_FT_WORLD="3", EASGD_FT_ATTEMPT="0",
                           EASGD_FT_LIGHTHOUSE=lighthouse.address().replace(socket.gethostname(), "127.0.0.1"), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(store.port), RUST_LOG="warn")
            procs.append(subprocess.Popen(
                [sys.executable, str(SCRIPTS / script), str(tmp_path / f"r{r}.json"), str(steps), str(victim),
                 str(kill_step)],
                env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"r{r}.err", "w"), start_new_session=True))
    finally:
        codes = _wait_all(procs, lighthouse)
    assert codes[victim] == -9, codes
    assert codes[0] == codes[1] == 0, [(tmp_path / f"r{r}.err").read_text()[-2000:] for r in range(2)]
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]


def test_failed_exchange_is_not_committed_and_retried(tmp_path: Path) -> None:
    steps, victim, kill_step = 6, 2, 3
    res = _three_workers(tmp_path, "ft_session_run.py", steps, victim, kill_step)
    # the reference: x_i += i + 1, then the mean over the quorum that committed
    x = [1.0, 2.0, 3.0]
    for step in range(1, steps + 1):
        x = [v + r + 1 for r, v in enumerate(x)]
        members = [0, 1, 2] if step < kill_step else [0, 1]
        mean = sum(x[r] for r in members) / len(members)
        x = [mean] * 3
        for r in range(2):
            assert res[r]["history"][step - 1]["x"] == pytest.approx(mean, rel=1e-12), (r, step)
            assert res[r]["history"][step - 1]["members"] == members, (r, step)
    for r in range(2):
        rep = res[r]["report"]
        assert rep["not_committed"] == [kill_step], rep  # tried once with the dead worker, not committed
        assert rep["exchanges"] == steps  # and then committed with the two
        assert [q["members"] for q in rep["quorum_changes"]] == [[0, 1, 2], [0, 1]], rep["quorum_changes"]
        assert rep["quorum_changes"][1]["step"] == kill_step


def test_compressed_step_not_committed_leaves_residuals(tmp_path: Path) -> None:
    import torch

    from tests.distributed.scripts.ft_compressed_run import NUMEL, RATIO, gradient

    steps, victim, kill_step = 5, 2, 3
    res = _three_workers(tmp_path, "ft_compressed_run.py", steps, victim, kill_step)
    k = int(NUMEL * RATIO)
    e = [torch.zeros(NUMEL, dtype=torch.float64) for _ in range(3)]  # the reference residuals
    for step in range(1, steps + 1):
        if step == kill_step:  # not committed: the gradients are dropped, the residuals untouched
            for r in range(2):
                h = res[r]["history"][step - 1]
                assert h["committed"] is False and h["residual"] == res[r]["history"][step - 2]["residual"], (r, h)
            continue
        members = [0, 1, 2] if step < kill_step else [0, 1]
        total = torch.zeros(NUMEL, dtype=torch.float64)
        for r in members:  # top-k of g + e with error feedback, summed in rank order
            p = gradient(step, r) + e[r]
            sent = torch.zeros_like(p)
            idx = p.abs().topk(k).indices
            sent[idx] = p[idx]
            e[r] = p - sent
            total += sent
        for r in range(2):
            h = res[r]["history"][step - 1]
            assert h["committed"] is True and h["members"] == members, (r, step, h)
            assert h["mean"] == pytest.approx((total / len(members)).tolist(), rel=1e-12, abs=1e-15), (r, step)
            assert h["residual"] == pytest.approx(e[r].tolist(), rel=1e-12, abs=1e-15), (r, step)
    for r in range(2):
        assert res[r]["report"]["not_committed"] == [kill_step]


HEAL_SCRIPT = REPO / "tests" / "distributed" / "scripts" / "ft_heal_retry_run.py"


def test_rejoin_not_committed_is_received_again(tmp_path: Path) -> None:
    """A restarted worker (2) rejoins two running ones; in the first quorum that holds it every
    worker reports an error before the vote, so nobody commits that exchange. torchft has
    already loaded the peer's state into the joiner and set its step to the peer's: it must
    be healed again at the next quorum (contributing nothing, n = 2), not take part as an
    ordinary worker whose first exchange is a set-up broadcast (zeros, n = 3: the average
    would be (x0 + x1) / 3). The reference: x_r += r + 1, then the mean over the contributors."""
    from torch.distributed import TCPStore
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=5000,
                                  heartbeat_timeout_ms=1000)
    address = lighthouse.address().replace(socket.gethostname(), "127.0.0.1")
    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    steps, wait_at = 12, 4
    procs = []
    try:
        for r, world, attempt in ((0, 2, 0), (1, 2, 0), (2, 3, 1)):
            if attempt:  # the restart comes once the two have committed an exchange
                deadline = time.monotonic() + 120
                while not (tmp_path / "ranks" / "ft" / "rank0.json").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
            env = base_env(EASGD_FT_RANK=str(r), EASGD_FT_WORLD=str(world), EASGD_FT_ATTEMPT=str(attempt),
                           EASGD_FT_LIGHTHOUSE=address, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                           RUST_LOG="warn")
            with open(tmp_path / f"r{r}.err", "w") as err:
                procs.append(subprocess.Popen([sys.executable, str(HEAL_SCRIPT), str(tmp_path / f"r{r}.json"),
                                               str(steps), str(wait_at)], env=env, stdout=subprocess.DEVNULL,
                                              stderr=err, start_new_session=True))
    finally:
        codes = _wait_all(procs, lighthouse)
    assert codes == [0, 0, 0], [(tmp_path / f"r{r}.err").read_text()[-2000:] for r in range(3)]
    res = [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(3)]
    joiner = res[2]["report"]
    (recovery,) = joiner["recoveries"]
    healed_at = recovery["step"]
    assert wait_at <= healed_at < steps and recovery["bytes"] == 8  # x: one float64
    assert joiner["not_committed"] == [0]  # its set-up exchange, tried once in vain
    x = [1.0, 2.0, 3.0]
    for step in range(1, steps + 1):
        contributors = [0, 1] if step <= healed_at else [0, 1, 2]
        x = [v + r + 1 for r, v in enumerate(x)]
        mean = sum(x[r] for r in contributors) / len(contributors)
        x = [mean] * 3
        for r in (0, 1):
            assert res[r]["history"][step - 1]["x"] == pytest.approx(mean, rel=1e-12), (r, step)
        if step >= healed_at:
            (row,) = [h for h in res[2]["history"] if h["step"] == step]
            assert row["x"] == pytest.approx(mean, rel=1e-12), (step, res[2]["history"])
    for r in (0, 1):
        assert res[r]["report"]["not_committed"] == [healed_at], res[r]["report"]
