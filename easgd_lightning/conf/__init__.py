"""``easgd-train``'s config tree, shipped inside the package.

Hydra finds it as ``pkg://easgd_lightning.conf`` (the primary config ``train.yaml`` and the
groups ``strategy/``, ``compression/``, ``model/``, ``data/``, ``trainer/``, ``logger/``,
``hydra/launcher/`` and ``recipe/``), so an installed ``easgd-train`` runs from any
directory. A user's own config directory extends it with
``hydra.searchpath=[file:///path/to/my_conf]`` (README, "Your own configs").
"""

from pathlib import Path

__all__ = ["CONF_DIR", "CONF_PACKAGE"]

#: The tree as Hydra's package search path.
CONF_PACKAGE = "pkg://easgd_lightning.conf"
#: The same tree as a directory on disk (the checker of the command line composes from it).
CONF_DIR = str(Path(__file__).resolve().parent)
