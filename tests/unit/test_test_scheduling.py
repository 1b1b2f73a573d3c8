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


def test_the_hosts_scope_is_every_cluster_module_and_nothing_else() -> None:
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if builds_hosts(p))
    assert modules == [
        "tests/e2e/test_bench_cluster.py", "tests/e2e/test_bench_cluster_comm.py",
        "tests/e2e/test_bench_costmodel.py", "tests/e2e/test_bench_plan_switch.py",
        "tests/e2e/test_slurm.py", "tests/e2e/test_torchrun_hosts.py",
    ]
