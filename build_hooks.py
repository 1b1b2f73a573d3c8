"""Build hook (pyproject.toml ``[tool.setuptools.cmdclass]``): the config tree ships in the wheel.

The repository keeps ``easgd-train``'s Hydra config tree at its top level, ``conf/`` and
``recipes/`` (their one source, no copy committed inside the package). At build time
``build_py`` adds them to the package data, mapped to where an installed package's
``pkg://easgd_lightning.conf`` finds them: ``conf/X`` -> ``easgd_lightning/conf/X`` and
``recipes/X`` -> ``easgd_lightning/conf/recipe/X``. So ``pip wheel .``, ``pip install .``
and a wheel built from the sdist (MANIFEST.in grafts both directories) carry the tree; an
editable install copies nothing and the package reads the checkout's directories. Where the
package looks in each case: :mod:`easgd_lightning.config_tree`.
"""

from __future__ import annotations

from pathlib import Path

from setuptools.command.build_py import build_py

#: (directory at the top level, the package it becomes inside the wheel)
CONFIG_TREES = (("conf", "easgd_lightning.conf"), ("recipes", "easgd_lightning.conf.recipe"))


def tree_files(src: Path) -> list[str]:
    """Every file under ``src``, relative to it, sorted; ``__pycache__`` and compiled files left out."""
    return sorted(str(p.relative_to(src)) for p in src.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"))


class BuildPyWithConfigTree(build_py):
    """``build_py`` whose package data also holds :data:`CONFIG_TREES` (``_get_data_files`` is
    the one list ``build_py`` copies, reports as its outputs, and an editable install maps)."""

    def _get_data_files(self):  # (package, source dir, build dir, files relative to both)
        trees = [(package, src, str(Path(self.build_lib, *package.split("."))), tree_files(Path(src)))
                 for src, package in CONFIG_TREES]
        return [*super()._get_data_files(), *trees]
