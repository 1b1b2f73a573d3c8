"""The compressors, one module each, behind one registry (DESIGN.md 4.3).

``build_compressor(name, **params)`` returns a compressor by its config name; the names
and parameters are those of ``conf/compression/<name>.yaml`` (every yaml key, ``name``
included, is a keyword of :func:`build_compressor`). Unknown names or parameters and
out-of-range values raise :class:`ValueError` naming the ``compression.<key>``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence

from easgd_lightning.hooks.compressors._native import available as native_kernels_available
from easgd_lightning.hooks.compressors.acpsgd import ACPSGDCompressor
from easgd_lightning.hooks.compressors.adaptive import AdaptiveCompressor
from easgd_lightning.hooks.compressors.base import (
    DEFAULT_MIN_NUMEL,
    Collective,
    Compressor,
    Payload,
    tensor_bytes,
)
from easgd_lightning.hooks.compressors.csc import CSCCompressor
from easgd_lightning.hooks.compressors.dgc import DGCCompressor
from easgd_lightning.hooks.compressors.fp16 import BF16Compressor, FP16Compressor
from easgd_lightning.hooks.compressors.gcomp import GCompCompressor
from easgd_lightning.hooks.compressors.lgc import LGCCompressor
from easgd_lightning.hooks.compressors.none import NoneCompressor
from easgd_lightning.hooks.compressors.powersgd import PowerSGDCompressor
from easgd_lightning.hooks.compressors.qsgd import QSGDCompressor
from easgd_lightning.hooks.compressors.randomk import RandomKCompressor
from easgd_lightning.hooks.compressors.redsync import RedSyncCompressor
from easgd_lightning.hooks.compressors.sgc import SGCCompressor
from easgd_lightning.hooks.compressors.sidco import SIDCoCompressor
from easgd_lightning.hooks.compressors.signsgd import SignSGDCompressor
from easgd_lightning.hooks.compressors.sketch import SketchCompressor
from easgd_lightning.hooks.compressors.sparse_gc import SparseGCCompressor
from easgd_lightning.hooks.compressors.sparseloco import SparseLoCoCompressor
from easgd_lightning.hooks.compressors.topk import TopKCompressor
from easgd_lightning.utils.checks import check_bool
from easgd_lightning.utils.renames import renamed_kwargs

__all__ = [
    "ACPSGDCompressor",
    "COMPRESSORS",
    "DEFAULT_MIN_NUMEL",
    "PLUGINS",
    "AdaptiveCompressor",
    "BF16Compressor",
    "CSCCompressor",
    "Collective",
    "Compressor",
    "DGCCompressor",
    "FP16Compressor",
    "GCompCompressor",
    "LGCCompressor",
    "NO_COMPRESSION",
    "NoneCompressor",
    "Payload",
    "PowerSGDCompressor",
    "QSGDCompressor",
    "RandomKCompressor",
    "RedSyncCompressor",
    "SGCCompressor",
    "SIDCoCompressor",
    "SignSGDCompressor",
    "SketchCompressor",
    "SparseGCCompressor",
    "SparseLoCoCompressor",
    "TopKCompressor",
    "build_compressor",
    "compressor_class",
    "compressor_names",
    "native_kernels_available",
    "register_compressor",
    "tensor_bytes",
]

#: ``compression.name`` of no compression (the strategies' own dense exchange)
NO_COMPRESSION = NoneCompressor.name

#: config name -> class
COMPRESSORS: dict[str, type[Compressor]] = {}


def register_compressor(cls: type[Compressor]) -> type[Compressor]:
    """Add ``cls`` under ``cls.name`` (idempotent; usable as a class decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    existing = COMPRESSORS.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"compression name {cls.name!r} already registered by {existing.__name__}")
    COMPRESSORS[cls.name] = cls
    return cls


for _cls in (
    NoneCompressor,
    FP16Compressor,
    BF16Compressor,
    TopKCompressor,
    RandomKCompressor,
    DGCCompressor,
    RedSyncCompressor,
    SIDCoCompressor,
    PowerSGDCompressor,
    QSGDCompressor,
    SignSGDCompressor,
    SketchCompressor,
    AdaptiveCompressor,
    SparseGCCompressor,
    GCompCompressor,
    ACPSGDCompressor,
    SGCCompressor,
    CSCCompressor,
    LGCCompressor,
    SparseLoCoCompressor,
):
    register_compressor(_cls)


#: compressors that live in other modules and register themselves when imported
#: (imported on first use by :func:`build_compressor`).
PLUGINS: dict[str, str] = {"optimus_cc": "easgd_lightning.hooks.optimus_cc"}


def compressor_names() -> list[str]:
    """The config names: registered ones and the plug-ins that register on import."""
    return sorted(set(COMPRESSORS) | set(PLUGINS))


def _lookup(name: str) -> type[Compressor] | None:
    cls = COMPRESSORS.get(name)
    if cls is None and name in PLUGINS:
        import importlib

        importlib.import_module(PLUGINS[name])
        cls = COMPRESSORS.get(name)
    return cls


def _plain(value):
    """OmegaConf containers (ListConfig, DictConfig) to plain Python values."""
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence):
        return [_plain(v) for v in value]
    return value


def compressor_class(name: str | None, target: str | None = None) -> type[Compressor]:
    """The class of compression ``name``, or the class ``target`` names (a dotted path, the
    config's ``_target_``), which must be that class or a subclass of it.

    Raises:
        ValueError: unknown name, or a ``target`` that is not such a class.
    """
    cls = _lookup(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"compression.name must be one of {compressor_names()}, got {name!r}")
    if target is None:
        return cls
    from hydra.utils import get_object

    try:
        own = get_object(str(target))
    except Exception as err:
        raise ValueError(f"compression._target_: cannot import {target!r}") from err
    if not (isinstance(own, type) and issubclass(own, cls)):
        raise ValueError(f"compression._target_: {target!r} is no subclass of {cls.__module__}.{cls.__qualname__}")
    return own


def build_compressor(
    name: str | None = "none",
    *,
    plan: str = "none",
    replan_steps: int = 0,
    max_partitions: int = 8,
    **params,
) -> Compressor:
    """The compressor registered as ``name``, constructed with ``params``.

    Args:
        name: a config name (see :func:`compressor_names`); ``None`` means ``"none"``.
        **params: that compressor's parameters plus ``min_numel`` and ``memory``, and
            ``two_way`` (true: :class:`~easgd_lightning.hooks.compressors.two_way.
            TwoWayCompressor` around it, compressed in both directions), and ``_target_``
            (another class for the name: a subclass of its class, as in a config file).
        plan, replan_steps, max_partitions: the attach point's SeCoPa planner
            (:mod:`easgd_lightning.hooks.planner`): ``plan`` ``none`` (the ``min_numel``
            policy) or ``secopa``; set as attributes of the compressor, read by the DDP hook.

    Raises:
        ValueError: unknown name, unknown parameter, or a value out of range; the
            message names the ``compression.<key>`` and what is allowed.
    """
    from easgd_lightning.hooks.planner import check_plan_options

    check_plan_options(plan, replan_steps, max_partitions)
    compressor = _build(name, **params)
    compressor.plan, compressor.replan_steps, compressor.max_partitions = plan, replan_steps, max_partitions
    return compressor


def _build(name: str | None, **params) -> Compressor:
    if name is None:
        name = "none"
    two_way = check_bool("compression.two_way", params.pop("two_way", False))
    if two_way:
        from easgd_lightning.hooks.compressors.two_way import TwoWayCompressor

        return TwoWayCompressor(_build(name, **params))
    cls = compressor_class(name, params.pop("_target_", None))
    params = renamed_kwargs(params, name, "compression")  # old spellings, warned
    sig = inspect.signature(cls.__init__)
    valid = [p for p in sig.parameters if p != "self"]
    for key in params:
        if key not in valid:
            raise ValueError(
                f"compression.{key} is not a parameter of compression {name!r}; "
                f"valid parameters: {['name', *valid, 'plan', 'replan_steps', 'max_partitions']}"
            )
    return cls(**{k: _plain(v) for k, v in params.items()})
