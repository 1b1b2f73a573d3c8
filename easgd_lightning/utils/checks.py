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
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

__all__ = [
    "is_int",
    "is_number",
    "check_int",
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


def check_int(
    key: str, value: Any, minimum: int | None = 1, maximum: int | None = None, *, nullable: bool = False
) -> int | None:
    """``key`` must be an integer in [``minimum``, ``maximum``] (a bound of None: none).

    Returns:
        ``int(value)`` (or None when ``nullable`` and ``value`` is None).

    Raises:
        ValueError: ``"<key> must be an integer >= 1, got 0"`` (``in [lo, hi]`` with both
        bounds, ``or null`` with ``nullable``).
    """
    if value is None and nullable:
        return None
    ok = is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum)
    if not ok:
        raise _fail(key, _allowed("an integer", minimum, maximum), value, nullable)
    return int(value)


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
    ok = is_number(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
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


def check_choice(key: str, value: Any, choices: Iterable[Any]) -> Any:
    """``key`` must be one of ``choices`` (message: ``one of ['a', 'b']``); returns it."""
    choices = list(choices)
    if value not in choices:
        raise _fail(key, f"one of {choices}", value, False)
    return value
