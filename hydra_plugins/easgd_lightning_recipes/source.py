"""A checkout's ``recipes/`` directory as Hydra's config group ``recipe``.

In a checkout (and an editable install) ``easgd-train``'s config tree is two top-level
directories: ``conf/`` (``train.yaml`` and its groups) and ``recipes/`` (``imagenet/``,
``nlp3d/``: the options of the group ``recipe``). A wheel holds both as one tree (its build
copies ``recipes/`` to ``easgd_lightning/conf/recipe/``); a checkout has no directory in
which ``recipes/`` is named ``recipe/``, so Hydra's file search path alone cannot find
``recipe=imagenet/alexnet_knl``. Two plugins fill that gap, found by Hydra's plugin scan:

* :class:`RecipesSearchPath`: when Hydra's primary config directory is the ``conf/`` of
  an easgd-lightning checkout (beside it ``recipes/`` and ``easgd_lightning/config_tree.py``),
  it adds ``easgd-recipes://CHECKOUT/recipes`` right after it; any other Hydra app, and an
  installed wheel (primary ``pkg://easgd_lightning.conf``), is left alone.
* :class:`RecipesConfigSource` (scheme ``easgd-recipes``): shows that directory's
  contents under ``recipe/`` and nothing else.

Nothing here imports ``easgd_lightning`` (the scan runs in every Hydra app of the
environment).
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath, SearchPathQuery
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

#: the config group the recipes are options of (``recipe=imagenet/alexnet_knl``)
GROUP = "recipe"
SCHEME = "easgd-recipes"
PROVIDER = "easgd-lightning recipes"


def checkout_recipes(main: str) -> Path | None:
    """``CHECKOUT/recipes`` when the search path entry ``main`` is the directory
    ``CHECKOUT/conf`` of an easgd-lightning checkout, else None."""
    path = main.removeprefix("file://")
    if "://" in path:
        return None
    conf = Path(path)
    root = conf.parent
    if conf.name != "conf" or not (root / "easgd_lightning" / "config_tree.py").is_file():
        return None
    return root / "recipes" if (root / "recipes").is_dir() else None


class RecipesSearchPath(SearchPathPlugin):
    """Adds a checkout's ``recipes/`` after its ``conf/`` (:func:`checkout_recipes`)."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        mains = [e.path for e in search_path.get_path() if e.provider == "main"]
        recipes = checkout_recipes(mains[-1]) if mains else None
        entry = f"{SCHEME}://{recipes}"
        if recipes is not None and all(e.path != entry for e in search_path.get_path()):
            search_path.append(PROVIDER, entry, anchor=SearchPathQuery(provider="main"))


class RecipesConfigSource(ConfigSource):
    """A directory shown as the group ``recipe``: ``recipe/X/Y.yaml`` is ``DIR/X/Y.yaml``;
    the root holds the group ``recipe`` only."""

    @staticmethod
    def scheme() -> str:
        return SCHEME

    def _local(self, config_path: str) -> Path | None:
        """The file or directory of ``config_path`` (None: outside the group ``recipe``)."""
        parts = config_path.strip("/").split("/")
        if parts[0] != GROUP:
            return None
        return Path(self.path, *parts[1:])

    def load_config(self, config_path: str) -> ConfigResult:
        local = self._local(self._normalize_file_name(config_path))
        if local is None or not local.is_file():
            raise ConfigLoadError(f"Config not found : {config_path}")
        header = ConfigSource._get_header_dict(local.read_text(encoding="utf-8")[:512])
        return ConfigResult(config=OmegaConf.load(local), path=self.full_path(), provider=self.provider,
                            header=header)

    def available(self) -> bool:
        return Path(self.path).is_dir()

    def is_group(self, config_path: str) -> bool:
        if config_path.strip("/") == "":
            return True
        local = self._local(config_path)
        return local is not None and local.is_dir()

    def is_config(self, config_path: str) -> bool:
        local = self._local(self._normalize_file_name(config_path))
        return local is not None and local.is_file()

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        if config_path.strip("/") == "":
            return [GROUP] if results_filter in (None, ObjectType.GROUP) else []
        local = self._local(config_path)
        files: list[str] = []
        for child in sorted(local.iterdir()) if local is not None and local.is_dir() else ():
            self._list_add_result(files=files, file_path=f"{config_path.strip('/')}/{child.name}",
                                  file_name=child.name, results_filter=results_filter)
        return sorted(set(files))
