"""One vocabulary of option checks, one message style (pure functions, no torch).

Every check takes the option's full public key (``strategy.tau``, ``compression.ratio``,
``data.batch_size``) and its value, returns the value normalised (``int`` / ``float`` /
``bool``), and otherwise raises a ``ValueError`` of one line::

    <key> must be <what is allowed>, got <value!r>

e.g. ``strategy.tau must be an integer >= 1, got 0``.

The rules shared by every check:

* A bool is never a number: ``True`` / ``False`` are refused where an integer or a number
  is asked for, and only a bool is accepted where ``true or false`` is.
* A string is never a number, not even ``"0.5"``: Hydra and YAML already turn ``0.5`` into a
  float, so a string there is a quoted value by mistake.
* An integer is an ``int`` (or an integral numpy scalar); ``2.0`` is not an integer.
* A number is a real ``int`` / ``float`` (numpy scalars included) and never NaN; infinity is
  whatever the bounds say (``a number > 0`` accepts it).
* ``nullable=True`` accepts ``None`` (returned as is) and adds ``or null`` to the message.
* A list is any iterable but a string or a mapping (an OmegaConf ``ListConfig`` too), and is
  returned as a ``list``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "is_int",
    "is_number",
    "check_int",
    "check_int_or_fraction",
    "check_int_list",
    "check_number_list",
    "check_interval",
    "check_float",
    "check_positive",
    "check_ratio",
    "check_momentum",
    "check_bool",
    "check_choice",
]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer: an ``int`` or integral numpy scalar, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """Whether ``value`` is a real number that is not NaN (ints and floats, not bools or strings)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def _fail(key: str, allowed: str, value: Any, nullable: bool) -> ValueError:
    return ValueError(f"{key} must be {allowed}{' or null' if nullable else ''}, got {value!r}")


def _bound(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _allowed(what: str, lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    """``what`` with its bounds: ``in [lo, hi)``, ``> lo``, ``<= hi``, ... (None: no bound)."""
    if lo is not None and hi is not None:
        return f"{what} in {'(' if lo_open else '['}{_bound(lo)}, {_bound(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{what} {'>' if lo_open else '>='} {_bound(lo)}"
    if hi is not None:
        return f"{what} {'<' if hi_open else '<='} {_bound(hi)}"
    return what


def _in_range(value: Any, lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> bool:
    """Whether the number ``value`` lies between ``lo`` and ``hi`` (None: no bound)."""
    if lo is not None and not (value > lo if lo_open else value >= lo):
        return False
    return hi is None or (value < hi if hi_open else value <= hi)


def check_int(
    key: str,
    value: Any,
    minimum: int | None = 1,
    maximum: int | None = None,
    *,
    nullable: bool = False,
    also: tuple[int, ...] = (),
) -> int | None:
    """``key`` must be an integer in [``minimum``, ``maximum``] (a bound of None: none), or
    one of the integers ``also`` (a sentinel such as -1 for "no limit").

    Returns:
        ``int(value)`` (or None when ``nullable`` and ``value`` is None).

    Raises:
        ValueError: ``"<key> must be an integer >= 1, got 0"`` (``in [lo, hi]`` with
            both bounds, ``or -1`` for each of ``also``, ``or null`` with ``nullable``).
    """
    if value is None and nullable:
        return None
    ok = is_int(value) and (value in also or _in_range(value, minimum, maximum))
    if not ok:
        extra = "".join(f" or {a}" for a in also)
        raise _fail(key, _allowed("an integer", minimum, maximum) + extra, value, nullable)
    return int(value)


def check_int_or_fraction(key: str, value: Any, minimum: int = 1, *, nullable: bool = False) -> int | float | None:
    """``key`` must be a count (an integer >= ``minimum``) or a fraction (a float in (0, 1]),
    as Lightning's ``limit_*_batches``: ``1`` is one batch, ``1.0`` all of them.

    Raises:
        ValueError: ``"<key> must be an integer >= 1 or a fraction in (0, 1], got 1.5"``.
    """
    if value is None and nullable:
        return None
    if is_int(value) and value >= minimum:
        return int(value)
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return value
    raise _fail(key, f"an integer >= {minimum} or a fraction in (0, 1]", value, nullable)


def _as_list(value: Any) -> list | None:
    """``value`` as a list if it is one (any iterable but a string, bytes or a mapping)."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        return None
    return list(value)


def _check_list(
    key: str, value: Any, kind: tuple[Any, str, type], lo: float | None, nullable: bool, allow_empty: bool
) -> list | None:
    """``value`` as a list of ``kind`` = (predicate, plural name, cast), each >= ``lo``."""
    if value is None and nullable:
        return None
    is_kind, what, cast = kind
    items = _as_list(value)
    if items is None or (not items and not allow_empty) or not all(is_kind(v) and _in_range(v, lo, None) for v in items):
        raise _fail(key, f"{'a' if allow_empty else 'a non-empty'} list of {_allowed(what, lo, None)}", value, nullable)
    return [cast(v) for v in items]


def check_int_list(
    key: str, value: Any, minimum: int | None = 1, *, nullable: bool = False, allow_empty: bool = False
) -> list[int] | None:
    """``key`` must be a non-empty list (empty too with ``allow_empty``) of integers >=
    ``minimum``; ``"<key> must be a non-empty list of integers >= 1, got [0]"``."""
    return _check_list(key, value, (is_int, "integers", int), minimum, nullable, allow_empty)


def check_number_list(
    key: str, value: Any, lo: float | None = None, *, nullable: bool = False, allow_empty: bool = False
) -> list[float] | None:
    """``key`` must be a non-empty list (empty too with ``allow_empty``) of numbers >= ``lo``;
    ``"<key> must be a list of numbers >= 0 or null, got [-1]"``."""
    return _check_list(key, value, (is_number, "numbers", float), lo, nullable, allow_empty)


def check_interval(
    key: str, value: Any, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False
) -> tuple[float, float]:
    """``key`` must be ``[low, high]``: two numbers with ``lo <= low < high <= hi``
    (``<`` at an open end).

    Raises:
        ValueError: ``"<key> must be [low, high] with 0 < low < high <= 1, got [0.5, 0.1]"``.
    """
    pair = _as_list(value)
    ok = pair is not None and len(pair) == 2 and all(is_number(v) for v in pair)
    ok = ok and pair[0] < pair[1] and _in_range(pair[0], lo, hi, lo_open, hi_open)
    ok = ok and _in_range(pair[1], lo, hi, lo_open, hi_open)
    if not ok:
        allowed = (f"[low, high] with {_bound(lo)} {'<' if lo_open else '<='} low < high "
                   f"{'<' if hi_open else '<='} {_bound(hi)}")
        raise _fail(key, allowed, pair if pair is not None else value, False)
    return float(pair[0]), float(pair[1])


def check_float(
    key: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    nullable: bool = False,
    unit: str = "",
) -> float | None:
    """``key`` must be a number between ``lo`` and ``hi`` (closed ends unless ``lo_open`` /
    ``hi_open``; a bound of None: none).

    Args:
        unit: named in the message (``"seconds"``: ``a number of seconds > 0``).

    Returns:
        ``float(value)`` (or None when ``nullable`` and ``value`` is None).

    Raises:
        ValueError: ``"<key> must be a number in [0, 1), got 1.5"`` (``> lo`` / ``>= lo`` /
        ``< hi`` / ``<= hi`` with one bound, ``or null`` with ``nullable``).
    """
    if value is None and nullable:
        return None
    if not (is_number(value) and _in_range(value, lo, hi, lo_open, hi_open)):
        raise _fail(key, _allowed(f"a number of {unit}" if unit else "a number", lo, hi, lo_open, hi_open), value, nullable)
    return float(value)


def check_positive(
    key: str, value: Any, *, allow_zero: bool = False, nullable: bool = False, unit: str = ""
) -> float | None:
    """``key`` must be a number > 0 (>= 0 with ``allow_zero``); see :func:`check_float`."""
    return check_float(key, value, 0.0, lo_open=not allow_zero, nullable=nullable, unit=unit)


def check_ratio(key: str, value: Any, *, allow_one: bool = True) -> float:
    """``key`` must be a fraction in (0, 1] (in (0, 1) without ``allow_one``)."""
    return check_float(key, value, 0.0, 1.0, lo_open=True, hi_open=not allow_one)


def check_momentum(key: str, value: Any) -> float:
    """``key`` must be a momentum factor: a number in [0, 1) (0: no momentum). Bools and
    numeric strings are refused, as by every number check here."""
    return check_float(key, value, 0.0, 1.0, hi_open=True)


def check_bool(key: str, value: Any) -> bool:
    """``key`` must be true or false: a bool, not 0 / 1 or a string like ``"yes"``."""
    if not isinstance(value, bool):
        raise _fail(key, "true or false", value, False)
    return value


def check_choice(key: str, value: Any, choices: Iterable[Any], *, nullable: bool = False) -> Any:
    """``key`` must be one of ``choices`` (message: ``one of ['a', 'b']``); returns it."""
    if value is None and nullable:
        return None
    choices = list(choices)
    if value not in choices:
        raise _fail(key, f"one of {choices}", value, nullable)
    return value
