"""A user's ordinary LightningModule under the asynchronous strategies, by name, real ranks.

One run per family (parameter server with the SGD rule, parameter server with the elastic
rule, Hogwild on shared memory): a ``torchmetrics`` accuracy logged with ``on_epoch=True``
completes and reports the accuracy of the center it was computed on; the user's Adam with
two groups runs where the update is applied (a group with lr 0 and a frozen layer stay
bitwise where they started); the checkpoint ``ModelCheckpoint(monitor="val_loss")`` kept
holds exactly the center that scored that loss. Then the failure paths: a collective the
parameter server never joins fails with a clear error, and SIGTERM ends every rank of a run
hung in one.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from tests.helpers import launch_ranks, start_ranks

SCRIPT = Path(__file__).parent / "scripts" / "async_user_run.py"
RUNS = [("async_sgd", 4), ("async_easgd", 4), ("hogwild_sgd", 3)]


def _val_set() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    return x[1500:], torch.tensor(d.target)[1500:]


def _scores(state: dict) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) on the validation set of the net with ``state``: the
    same layers as the script's module, computed here with plain torch."""
    x, y = _val_set()
    h = torch.tanh(F.linear(x, state["frozen.weight"], state["frozen.bias"]))
    h = torch.tanh(F.linear(h, state["hidden.weight"], state["hidden.bias"]))
    logits = F.linear(h, state["head.weight"], state["head.bias"])
    return float((logits.argmax(1) == y).float().mean()), float(F.cross_entropy(logits, y))


@pytest.mark.slow
@pytest.mark.parametrize("strategy,devices", RUNS)
def test_user_module_metrics_optimizer_frozen_and_checkpoint(tmp_path: Path, strategy: str, devices: int) -> None:
    launch_ranks(SCRIPT, devices, [strategy, str(devices), str(tmp_path), "train"], timeout=300)
    recs = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(devices)}
    rank0 = recs[0]
    workers = [r for r in recs if recs[r]["role"] == "worker"]
    assert len(workers) == 3 and all(recs[r]["steps"] > 0 for r in workers)

    # the metric completed on every worker and reports the accuracy of the center it scored
    # one per epoch rank 0 ran (stop_policy=first: it stops when the fastest worker is done)
    assert 1 <= len(rank0["scored"]) <= 3
    for scored in rank0["scored"]:
        acc, loss = _scores(scored["state"])
        assert scored["val_acc"] == pytest.approx(acc, abs=1e-6)
        assert scored["val_loss"] == pytest.approx(loss, rel=1e-5)
    assert rank0["scored"][-1]["val_acc"] > 0.5

    # every rank ends with the same center; it trained, but the lr-0 group (head) and the
    # frozen layer are bitwise where they started, on every rank
    final = rank0["final"]
    for r in recs:
        for key, value in recs[r]["final"].items():
            assert torch.equal(value, final[key]), (r, key)
    for key in ("head.weight", "head.bias", "frozen.weight", "frozen.bias"):
        assert torch.equal(final[key], rank0["initial"][key]), key
    assert not torch.equal(final["hidden.weight"], rank0["initial"]["hidden.weight"])

    # the checkpoint ModelCheckpoint(monitor="val_loss") kept holds the center that scored it
    ckpt = torch.load(rank0["best_path"], weights_only=False)
    scored = next(s for s in rank0["scored"] if s["epoch"] == ckpt["epoch"])
    assert rank0["best_score"] == pytest.approx(scored["val_loss"], rel=1e-6)
    for key, value in scored["state"].items():
        assert torch.equal(ckpt["state_dict"][key], value), key
    assert _scores(ckpt["state_dict"])[1] == pytest.approx(rank0["best_score"], rel=1e-5)
    if strategy == "async_sgd":  # the server held the user's Adam and its state
        server = ckpt["easgd"]["server"]["optimizer"]
        assert [g["lr"] for g in server["param_groups"]][1] == 0.0
        assert all("exp_avg" in s for s in server["state"].values()) and server["state"]


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    try:
        for p in procs:
            p.communicate(timeout=timeout)
    finally:
        codes = [p.poll() for p in procs]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes


@pytest.mark.slow
def test_a_collective_the_server_never_joins_fails_with_a_clear_error(tmp_path: Path) -> None:
    """The module's own all_reduce (timeout 8 s) fails on every worker, saying why."""
    procs = start_ranks(SCRIPT, 4, ["async_sgd", "4", str(tmp_path), "collective"])
    codes = _wait_all(procs, timeout=240)
    assert all(code is not None for code in codes), codes  # nobody hung
    for rank in (0, 1, 2):
        assert codes[rank] != 0
        text = (tmp_path / f"rank{rank}.err").read_text().splitlines()[0]
        assert "collective over every rank cannot complete (it ends at timeout_s" in text, text
        assert "parameter server (rank 3) never joins" in text and "torchmetrics" in text, text


@pytest.mark.slow
def test_sigterm_ends_every_rank_of_a_run_hung_in_a_collective(tmp_path: Path) -> None:
    """Workers blocked in a collective that would wait 300 s (the server serving, alive):
    SIGTERM ends each of them (the wakeup-fd watch: 128 + SIGTERM), then the server ends
    within the bound and says why."""
    procs = start_ranks(SCRIPT, 4, ["async_easgd", "4", str(tmp_path), "hang"])
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"hung{r}").exists() for r in (0, 1, 2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "never reached the hang"
            time.sleep(0.2)
        time.sleep(1.0)  # they are inside the all_reduce now
        for p in procs[:3]:
            p.send_signal(signal.SIGTERM)
        worker_codes = _wait_all(procs[:3], timeout=60)  # far below the collective's 300 s
        if procs[3].poll() is None:  # it may already have noticed the store (rank 0) is gone
            procs[3].send_signal(signal.SIGTERM)
        server_code = _wait_all(procs[3:], timeout=60)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert worker_codes == [128 + signal.SIGTERM] * 3, worker_codes
    assert server_code not in (None, 0), server_code
    # The server ends in one of four ways, all bounded and explained: it stops serving on
    # its own SIGTERM and says so; it notices first that the rendezvous store died with
    # rank 0 (the store lives in rank 0 in this torchrun-style launch) and says that; it
    # notices first that every worker's heartbeat stopped (on loaded cores the workers may
    # take longer to exit than its heartbeat bound) and fails saying so, none having
    # finished; or the signal arrives while it is already exiting (the watch's 128 +
    # SIGTERM, or the default disposition restored at exit: -SIGTERM).
    err_file = tmp_path / "rank3.err"
    err_text = err_file.read_text() if err_file.exists() else ""
    said = any(why in err_text for why in ("interrupted by SIGTERM", "lost the rendezvous store",
                                           "every worker was lost before finishing"))
    assert said or server_code in (128 + signal.SIGTERM, -signal.SIGTERM), (server_code, err_text[-3000:])


WATCHED = """
import signal, sys, threading
from pathlib import Path
from easgd_lightning.comm.liveness import SignalWatch
signal.signal(signal.SIGTERM, lambda *_: None)  # a handler that only records, as Lightning's does
out = Path(sys.argv[1])
watch = SignalWatch("test rank", grace_s=0.5, on_signal=lambda s: (out / f"passed_on_{s}").touch())
assert watch.start()
(out / "ready").touch()
lock = threading.Lock()
lock.acquire()
lock.acquire()  # never returns: handlers run in between, nothing ends the process
"""


def test_signal_watch_ends_a_rank_whose_handler_cannot_end_it(tmp_path: Path) -> None:
    """A process whose SIGTERM handler only records the signal and whose main thread stays
    blocked: the watch passes the signal on at once and exits with 128 + SIGTERM."""
    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    (proc,) = start_ranks(script, 1, [str(tmp_path)])  # forked from the session's script server
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=5)
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert (tmp_path / f"passed_on_{int(signal.SIGTERM)}").exists()
    assert "still running 0.5 s after SIGTERM" in err
