"""``torchrun`` across two emulated hosts (network namespaces behind a bridge,
``bench/_netem.py``), 2 ranks per host, c10d rendezvous on host 0
(``scripts/torchrun_hosts.py``): ``ddp`` + top-k and ``sync_easgd`` in float64, each must
end with exactly one ``summary.json``, on host 0 (each host has its own run directory), and
the same train loss as the same run launched by ``easgd-train`` with 4 ranks on one host.
The other families (local SGD, Async EASGD with the server on the last host, pipeline_3d
with its stages on different hosts, and DeepSpeed's launcher) run from the script; the
README's "Launching across nodes" gives their results. Skipped, with the reason, where
network namespaces cannot be created.
"""

from __future__ import annotations

import sys

import pytest

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))
import torchrun_hosts as th  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.netns]


@pytest.fixture(scope="module")
def hosts():
    try:
        th.check_privileges()
        cluster = th.EmulatedCluster(2, th.LinkSpec(1000.0, 0.0), subnet="10.78.0")
        cluster.up()
    except th.ClusterUnavailable as err:
        pytest.skip(f"network namespaces unavailable: {err}")
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.mark.parametrize("family,port", [("ddp_topk", 29431), ("sync_easgd", 29432)])
def test_torchrun_on_two_hosts_equals_one_host(hosts, tmp_path, family: str, port: int) -> None:
    overrides, exact = th.FAMILIES[family]
    assert exact
    multi = th.run_on_hosts(hosts, family, overrides, tmp_path, nproc=2, port=port, timeout_s=240)
    one = th.run_on_one_host(family, overrides, tmp_path, world=4, timeout_s=240)
    print(f"{family}: torchrun 2x2 {multi.wall_s:.1f}s, easgd-train 1x4 {one.wall_s:.1f}s")
    problems = th.compare(multi, one, exact=True)
    assert not problems, f"{problems}\n{multi.tail()}\n{one.tail()}"
    s = multi.summary
    assert s["world_size"] == 4 and s["steps_per_rank"] == [4] * 4
    assert sum(s["comm"]["bytes_sent"]) > 0
    assert s["config"]["trainer"]["num_nodes"] == 2 and one.summary["config"]["trainer"]["num_nodes"] == 1
