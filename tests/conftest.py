"""The test tiers, applied by directory (markers registered in pyproject.toml):

- ``unit``: tests/unit, in-process (pure math, validation, one process at most);
- ``distributed``: tests/distributed, real gloo ranks in subprocesses, a few seconds each;
- ``e2e``: tests/e2e, the real ``easgd-train`` CLI and the bench harness;
- ``slow``: long runs (convergence, sweeps, fault injection), marked in the files.

``make test`` runs every tier; ``make test-fast`` runs ``(unit or distributed) and not slow``.
The helpers (compose, the CLI's one error line, rank launchers) are in tests/helpers.py,
which the table scripts (``python -m tests.feature_matrix``) import outside pytest.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TIERS = {"unit": "unit", "distributed": "distributed", "e2e": "e2e"}
#: tests that build emulated hosts (network namespaces behind one bridge per run, private
#: subnets) or a local SLURM cluster: with ``pytest -n 2`` (``TEST_WORKERS=2 make test``) they all run on one
#: worker, one after the other (``--dist loadgroup``), never two clusters at once; every other
#: test runs on the worker of its module (a module's fixtures, often a whole multi-rank run
#: shared by its tests, are built once)
HOSTS_GROUP = "emulated_hosts"


def _xdist_groups(items: list[pytest.Item], root: Path) -> dict[Path, str]:
    """Each test module's ``xdist_group``: :data:`HOSTS_GROUP` for a module with a ``netns``
    test and for the SLURM tests, else the module's own path."""
    hosts = {Path(str(i.path)) for i in items
             if i.get_closest_marker("netns") is not None or Path(str(i.path)).name == "test_slurm.py"}
    groups = {}
    for path in {Path(str(i.path)) for i in items}:
        try:
            own = str(path.relative_to(root))
        except ValueError:
            own = str(path)
        groups[path] = HOSTS_GROUP if path in hosts else own
    return groups


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    groups = _xdist_groups(items, root)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[Path(str(item.path))]))
        try:
            part = Path(str(item.path)).relative_to(root).parts[0]
        except ValueError:
            continue
        if part in TIERS:
            item.add_marker(TIERS[part])
