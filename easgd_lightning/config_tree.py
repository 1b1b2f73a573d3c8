"""Where ``easgd-train``'s Hydra config tree is, in each kind of install.

The tree has one source: two top-level directories of the repository, ``conf/``
(``train.yaml`` and the groups ``strategy/``, ``compression/``, ``model/``, ...) and
``recipes/`` (``imagenet/``, ``nlp3d/``: the options of the group ``recipe``, so
``recipe=imagenet/alexnet_knl`` is ``recipes/imagenet/alexnet_knl.yaml``).

Rule (:func:`locate`): the package's own ``conf/`` when it holds ``train.yaml``, else the
checkout's beside the package directory.

* **Installed wheel**: the build (``build_hooks.py``) copies ``conf/`` into the package as
  ``easgd_lightning/conf/`` and ``recipes/`` as ``easgd_lightning/conf/recipe/``: one tree,
  which Hydra reads as ``pkg://easgd_lightning.conf``. Nothing of a checkout is read.
* **Editable install** (``pip install -e .``, ``make venv``) and **a checkout on
  PYTHONPATH**: the package is imported from ``CHECKOUT/easgd_lightning``, which holds no
  ``conf/``; Hydra reads ``CHECKOUT/conf`` as a directory, and the Hydra plugin
  :mod:`hydra_plugins.easgd_lightning_recipes` adds ``CHECKOUT/recipes`` to the search path
  as the group ``recipe`` whenever that directory is Hydra's primary config directory.

A user's own directory extends the tree in every case with
``hydra.searchpath=[file:///path/to/my_conf]`` (README, "Your own configs").
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

__all__ = ["CONF_DIR", "CONF_PATH", "RECIPES_DIR", "ConfigTree", "group_dir", "locate"]

#: Hydra's name for the tree inside an installed wheel.
CONF_PACKAGE = "pkg://easgd_lightning.conf"


class ConfigTree(NamedTuple):
    """Where the tree is: ``conf_dir`` (``train.yaml`` and the groups, on disk),
    ``config_path`` (what Hydra's ``@hydra.main`` is given) and ``recipes_dir`` (the
    options of the group ``recipe``)."""

    conf_dir: Path
    config_path: str
    recipes_dir: Path


def locate(package_dir: Path) -> ConfigTree:
    """The config tree of the package in ``package_dir``.

    ``package_dir/conf/train.yaml`` (an installed wheel): ``pkg://easgd_lightning.conf``,
    recipes in ``conf/recipe/``. Else ``package_dir/../conf/train.yaml`` (an editable install
    or a checkout): that directory, recipes in ``../recipes/``.

    Raises:
        FileNotFoundError: neither exists (one line naming both places).
    """
    packaged = package_dir / "conf"
    if (packaged / "train.yaml").is_file():
        return ConfigTree(packaged, CONF_PACKAGE, packaged / "recipe")
    checkout = package_dir.parent
    if (checkout / "conf" / "train.yaml").is_file():
        return ConfigTree(checkout / "conf", str(checkout / "conf"), checkout / "recipes")
    raise FileNotFoundError(
        f"easgd-lightning's config tree is missing: neither {packaged / 'train.yaml'} (an installed "
        f"wheel) nor {checkout / 'conf' / 'train.yaml'} (an editable install or a checkout) exists"
    )


_TREE = locate(Path(__file__).resolve().parent)
#: ``train.yaml`` and the groups, a directory on disk (the command-line checker composes from it).
CONF_DIR = str(_TREE.conf_dir)
#: The tree as Hydra's ``config_path`` (``pkg://easgd_lightning.conf`` or ``CONF_DIR``).
CONF_PATH = _TREE.config_path
#: The options of the group ``recipe`` (``imagenet/``, ``nlp3d/``).
RECIPES_DIR = str(_TREE.recipes_dir)


def group_dir(group: str) -> Path:
    """The directory of a config group's options: ``RECIPES_DIR`` for ``recipe``, else
    ``CONF_DIR/group`` (``strategy``, ``hydra/launcher``, ...)."""
    return Path(RECIPES_DIR) if group == "recipe" else Path(CONF_DIR, group)
