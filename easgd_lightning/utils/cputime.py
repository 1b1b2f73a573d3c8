"""CPU time of this machine and of this process, for the training window's CPU figures.

The machine's comes from the first line of Linux's /proc/stat (every core's time by kind:
user, nice, system, idle, iowait, irq, softirq, steal; seconds summed over cores); the
process's from :func:`time.process_time` (every thread of it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["CPU_FIELDS", "cpu_reading", "cpu_delta", "cpu_spent"]

#: the CPU-time fields of /proc/stat's first line, in order
CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _host() -> dict | None:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK")
    values = [int(v) / hz for v in fields] + [0.0] * len(CPU_FIELDS)
    return dict(zip(CPU_FIELDS, values))


def cpu_reading() -> dict:
    """Now: ``host`` (the machine's CPU seconds by kind, None off Linux), ``process_s``
    (this process's CPU seconds) and ``wall_s`` (a monotonic clock)."""
    return {"host": _host(), "process_s": time.process_time(), "wall_s": time.perf_counter()}


def _signed_sum(spans, signs) -> dict:
    """Sum over (start, end) reading pairs of sign * (end - start), field by field (the
    machine's only when every reading has it)."""
    host = None
    if all(a.get("host") and b.get("host") for a, b in spans):
        host = {k: sum(s * (b["host"][k] - a["host"][k]) for s, (a, b) in zip(signs, spans)) for k in CPU_FIELDS}
    return {
        "host": host,
        "process_s": sum(s * (b["process_s"] - a["process_s"]) for s, (a, b) in zip(signs, spans)),
        "wall_s": sum(s * (b["wall_s"] - a["wall_s"]) for s, (a, b) in zip(signs, spans)),
    }


def cpu_delta(end: dict, start: dict, less=()) -> dict:
    """What :func:`cpu_reading` grew by between ``start`` and ``end``, less what it grew by
    within each (start, end) pair of ``less`` that has an end (passes to leave out)."""
    spans = [(start, end)] + [(a, b) for a, b in less if b]
    return _signed_sum(spans, [1.0] + [-1.0] * (len(spans) - 1))


def cpu_spent(spans) -> dict:
    """What :func:`cpu_reading` grew by within each (start, end) pair of ``spans``, summed
    (timed windows with gaps between them)."""
    spans = list(spans)
    return _signed_sum(spans, [1.0] * len(spans))
