"""Check ``easgd-train``'s command line against the config tree before Hydra runs it.

Left to itself Hydra accepts a key nothing reads (``+trainer.max_epocs=3``, ``++foo=1``),
ignores an unknown option of an optional group (``recipe=bogus``), and reports a missing
option, an unparsable override or a YAML error in a multi-line message with exit status 1.
:func:`check_command_line` composes every job's config with Hydra's compose API first and
turns each of these into a :class:`~easgd_lightning.cli.build.ConfigError`: one line naming
the key (or override) and what is allowed, printed by ``main`` with exit status 2.

Rules:

* an override of a config group (``strategy=NAME``) must name an option of that group;
* every other override must name a key of the config the group choices compose to: a
  leading ``+`` cannot add keys (nothing would read them), and an unknown key's error lists
  the valid keys where it was expected, with the closest one first (``difflib``);
* ``hydra.*`` and ``hydra/...`` overrides are Hydra's own and left to it;
* a key renamed in 0.2 (:mod:`easgd_lightning.utils.renames`) is moved to its new name
  with a warning, and :func:`check_command_line` returns the command line Hydra should run.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from easgd_lightning.config_tree import CONF_DIR
from easgd_lightning.utils.errors import ConfigError
from easgd_lightning.utils.renames import apply_renames, rename_override_line

__all__ = ["check_command_line", "compose_checked", "hydra_settings", "CONF_DIR"]


#: Hydra flags after which nothing is composed or run (help, version, completion).
_NO_RUN_FLAGS = ("help", "hydra_help", "version", "shell_completion", "info")

_MISSING = object()


def _hydra_args(argv: list[str]) -> argparse.Namespace | None:
    """Hydra's own parse of ``argv`` (None when argparse refuses it: Hydra will say why)."""
    from hydra._internal.utils import get_args_parser

    with contextlib.redirect_stderr(io.StringIO()):
        try:
            return get_args_parser().parse_args(argv)
        except SystemExit:
            return None


def _own_tree_args(argv: list[str]) -> argparse.Namespace | None:
    """Hydra's parse of ``argv`` when it composes this package's config tree for a run; None
    when argparse refuses it, for ``--help``-like flags, and with ``--config-path`` /
    ``--config-dir`` (another config tree: Hydra reports its own errors there)."""
    args = _hydra_args(argv)
    if args is None or any(getattr(args, flag, None) for flag in _NO_RUN_FLAGS):
        return None
    if args.config_path or args.config_dir:
        return None
    return args


def check_command_line(argv: list[str], *, conf_dir: str = CONF_DIR,
                       composed: list[tuple[list[str], DictConfig]] | None = None) -> list[str]:
    """Compose and check every job of ``easgd-train ARGV`` (all jobs of a ``-m`` sweep).

    ``composed`` (when given) gains ``(job overrides, composed config)`` for every job, so
    the caller can check every job's values before the first one runs.

    Returns:
        ``argv`` with every renamed key under its new name (Hydra runs that).

    Nothing is checked for ``--help``-like flags or with ``--config-path`` /
    ``--config-dir`` (another config tree: Hydra reports its own errors there).

    Raises:
        ConfigError: one line naming the key or override and what is allowed.
    """
    args = _own_tree_args(argv)
    if args is None:
        return argv
    config_name = args.config_name or "train"
    renamed: dict[str, str] = {}
    for job in _jobs(list(args.overrides), bool(args.multirun), conf_dir, config_name):
        cfg = compose_checked(job, config_name=config_name, conf_dir=conf_dir, renamed=renamed)
        _check_search_space(cfg)  # an Optuna search: its space, before any trial
        if composed is not None:
            composed.append((job, cfg))
    return [_renamed_sweep(arg, renamed) for arg in argv]


def _check_search_space(cfg: DictConfig) -> None:
    from easgd_lightning.cli.search import check_search

    try:
        check_search(cfg.get("search"))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def hydra_settings(argv: list[str], *, conf_dir: str = CONF_DIR) -> dict[str, Any] | None:
    """What Hydra will do with ``easgd-train ARGV``, before it does anything: ``multirun``,
    ``run_dir`` / ``sweep_dir`` (resolved: ``${now:...}`` is evaluated now), ``run_dir_raw`` /
    ``sweep_dir_raw`` (as configured, unresolved), ``launcher`` (the ``hydra/launcher`` choice) and ``runs``
    (False for ``--cfg``-like flags that print and run nothing).

    None when it cannot be known here (``--help``-like flags, another config tree, an
    interpolation only Hydra's own run can resolve): Hydra then goes on as before.
    """
    args = _own_tree_args(argv)
    if args is None:
        return None
    from hydra import compose, initialize_config_dir

    config_name = args.config_name or "train"
    try:
        hydra_lines = [o.input_line for o in _parse(list(args.overrides)) if _is_hydra(o)]
        first = _jobs(list(args.overrides), bool(args.multirun), conf_dir, config_name)[0]  # a config may set hydra.*
        lines = hydra_lines + [line for line in first if line not in hydra_lines]
        with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=lines, return_hydra_config=True)
        hydra = cfg.hydra
        raw = OmegaConf.to_container(hydra.run, resolve=False).get("dir")  # type: ignore[union-attr]
        sweep_raw = OmegaConf.to_container(hydra.sweep, resolve=False).get("dir")  # type: ignore[union-attr]
        return {
            "multirun": bool(args.multirun) or str(hydra.get("mode")).endswith("MULTIRUN"),  # hparams_search
            "runs": not args.cfg,
            "run_dir": None if hydra.run.dir is None else str(hydra.run.dir),
            "run_dir_raw": None if raw is None else str(raw),
            "sweep_dir": None if hydra.sweep.dir is None else str(hydra.sweep.dir),
            "sweep_dir_raw": None if sweep_raw is None else str(sweep_raw),
            "launcher": hydra.runtime.choices.get("hydra/launcher"),
        }
    except Exception:  # noqa: BLE001 - Hydra's own run reports what it cannot compose
        return None


def _renamed_sweep(arg: str, renamed: dict[str, str]) -> str:
    """``arg`` with a renamed key under its new name (a sweep ``k=a,b`` was renamed per job)."""
    if arg in renamed:
        return renamed[arg]
    key = arg.split("=", 1)[0]
    for old, new in renamed.items():
        if old.split("=", 1)[0] == key:
            return new.split("=", 1)[0] + arg[len(key):]
    return arg


def _jobs(overrides: list[str], multirun: bool, conf_dir: str, config_name: str) -> list[list[str]]:
    """The override list of every job (a sweep expanded as Hydra's basic sweeper does)."""
    if not multirun:
        return [overrides]
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        parsed = _parse(overrides, OverridesParser.create(config_loader=loader))
        user = [o for o in parsed if not _is_hydra(o)]
        try:
            batches = BasicSweeper.split_arguments(user, None)
        except Exception as err:  # a sweep kind the basic sweeper refuses: Hydra says so
            raise ConfigError(f"{_first_line(err)}") from err
    return [list(job) for batch in batches for job in batch]


def _parse(overrides: list[str], parser: Any = None) -> list[Any]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = parser or OverridesParser.create()
    parsed = []
    for line in overrides:
        try:
            parsed.extend(parser.parse_overrides([line]))
        except OverrideParseException as err:
            key = line.split("=", 1)[0].lstrip("+~") if "=" in line else line
            raise ConfigError(
                f"{key}: cannot parse the override {line!r} ({_first_line(err)}); quote values "
                "with special characters, e.g. key='a,b' (https://hydra.cc/docs/advanced/override_grammar/basic)"
            ) from err
    return parsed


def _is_hydra(override: Any) -> bool:
    key = override.key_or_group
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


def compose_checked(overrides: list[str], *, config_name: str = "train", conf_dir: str = CONF_DIR,
                    renamed: dict[str, str] | None = None) -> DictConfig:
    """Compose ``config_name`` with ``overrides`` after checking every group option and key.

    Returns:
        The composed config (``hydra.*`` overrides are not applied: they are Hydra's own),
        renamed keys under their new names; ``renamed`` (when given) gains each override
        line that was renamed, mapped to its new line.

    Raises:
        ConfigError: an unknown group option, an unknown key, an unparsable override, or a
            config file that is not valid YAML (one line each).
    """
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    everything = _parse(list(overrides))
    parsed = [o for o in everything if not _is_hydra(o)]
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        _extend_searchpath(loader, everything)
        for o in everything:  # hydra/launcher=NAME: the option must exist too
            if _is_hydra(o) and "/" in o.key_or_group and loader.repository.group_exists(o.key_or_group):
                _check_group_option(loader, o)
        groups = [o for o in parsed if loader.repository.group_exists(o.key_or_group)]
        for o in groups:
            _check_group_option(loader, o)
        reference = _compose(config_name, [o.input_line for o in groups], with_hydra=True)
        choices = dict(reference.hydra.runtime.choices)
        with open_dict(reference):
            del reference["hydra"]
        strategy = OmegaConf.select(reference, "strategy.name", default=None)
        compression = OmegaConf.select(reference, "compression.name", default=None)
        lines = []
        for o in parsed:
            line = o.input_line
            if o not in groups:
                line = rename_override_line(line, o.key_or_group, strategy, compression)
                if line != o.input_line:
                    if renamed is not None:
                        renamed[o.input_line] = line
                    o = _parse([line])[0]
                _check_key(reference, o, choices)
            lines.append(line)
        return apply_renames(_compose(config_name, lines))


def _extend_searchpath(loader: Any, overrides: list[Any]) -> None:
    """``hydra.searchpath=[file:///my/conf, ...]`` adds a user's config directories after the
    package's tree, as Hydra does when it runs: their groups and options are checked too."""
    paths = [o.value() for o in overrides if o.key_or_group == "hydra.searchpath" and not o.is_delete()]
    if not paths or not isinstance(paths[-1], list):
        return
    from hydra._internal.config_repository import ConfigRepository

    elements = loader.config_search_path.get_path()
    schema = elements.pop(-1)  # Hydra keeps structured:// (the schemas) last
    for path in paths[-1]:
        loader.config_search_path.append(provider="hydra.searchpath in command-line", path=str(path))
    elements.append(schema)
    loader.repository = ConfigRepository(config_search_path=loader.config_search_path)


def _compose(config_name: str, overrides: list[str], *, with_hydra: bool = False) -> DictConfig:
    import yaml
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=with_hydra)
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_message(err)) from err
    except (HydraException, OmegaConfBaseException) as err:
        cause = err.__cause__ or err.__context__
        if isinstance(cause, yaml.YAMLError):
            raise ConfigError(_yaml_message(cause)) from err
        raise ConfigError(_hydra_message(err)) from err


def _yaml_message(err: Any) -> str:
    mark = getattr(err, "problem_mark", None)
    where = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}" if mark else "a config file"
    problem = getattr(err, "problem", None) or _first_line(err)
    return f"{where}: not valid YAML ({problem}); fix the file or choose another option"


def _hydra_message(err: BaseException) -> str:
    """Hydra's message in one line (e.g. an ambiguous ``key=a,b`` without ``-m``)."""
    text = " ".join(ln.strip() for ln in str(err).splitlines() if ln.strip())
    if text.startswith("Ambiguous value for argument"):
        arg = text.split("'")[1] if "'" in text else text
        key = arg.split("=", 1)[0]
        return (f"{key}: {arg!r} is a sweep; add --multirun (-m) to run one job per value, "
                f"or write {key}=[a,b] for a list or {key}='a,b' for a string")
    return text


def _options(loader: Any, group: str) -> list[str]:
    """Every option of ``group``, options of its sub-groups as ``sub/name``."""
    from hydra.core.object_type import ObjectType

    names = list(loader.get_group_options(group, results_filter=ObjectType.CONFIG))
    for sub in loader.list_groups(group):
        names += [f"{sub}/{n}" for n in _options(loader, f"{group}/{sub}")]
    return sorted(names)


def _closest(word: str, choices: list[str], prefix: str = "") -> str:
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"did you mean {prefix}{match[0]}? " if match else ""


def _check_group_option(loader: Any, override: Any) -> None:
    group = override.key_or_group
    if override.is_delete() or override.is_sweep_override():
        return
    value = override.value()
    if value is None:  # recipe=null: no option (only optional groups accept it; Hydra checks)
        return
    if not isinstance(value, str) or not loader.repository.config_exists(f"{group}/{value}"):
        options = _options(loader, group)
        raise ConfigError(
            f"{group}={value}: no such option; {_closest(str(value), options)}"
            f"choose one of {', '.join(options)}"
        )


def _select(cfg: DictConfig, key: str) -> Any:
    try:
        return OmegaConf.select(cfg, key, default=_MISSING, throw_on_missing=False)
    except Exception:  # e.g. a key below a value that is not a mapping
        return _MISSING


def _check_key(reference: DictConfig, override: Any, choices: dict[str, Any]) -> None:
    """``override``'s key must exist in ``reference`` (a ``+`` cannot add one)."""
    key = override.key_or_group
    if _select(reference, key) is not _MISSING:
        if override.is_add() and not override.is_force_add():
            raise ConfigError(
                f"{key}: is already a key; write {key}={override.get_value_element_as_str()} "
                "(a leading '+' adds a key, and every valid key exists already)"
            )
        return
    parent, _, leaf = key.rpartition(".")
    while parent and not isinstance(_select(reference, parent), DictConfig):
        parent, _, leaf = parent.rpartition(".")
    node = _select(reference, parent) if parent else reference
    valid = sorted((str(k) for k in node.keys()), key=lambda k: (k.startswith("_"), k))  # _target_ last
    group = parent.split(".")[0]
    choice = choices.get(group) if parent else None
    where = f"{parent} ({group}={choice})" if choice else (parent or "the top level")
    raise ConfigError(
        f"{key}: unknown key; {_closest(leaf, valid, f'{parent}.' if parent else '')}valid keys of {where}: {', '.join(valid)}"
    )
