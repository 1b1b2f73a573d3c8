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

import functools
from pathlib import Path

import pytest

TIERS = {"unit": "unit", "distributed": "distributed", "e2e": "e2e"}
#: tests that build emulated hosts (network namespaces behind one bridge per run, private
#: subnets) or a local SLURM cluster: with ``pytest -n 2`` (``make test``) they all run on one
#: worker, one after the other, never two clusters at once, and are handed out first (the
#: longest group); every other test runs on the worker of its module (a module's fixtures,
#: often a whole multi-rank run shared by its tests, are built once). pytest-xdist's own
#: ``--dist loadgroup`` cannot carry this under pytest 9 (it renames ``item._nodeid``, which
#: pytest 9 no longer reads), so the grouping is this file's scheduler,
#: :func:`pytest_xdist_make_scheduler`.
HOSTS_GROUP = "emulated_hosts"


def builds_hosts(module: Path) -> bool:
    """Whether a test module builds emulated hosts (a ``netns`` test) or a SLURM cluster."""
    return module.name == "test_slurm.py" or "pytest.mark.netns" in module.read_text()


@functools.cache
def _module_scope(module: str, root: Path) -> str:
    path = root / module
    return HOSTS_GROUP if path.is_file() and builds_hosts(path) else module


def scope_of(nodeid: str, root: Path) -> str:
    """The unit of work a test belongs to under pytest-xdist: :data:`HOSTS_GROUP` or its module."""
    return _module_scope(nodeid.split("::", 1)[0], root)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Load scheduling by :func:`scope_of` (``pytest -n N`` with the default or ``--dist
    loadgroup`` distribution; other modes are xdist's own)."""
    if config.getoption("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid, config.rootpath)

    config.option.loadscopereorder = False  # the collection's order (emulated hosts first)
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    for item in items:
        try:
            part = Path(str(item.path)).relative_to(root).parts[0]
        except ValueError:
            continue
        if part in TIERS:
            item.add_marker(TIERS[part])
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the emulated hosts' group first
        hosts = {path: builds_hosts(path) for path in {Path(str(i.path)) for i in items}}
        items.sort(key=lambda i: not hosts[Path(str(i.path))])
