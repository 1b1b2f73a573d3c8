"""Importing the package changes nothing (issue 28, item 5): no exit handler, no garbage
collector tuning, neither torch nor Lightning for ``import easgd_lightning``, no Lightning
for ``easgd_lightning.hooks`` and ``easgd_lightning.comm``; the strategy names still reach
Lightning's registry once Lightning is imported, and the quick exit is registered by what
trains (a strategy's set-up), not by an import. One fresh interpreter (a subprocess): the
test process has imported everything already. Lightning is imported once by a module of
the package, once by the user after the package (the names must reach it either way)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, base_env

# Runs in a fresh interpreter; prints one JSON line. atexit.register is wrapped first, so
# every handler registered from Python is seen with the module that registered it.
PROBE = r"""
import atexit, gc, json, sys

registered = []
_register = atexit.register

def register(func, *args, **kwargs):
    caller = sys._getframe(1).f_globals.get("__name__", "?")
    registered.append([caller, getattr(func, "__module__", None), getattr(func, "__qualname__", repr(func))])
    return _register(func, *args, **kwargs)

atexit.register = register
gc_before = [gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()]
LIGHTNING = ("pytorch_lightning", "lightning_fabric", "lightning")

def loaded(*tops):
    return sorted(m for m in sys.modules if m.split(".")[0] in tops)

def ours():
    return [r for r in registered if r[0].startswith("easgd_lightning")]

out = {}
import easgd_lightning
out["package"] = {"loaded": loaded("torch", *LIGHTNING), "ours": ours()}
import easgd_lightning.hooks, easgd_lightning.comm
out["hooks_comm"] = {"loaded": loaded(*LIGHTNING), "ours": ours(), "any_freeze": [r for r in registered if r[2] == "freeze"],
                     "gc": [gc.isenabled(), gc.get_threshold(), gc.get_freeze_count()] == gc_before}
if sys.argv[1] == "inside":  # Lightning imported by a module of the package (comm.liveness -> compat)
    import easgd_lightning.comm.liveness
else:  # by the user, after the package
    import pytorch_lightning
from pytorch_lightning.strategies import StrategyRegistry
import easgd_lightning.strategies as s
out["lightning"] = {"names": sorted(n for n, spec in s.strategy_specs().items() if StrategyRegistry[n]["strategy"] is spec.cls),
                    "specs": sorted(s.strategy_specs()), "ours": ours()}
from easgd_lightning.comm import ops
ops.close_process_group_at_exit()  # what every strategy's setup_environment calls
out["set_up"] = ours()
print(json.dumps(out))
"""


@pytest.mark.parametrize("lightning_imported", ["inside", "after"])
def test_imports_register_nothing_and_lightning_comes_only_with_the_strategies(lightning_imported: str) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE, lightning_imported], env=base_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # `import easgd_lightning`: neither torch nor Lightning, no exit handler
    assert out["package"] == {"loaded": [], "ours": []}
    # hooks and comm: torch, but no Lightning; nothing at exit, no gc.freeze, gc untouched
    assert out["hooks_comm"] == {"loaded": [], "ours": [], "any_freeze": [], "gc": True}
    # Lightning imported after the package (by one of its modules, or by the user): every
    # strategy name is Lightning's too, and loading them registers nothing at exit either
    assert out["lightning"]["names"] == out["lightning"]["specs"]
    assert {"sync_easgd", "local_sgd", "ddp_compressed"} <= set(out["lightning"]["names"])
    assert out["lightning"]["ours"] == []
    # a strategy's set-up: the process group closed at exit, then every object frozen
    assert out["set_up"] == [
        ["easgd_lightning.utils.procs", "gc", "freeze"],
        ["easgd_lightning.comm.ops", "easgd_lightning.comm.ops", "close_process_group"],
    ]
