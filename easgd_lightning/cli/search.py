"""Optuna searches over compression (``hparams_search=compression_optuna`` /
``compression_pareto``, Hydra's Optuna sweeper).

The space (``search.*``): the compressor's name, its main knob -- ``ratio`` (log-uniform in
``search.ratio``) for the sparsifiers, ``rank`` for PowerSGD / ACP-SGD, ``levels`` for
QSGD -- and ``strategy.tau`` (one of ``search.taus``) where the strategy has a period.
The knob is suggested only for the compressor that has it (a conditional space, built by
:func:`compression_space`, the sweeper's ``custom_search_space``).

Objectives (:func:`objective`, what a job returns to the sweeper):

* ``search.objective=val_acc``: the final validation accuracy; a run whose bytes sent per
  worker exceed ``search.bytes_budget`` scores 0 (the budget is a constraint, not a trade);
* ``search.objective=pareto``: (val_acc, bytes sent per worker), maximised and minimised:
  Optuna keeps the Pareto front; ``easgd-report`` draws it (:func:`pareto_front`).
"""

from __future__ import annotations

import math
from typing import Any

from easgd_lightning.utils.checks import (
    check_choice,
    check_int_list,
    check_interval,
    check_positive,
)

__all__ = [
    "OBJECTIVES",
    "knob",
    "searchable",
    "check_search",
    "compression_space",
    "objective",
    "bytes_per_worker",
    "pareto_front",
    "chosen_run",
]

OBJECTIVES = ("val_acc", "pareto")



def knob(name: str) -> str | None:
    """The parameter a search varies for compression ``name``: its class's ``search_knob``
    (``ratio``, ``rank`` or ``levels``; the compressor registry's), None for none or an
    unknown name."""
    from easgd_lightning.hooks.compressors import compressor_class

    try:
        return compressor_class(name).search_knob
    except ValueError:
        return None


def searchable() -> list[str]:
    """The compressions a search may choose: every registered one but the pipeline-only
    codecs (class attribute ``pipeline_only``)."""
    from easgd_lightning.hooks.compressors import compressor_class, compressor_names

    return [n for n in compressor_names() if not compressor_class(n).pipeline_only]


class SearchError(ValueError):
    """A bad ``search.*`` value (the CLI prints it as its one error line)."""


def check_search(search: Any) -> None:
    """Check ``search.*`` before any trial.

    Raises:
        SearchError: one line naming the key and what is allowed.
    """
    if search is None:
        return
    try:
        check_choice("search.objective", search.get("objective"), OBJECTIVES)
        check_positive("search.bytes_budget", search.get("bytes_budget"), nullable=True, unit="bytes")
        check_interval("search.ratio", search.get("ratio"), 0.0, 1.0, lo_open=True)
        for key in ("ranks", "levels", "taus"):
            check_int_list(f"search.{key}", search.get(key), 1)
    except ValueError as err:
        raise SearchError(str(err)) from None
    names = list(search.get("compressions") or [])
    allowed = searchable()
    bad = [n for n in names if n not in allowed]
    if not names or bad:
        raise SearchError(
            f"search.compressions must name compressors, got {bad[0] if bad else names!r}; choose from {', '.join(allowed)}"
        )


def compression_space(cfg: Any, trial: Any) -> None:
    """The sweeper's ``custom_search_space``: suggest the compressor, its knob and tau."""
    search = cfg.search
    name = trial.suggest_categorical("compression", list(search.compressions))
    key = knob(name)
    if key == "ratio":
        lo, hi = search.ratio
        trial.suggest_float(f"compression.{key}", float(lo), float(hi), log=True)
    elif key == "rank":
        trial.suggest_categorical(f"compression.{key}", list(search.ranks))
    elif key is not None:
        trial.suggest_categorical(f"compression.{key}", list(search.levels))
    if "tau" in cfg.strategy:
        trial.suggest_categorical("strategy.tau", list(search.taus))


def bytes_per_worker(summary: dict) -> float | None:
    """Mean over ranks of the payload bytes sent (``comm.bytes_sent``)."""
    sent = [b for b in ((summary.get("comm") or {}).get("bytes_sent") or []) if b is not None]
    return sum(sent) / len(sent) if sent else None


def objective(search: Any, summary: dict | None) -> float | tuple[float, float] | None:
    """What a job returns to the sweeper (module docstring); a failed run scores 0 accuracy
    (and, for the Pareto search, infinite bytes), so the study goes on."""
    if search is None:
        return summary.get("val_acc") if summary else None
    ok = bool(summary) and summary.get("status") == "ok" and summary.get("val_acc") is not None
    acc = float(summary["val_acc"]) if ok else 0.0
    sent = bytes_per_worker(summary) if ok else None
    if search.get("objective") == "pareto":
        return acc, float(sent) if sent is not None else math.inf
    budget = search.get("bytes_budget")
    if budget is not None and (sent is None or sent > float(budget)):
        return 0.0
    return acc


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the (accuracy, bytes) points no other point beats in both (higher
    accuracy and no more bytes, or as accurate with fewer), by increasing bytes."""
    front = []
    for i, (acc, sent) in enumerate(points):
        dominated = any(
            (a >= acc and b <= sent) and (a > acc or b < sent) for j, (a, b) in enumerate(points) if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][1])


def chosen_run(points: list[tuple[float, float]], budget: float | None) -> int | None:
    """The trial a user would deploy: the highest accuracy within the bytes budget (fewer
    bytes on a tie); None when no trial fits."""
    fits = [i for i, (_, sent) in enumerate(points) if budget is None or sent <= budget]
    return max(fits, key=lambda i: (points[i][0], -points[i][1])) if fits else None
