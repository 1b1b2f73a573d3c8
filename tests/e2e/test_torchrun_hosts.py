"""``torchrun`` across emulated hosts (network namespaces behind a bridge, ``bench/_netem.py``;
``scripts/torchrun_hosts.py``): on host ``i`` one ``torchrun --nnodes N --node-rank i
--rdzv-backend c10d --rdzv-endpoint HOST0:PORT ... -m easgd_lightning.cli.train``, each
host with its own run directory (no shared file system).

Every strategy family on 2 hosts x 2 ranks: ``ddp`` + top-k, ``sync_easgd``, ``local_sgd``
(float64) and ``pipeline_3d`` (pp=2 x dp=2, stage 0 on host 0 and stage 1 on host 1) must
end with exactly one ``summary.json``, on host 0, whose train loss equals (``==``) the same
run launched by ``easgd-train`` with 4 ranks on one host (forked from the session's CLI
server, as ``tests.helpers.run_cli``'s runs) -- the reference is the launch path every other
test checks; a rank that trained on another layout, missed a step, lost a
report or averaged with the wrong group gives another loss. ``async_easgd`` (not
deterministic: first-come-first-served server) must finish with its server on the last rank
of the last host. Four hosts x 1 rank run ``ddp`` + top-k against the same single-host
reference, and DeepSpeed's launcher (``deepspeed --hostfile H --no_ssh --node_rank i`` per
host) runs ``pipeline_3d`` against it too. Each run is launched once per module and shared
by the assertions. Skipped, with the reason, where network namespaces cannot be created.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, run_cli

sys.path.insert(0, str(REPO / "scripts"))
import torchrun_hosts as th  # noqa: E402  (scripts/ is not a package: the user's entry point)

pytestmark = [pytest.mark.slow, pytest.mark.netns]

TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def cluster():
    """Four emulated hosts (1 Gbit/s links) for the whole module; the 2-host runs use the
    first two. Torn down (processes killed, namespaces removed) at the end."""
    try:
        th.check_privileges()
        c = th.EmulatedCluster(4, th.LinkSpec(1000.0, 0.0), subnet="10.78.0")
        c.up()
    except th.ClusterUnavailable as err:
        pytest.skip(f"network namespaces unavailable: {err}")
    try:
        yield c
    finally:
        c.down()


class Runs:
    """Each launch once per module (cached by its arguments)."""

    def __init__(self, cluster: th.EmulatedCluster, root: Path) -> None:
        self.cluster, self.root, self._cache = cluster, root, {}
        self._port = 29440

    def _once(self, key, fn):
        if key not in self._cache:
            self._port += 1
            self._cache[key] = fn(self._port)
        return self._cache[key]

    def torchrun(self, family: str, hosts: int = 2, nproc: int = 2) -> th.HostRun:
        overrides = th.FAMILIES[family][0]
        out = self.root / f"{family}_{hosts}x{nproc}"
        run = self._once(("torchrun", family, hosts, nproc),
                         lambda port: th.run_on_hosts(self.cluster, family, overrides, out, hosts=hosts, nproc=nproc,
                                                      port=port, timeout_s=TIMEOUT_S))
        print(f"{family}: torchrun {hosts}x{nproc} {run.wall_s:.1f}s codes={run.codes}")
        return run

    def deepspeed(self, family: str, hosts: int = 2, nproc: int = 2) -> th.HostRun:
        overrides = th.FAMILIES[family][0]
        out = self.root / f"{family}_ds_{hosts}x{nproc}"
        run = self._once(("deepspeed", family, hosts, nproc),
                         lambda port: th.run_deepspeed_on_hosts(self.cluster, family, overrides, out, hosts=hosts,
                                                                nproc=nproc, port=port, timeout_s=TIMEOUT_S))
        print(f"{family}: deepspeed --no_ssh {hosts}x{nproc} {run.wall_s:.1f}s codes={run.codes}")
        return run

    def one_host(self, family: str, world: int = 4) -> th.HostRun:
        overrides = th.FAMILIES[family][0]
        run = self._once(("one", family, world),
                         lambda _port: _one_host(family, overrides, self.root / f"{family}_1x{world}", world))
        print(f"{family}: easgd-train 1x{world} {run.wall_s:.1f}s codes={run.codes}")
        return run


def _one_host(name: str, overrides: list[str], out: Path, world: int) -> th.HostRun:
    """``th.run_on_one_host``'s run (the same command line: ``easgd-train`` with ``world``
    local ranks), forked from the session's CLI server (tests/helpers.py ``run_cli``: the
    same ``main()``, argv, environment and working directory, without a fresh interpreter's
    imports). The reference only; every multi-host run is a real ``torchrun`` / ``deepspeed``."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "one_host.log"
    started = time.monotonic()
    proc = run_cli([*th.COMMON, *overrides, f"trainer.devices={world}", f"hydra.run.dir={out / 'one'}"],
                   timeout=TIMEOUT_S, check=False)
    wall = time.monotonic() - started
    log.write_text(f"{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    try:
        summary = json.loads((out / "one" / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    return th.HostRun(name, "easgd-train", [proc.returncode], wall, [summary], [log])


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory) -> Runs:
    return Runs(cluster, tmp_path_factory.mktemp("torchrun_hosts"))


def _report(out: Path, host: int, rank: int) -> dict:
    return json.loads((out / f"host{host}" / "ranks" / f"rank{rank}.json").read_text())


def _check_equal(multi: th.HostRun, one: th.HostRun, nodes: int) -> dict:
    problems = th.compare(multi, one, exact=True)
    assert not problems, f"{problems}\n{multi.tail()}\n{one.tail()}"
    s = multi.summary
    assert s["world_size"] == 4 and s["steps_per_rank"] == [4] * 4
    assert s["config"]["trainer"]["num_nodes"] == nodes and one.summary["config"]["trainer"]["num_nodes"] == 1
    assert sum(s["comm"]["bytes_sent"]) > 0
    return s


@pytest.mark.parametrize("family", ["ddp_topk", "sync_easgd", "local_sgd", "pipeline_3d"])
def test_torchrun_two_hosts_equals_one_host(runs: Runs, family: str) -> None:
    s = _check_equal(runs.torchrun(family), runs.one_host(family), nodes=2)
    assert s["run_id"] == f"{family}-2x2"  # torchrun's --rdzv-id (TORCHELASTIC_RUN_ID) on every node


def test_pipeline_stages_on_different_hosts(runs: Runs) -> None:
    """pp=2 x dp=2 over 2 hosts x 2 ranks: ranks 0, 1 (host 0) hold stage 0 and ranks 2, 3
    (host 1) stage 1, so every activation and gradient between the stages crosses hosts.
    A host's run directory holds only its own ranks' reports (host 0's also the gathered ones)."""
    run = runs.torchrun("pipeline_3d")
    assert run.summary is not None and run.summary["strategy"] == "pipeline_3d", run.tail()
    out = run.logs[0].parent
    assert sorted(p.name for p in (out / "host1" / "ranks").glob("rank*.json")) == ["rank2.json", "rank3.json"]
    stages = {r: _report(out, r // 2, r)["extras"]["coords"]["stage"] for r in range(4)}
    assert stages == {0: 0, 1: 0, 2: 1, 3: 1}


def test_async_easgd_server_on_last_host(runs: Runs) -> None:
    run = runs.torchrun("async_easgd")
    problems = th.compare(run, None, exact=False)
    assert not problems, f"{problems}\n{run.tail()}"
    s = run.summary
    assert s["roles"] == ["worker", "worker", "worker", "server"] and s["trained_ranks"] == [0, 1, 2]
    assert _report(run.logs[0].parent, 1, 3)["role"] == "server"  # written on host 1, by rank 3


def test_torchrun_four_hosts_equals_one_host(runs: Runs) -> None:
    """Four hosts x 1 rank: the same 4 ranks as 2 x 2 and 1 x 4, the same train loss."""
    s = _check_equal(runs.torchrun("ddp_topk", hosts=4, nproc=1), runs.one_host("ddp_topk"), nodes=4)
    assert s["train_loss"] == runs.torchrun("ddp_topk").summary["train_loss"]


def test_deepspeed_launcher_pipeline(runs: Runs) -> None:
    """``deepspeed --hostfile H --no_ssh --node_rank i`` on each host: pipeline_3d ends like
    the torchrun and single-host launches."""
    s = _check_equal(runs.deepspeed("pipeline_3d"), runs.one_host("pipeline_3d"), nodes=2)
    assert s["train_loss"] == runs.torchrun("pipeline_3d").summary["train_loss"]
