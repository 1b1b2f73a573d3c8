"""The suite's own pytest-xdist scheduling (tests/conftest.py): emulated hosts and SLURM
in one unit of work, every other test with its module."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import HOSTS_GROUP, builds_hosts, scope_of

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_modules_share_one_scope_and_others_keep_their_module() -> None:
    for module in ("tests/e2e/test_torchrun_hosts.py", "tests/e2e/test_slurm.py",
                   "tests/e2e/test_bench_costmodel.py"):
        assert scope_of(f"{module}::test_x[a-b]", ROOT) == HOSTS_GROUP, module
    own = "tests/unit/cli/test_validation.py"
    assert scope_of(f"{own}::test_y", ROOT) == own
    assert scope_of("tests/e2e/test_demo.py::test_demo_is_quiet_and_reports", ROOT) == "tests/e2e/test_demo.py"


def test_every_netns_test_module_is_in_the_hosts_scope() -> None:
    netns = {p for p in (ROOT / "tests").rglob("test_*.py") if "pytest.mark.netns" in p.read_text()}
    assert len(netns) >= 5  # the bench harness and torchrun-on-hosts modules
    assert all(builds_hosts(p) for p in netns)
    assert not builds_hosts(ROOT / "tests" / "unit" / "cli" / "test_validation.py")
