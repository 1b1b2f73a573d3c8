"""easgd-lightning: communication-efficient distributed training for PyTorch Lightning.

Importing the package changes nothing and imports neither torch nor Lightning: it
registers no exit handler, tunes no garbage collector, and its subpackages load when they
are first used (``import easgd_lightning.hooks``, or ``easgd_lightning.hooks`` as an
attribute).

Lightning learns the strategy names, so ``pl.Trainer(strategy="sync_easgd")`` works after
``import easgd_lightning``, in either order of the two imports: :mod:`.strategies`
registers every name with Lightning's ``StrategyRegistry`` when it loads, and this module
loads it at once when ``pytorch_lightning`` is imported already, else as soon as
``pytorch_lightning`` has been imported and no module of this package is half-way through
its own code (an import hook, :class:`_AfterLightning`, removed when it has done so).
Lightning's own ``"ddp"`` is left untouched.

What a training process does at its exit (the process group closed, every object frozen
so that the interpreter's shutdown is quick) is done by the processes that train: the
strategies' ``setup_environment``, the ``easgd-train`` launcher and its ranks
(:func:`easgd_lightning.utils.procs.freeze_at_exit`).
"""

from __future__ import annotations

import importlib
import sys
import threading
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

__version__ = "0.1.0"
__all__ = ["__version__"]

#: the subpackages and modules reachable as attributes of the package (loaded on first use)
_SUBMODULES = frozenset({
    "callbacks", "cli", "comm", "compat", "config_tree", "data", "fabric", "ft", "guards", "hooks", "models",
    "parallel", "strategies", "utils",
})
_LIGHTNING = "pytorch_lightning"


def __getattr__(name: str) -> ModuleType:
    """``easgd_lightning.NAME`` for a subpackage not imported yet: imported now."""
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})


def _register_with_lightning() -> None:
    """Load :mod:`.strategies`, which registers every name with Lightning's registry (a
    strategies package being loaded right now registers them when it is done)."""
    if f"{__name__}.strategies" not in sys.modules:
        importlib.import_module(f"{__name__}.strategies")


class _AfterLightning(MetaPathFinder):
    """Finds no module itself; it watches the loading of ``pytorch_lightning`` and of this
    package's modules (how many of them are executing, per thread). Once Lightning has
    loaded and no module of the package is half-way through its own code (one of them may
    be what imported Lightning, and the strategies import it), it removes itself from
    ``sys.meta_path`` and calls :func:`_register_with_lightning`."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lightning_loaded = False

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        if fullname != _LIGHTNING and not fullname.startswith(f"{__name__}."):
            return None
        spec = self._spec_of_the_others(fullname, path, target)
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            self._watch(loader, lightning=fullname == _LIGHTNING)
        return spec

    def _spec_of_the_others(self, fullname: str, path, target) -> ModuleSpec | None:
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is not self and find is not None:
                spec = find(fullname, path, target)
                if spec is not None:
                    return spec
        return None

    def _watch(self, loader, *, lightning: bool) -> None:
        """Wrap this one load: count it while it runs, then restore the loader's method."""
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            depth = getattr(self._local, "depth", 0)
            self._local.depth = depth if lightning else depth + 1
            try:
                run(module)
            finally:
                self._local.depth = depth
                del loader.exec_module  # the loader's own method again
            self._lightning_loaded = self._lightning_loaded or lightning
            if self._lightning_loaded and depth == 0 and self in sys.meta_path:
                sys.meta_path.remove(self)
                _register_with_lightning()

        loader.exec_module = exec_module


if _LIGHTNING in sys.modules:
    _register_with_lightning()
elif not any(type(f).__name__ == _AfterLightning.__name__ for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterLightning())
