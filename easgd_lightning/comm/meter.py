"""CommMeter: per-rank accounting of communicated bytes and time.

The meter only observes. Every collective or point-to-point call in the project goes
through :mod:`easgd_lightning.comm.ops`, which records, per call:

* ``bytes_sent`` / ``bytes_recv`` -- the payload this rank contributed / received. For a
  collective this is the logical message (what a compressor shrinks), not the
  algorithm-dependent wire traffic of a ring or tree; for point-to-point it is the tensor.
* ``dense_bytes`` -- what the same exchange would have cost uncompressed (equal to
  ``bytes_sent`` unless a compressor reports otherwise).
* ``time_s`` -- wall time spent inside communication (blocking calls) or from launch to
  completion (asynchronous calls).
* ``exposed_s`` -- the part of that time the training loop actually waited: equal to
  ``time_s`` for a blocking call, the time spent waiting on the handle for an
  asynchronous one (:func:`easgd_lightning.comm.ops.wait`). Communication hidden behind
  computation counts in ``time_s`` but not in ``exposed_s``, so ``exposed_s <= time_s``
  up to timer resolution.

* ``calls`` -- messages: one per collective or point-to-point operation this rank took
  part in (a lazy all-reduce bucket, each phase of a hierarchical all-reduce, each round
  of a variable-length all-gather). ``messages`` is their total over the payload kinds
  (every kind but :data:`CONTROL_KINDS`); ``summary.json`` divides it by the steps.

Each record carries a ``kind`` (``data_parallel``, ``elastic``, ``parameter_server``,
``pipeline``, ``tensor_parallel``, ``embedding``, ...) so summaries can break traffic down.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import asdict, dataclass, field

__all__ = ["CONTROL_KINDS", "CommMeter", "KindTotals", "get_meter", "reset_meter"]

#: kinds that carry no training payload (set-up broadcasts, stop flags, loss reports):
#: not counted in ``messages``
CONTROL_KINDS = ("setup", "control")


@dataclass
class KindTotals:
    """Totals for one kind of traffic."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    dense_bytes: int = 0
    time_s: float = 0.0
    exposed_s: float = 0.0
    calls: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


#: the totals a meter sums over its kinds (its properties of the same names)
_SUMMED = ("bytes_sent", "bytes_recv", "dense_bytes", "time_s", "exposed_s")


def _summed(name: str) -> property:
    """A read-only property: the sum of the :class:`KindTotals` field ``name`` over the kinds."""
    return property(lambda self: sum(getattr(t, name) for t in self.by_kind.values()),
                    doc=f"``{name}`` summed over every kind.")


@dataclass
class CommMeter:
    """Thread-safe byte and time counters, one instance per process."""

    by_kind: dict[str, KindTotals] = field(default_factory=lambda: defaultdict(KindTotals))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(
        self,
        kind: str,
        *,
        sent: int = 0,
        recv: int = 0,
        dense: int | None = None,
        seconds: float = 0.0,
        exposed: float | None = None,
    ) -> None:
        """Add one communication event.

        ``exposed`` is the part of ``seconds`` the caller waited (default: all of it, a
        blocking call); an asynchronous call records ``exposed=0`` here and its wait
        with :meth:`add_exposed`.
        """
        with self._lock:
            totals = self.by_kind[kind]
            totals.bytes_sent += int(sent)
            totals.bytes_recv += int(recv)
            totals.dense_bytes += int(sent if dense is None else dense)
            totals.time_s += float(seconds)
            totals.exposed_s += float(seconds if exposed is None else exposed)
            totals.calls += 1

    def add_time(self, kind: str, seconds: float, exposed: float | None = None) -> None:
        """Add time without bytes (e.g. waiting on an asynchronous result).

        ``exposed`` defaults to ``seconds``: time added here was waited for.
        """
        with self._lock:
            totals = self.by_kind[kind]
            totals.time_s += float(seconds)
            totals.exposed_s += float(seconds if exposed is None else exposed)

    def add_exposed(self, kind: str, seconds: float) -> None:
        """Add waiting time on an asynchronous call whose total time is recorded
        separately (at its completion)."""
        with self._lock:
            self.by_kind[kind].exposed_s += float(seconds)

    bytes_sent = _summed("bytes_sent")
    bytes_recv = _summed("bytes_recv")
    dense_bytes = _summed("dense_bytes")
    time_s = _summed("time_s")
    exposed_s = _summed("exposed_s")

    @property
    def messages(self) -> int:
        """Messages of the payload kinds (every kind but :data:`CONTROL_KINDS`)."""
        return sum(t.calls for k, t in self.by_kind.items() if k not in CONTROL_KINDS)

    def snapshot(self) -> dict:
        """A JSON-ready dict of the totals and the per-kind breakdown."""
        with self._lock:
            return {
                **{name: getattr(self, name) for name in _SUMMED},
                "messages": self.messages,
                "by_kind": {k: v.as_dict() for k, v in sorted(self.by_kind.items())},
            }

    def reset(self) -> None:
        with self._lock:
            self.by_kind.clear()


_METER = CommMeter()


def get_meter() -> CommMeter:
    """The process-wide meter."""
    return _METER


def reset_meter() -> CommMeter:
    """Clear the process-wide meter and return it."""
    _METER.reset()
    return _METER
