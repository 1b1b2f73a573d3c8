"""ft=torchft under torchrun / SLURM (easgd_lightning/ft/external.py): where a process stands,
what is refused (one line naming the key), which reports are final, and the summary merged
from the workers' reports -- the rules, on hand-made reports whose numbers are known."""

from __future__ import annotations

import pytest

from easgd_lightning.cli.build import ConfigError
from easgd_lightning.ft.external import (
    check_own_launcher,
    external_ft_summary,
    final_report,
    placement,
    torchrun_record,
)
from easgd_lightning.ft.lighthouse import advertised_address
from tests.helpers import compose

TORCHRUN = {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "2", "RANK": "0", "WORLD_SIZE": "1"}
SLURM = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3"}


def _cfg(*extra: str):
    return compose(["ft=torchft", "strategy=sync_easgd", "trainer.devices=3", *extra])


def test_torchrun_placement() -> None:
    p = placement(_cfg("ft.replica_id=2", "ft.lighthouse=node0:29510"), TORCHRUN)
    assert (p.launcher, p.replica, p.replicas, p.lighthouse, p.attempt, p.max_restarts) == (
        "torchrun", 2, 3, "http://node0:29510", 1, 2)


def test_slurm_placement() -> None:
    p = placement(_cfg(), SLURM)
    assert (p.launcher, p.replica, p.replicas, p.lighthouse, p.attempt, p.max_restarts) == ("slurm", 2, 3, None, 0, 3)
    assert placement(_cfg("ft.lighthouse=h:1", "ft.max_restarts=1"), SLURM).lighthouse == "http://h:1"


@pytest.mark.parametrize("extra,env,message", [
    (["ft.lighthouse=h:1"], TORCHRUN, "ft.replica_id: under torchrun each torchrun is one worker: give ft.replica_id=0..2"),
    (["ft.replica_id=0"], TORCHRUN, "ft.lighthouse: under torchrun start a lighthouse first"),
    (["ft.replica_id=0", "ft.lighthouse=h:1"], {**TORCHRUN, "WORLD_SIZE": "2"},
     "ft=torchft under torchrun: each torchrun is one worker of one process"),
    (["ft.replica_id=1"], SLURM, "ft.replica_id: under SLURM task SLURM_PROCID is that worker"),
    ([], {**SLURM, "SLURM_NTASKS": "4"}, "one task per worker, but the job has 4 tasks"),
    (["ft.replica_id=0", "ft.lighthouse=h:1"], {"RANK": "0", "WORLD_SIZE": "3"},
     "of the external launchers only torchrun"),
])
def test_refusals(extra: list[str], env: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        placement(_cfg(*extra), env)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_replica_id_refused_under_the_own_launcher() -> None:
    with pytest.raises(ConfigError, match="ft.replica_id: only under torchrun"):
        check_own_launcher(_cfg("ft.replica_id=0"))
    check_own_launcher(_cfg())


def test_advertised_address() -> None:
    import socket

    assert advertised_address("127.0.0.1:0", "http://vm:40411") == "http://127.0.0.1:40411"
    assert advertised_address("0.0.0.0:0", "http://x:5") == f"http://{socket.gethostname()}:5"
    assert advertised_address("[::]:29510", "http://x:29510", "node7") == "http://node7:29510"


# ------------------------------------------------------------------------ reports and merge
def _ok(rank: int, attempt: int, *, steps: int = 90, started: float = 1000.0, recoveries=(), acc: float = 0.9) -> dict:
    ft = {"rank": rank, "attempt": attempt, "started_at": started, "exchanges": 10,
          "quorum_changes": [{"step": 0, "quorum_id": 1, "members": [0, 1, 2], "participants": 3, "t": 1001.0}],
          "not_committed": [], "recoveries": list(recoveries), "served": []}
    return {"rank": rank, "status": "ok", "role": "worker", "steps": steps, "wall_time_s": 10.0, "train_time_s": 9.0,
            "samples": steps * 8, "train_loss_sum": 2.0, "train_loss_count": 4, "val_loss": 0.3, "val_acc": acc,
            "val_history": [], "comm": {"bytes_sent": 100, "bytes_recv": 100, "dense_bytes": 100, "time_s": 1.0},
            "extras": {"ft": ft}}


def test_final_reports() -> None:
    assert not final_report(None, 1)
    assert final_report({"status": "ok"}, 0)
    assert final_report({"status": "ended_before_rejoin", "ft_attempt": 1}, 3)
    assert not final_report({"status": "failed", "ft_attempt": 0}, 1)  # torchrun starts it again
    assert final_report({"status": "failed", "ft_attempt": 1}, 1)  # its last start
    rec = torchrun_record(1, _ok(1, 2))
    assert rec["outcome"] == "finished" and rec["restarts"] == 2
    assert [d["attempt"] for d in rec["deaths"]] == [0, 1] and all(d["wall"] is None for d in rec["deaths"])
    assert torchrun_record(2, None) == {"rank": 2, "outcome": "lost", "restarts": None, "deaths": []}
    assert torchrun_record(0, {"status": "ended_before_rejoin", "ft_attempt": 1})["outcome"] == "ended_before_rejoin"


def test_summary_of_a_torchrun_rejoin() -> None:
    """Worker 1 was restarted once by torchrun and rejoined at step 40 (its process started
    at 1020.0, joined at 1023.5, 5000 bytes from a peer): one rejoin, death time unknown."""
    rec = {"step": 40, "bytes": 5000, "quorum_s": 0.4, "joined_at": 1023.5, "started_at": 1020.0}
    reports = [_ok(0, 0), _ok(1, 1, started=1020.0, recoveries=[rec]), _ok(2, 0, started=999.0)]
    records = [torchrun_record(r, rep) for r, rep in enumerate(reports)]
    s = external_ft_summary({"strategy": {"name": "sync_easgd"}}, reports, records, "http://h:1", 1, 999.0)
    ft = s["ft"]
    assert s["status"] == "ok" and s["error"] is None
    assert ft["restarts"] == [0, 1, 0] and ft["deaths"] == [{"rank": 1, "attempt": 0, "t_s": None}]
    (j,) = ft["rejoins"]
    assert (j["rank"], j["attempt"], j["at_step"], j["recovery_bytes"]) == (1, 1, 40, 5000)
    assert j["rejoined_t_s"] == 24.5 and j["restart_to_rejoin_s"] == 3.5 and j["recovery_s"] is None
    assert ft["finished_ranks"] == [0, 1, 2] and ft["lost_ranks"] == [] and ft["recovery_bytes"] == 5000
    assert s["steps_per_rank"] == [90, 90, 90] and s["world_size"] == 3


@pytest.mark.parametrize("min_replicas,status", [(1, "ok"), (2, "failed")])
def test_summary_with_a_lost_worker(min_replicas: int, status: str) -> None:
    """Worker 2 has no final report (torchrun gave up on it), worker 1 ended before it could
    rejoin: both lost; only worker 0 finished, so the run is ok iff ft.min_replicas is 1."""
    reports = [_ok(0, 0), {"rank": 1, "status": "ended_before_rejoin", "ft_attempt": 1}, None]
    records = [torchrun_record(r, rep) for r, rep in enumerate(reports)]
    s = external_ft_summary({}, reports, records, "http://h:1", min_replicas, 1000.0)
    ft = s["ft"]
    assert ft["finished_ranks"] == [0] and ft["lost_ranks"] == [1, 2] and ft["ended_before_rejoin"] == [1]
    assert ft["restarts"] == [0, 1, None]
    assert s["status"] == status
    if status == "ok":
        assert s["roles"] == ["worker", "lost", "lost"] and s["val_acc"] == 0.9
    else:
        assert "fewer than ft.min_replicas=2" in s["error"]


def test_summary_of_slurm_records() -> None:
    """SLURM tasks record their worker's deaths with times: recovery_s = rejoin - death."""
    rec = {"step": 12, "bytes": 800, "quorum_s": 0.2, "joined_at": 1030.0, "started_at": 1026.0}
    reports = [_ok(0, 0), _ok(1, 1, started=1026.0, recoveries=[rec])]
    records = [{"rank": 0, "outcome": "finished", "restarts": 0, "deaths": []},
               {"rank": 1, "outcome": "finished", "restarts": 1,
                "deaths": [{"rank": 1, "attempt": 0, "wall": 1025.0, "signal": "SIGKILL"}]}]
    s = external_ft_summary({}, reports, records, "http://h:1", 1, 1000.0)
    ft = s["ft"]
    assert ft["deaths"] == [{"rank": 1, "attempt": 0, "signal": "SIGKILL", "t_s": 25.0}]
    assert ft["rejoins"][0]["recovery_s"] == 5.0 and ft["rejoins"][0]["died_t_s"] == 25.0
    interrupted = [{**records[0], "interrupted_by": "SIGTERM"}, records[1]]
    s = external_ft_summary({}, reports, interrupted, "http://h:1", 1, 1000.0)
    assert s["status"] == "failed" and s["error"] == "interrupted by SIGTERM" and s["interrupted_by"] == "SIGTERM"


def test_advertised_host_is_the_collectives_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under an external launcher a worker advertises the address of GLOO_SOCKET_IFNAME's
    interface (here the loopback), else the host name; an interface without an address falls
    back to the host name."""
    import socket

    from easgd_lightning.ft.worker import advertised_host, interface_address

    assert interface_address("lo") == "127.0.0.1"
    assert interface_address("no-such-if0") is None
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert advertised_host() == "127.0.0.1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    assert advertised_host() == socket.gethostname()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    assert advertised_host() == socket.gethostname()
