"""Seeded random kills (``faults.kill_every_s``): the launcher's fault injector under ``ft=torchft``.

Modelled on torchft's "punisher" (a process that kills a random replica group now and then
while a run goes on), made reproducible and bounded:

* a kill is due every ``every_s`` seconds, counted from the moment every worker has joined
  its first exchange (before that a kill would only test start-up), then from the last kill;
* the victim is drawn with ``random.Random(seed)`` among the *eligible* workers: running,
  not stopped, joined in their current start, with a restart left -- and only while every
  unfinished worker is so (at most one worker is down at a time, so there is always a peer
  to recover from). A kill that is due while nobody is eligible waits until someone is;
* the signal is SIGKILL (what a preempted node or the OOM killer does), sent by pid from
  outside, as a cluster would.

The same draw is used by the bench (``bench/ft_faults.py``) on workers it started itself.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from easgd_lightning.utils.checks import check_positive

__all__ = ["Punisher"]


class Punisher:
    """When a kill is due and whom it falls on (no process handling here: pure)."""

    def __init__(self, every_s: float, seed: int) -> None:
        self.every_s = check_positive("faults.kill_every_s", every_s, unit="seconds")
        self.rng = random.Random(seed)
        self.next_at: float | None = None  # set once every worker has joined
        self.kills: list[dict] = []  # {"rank", "t"} per kill sent

    def arm(self, now: float) -> None:
        """Start the clock (every worker has joined its first exchange); idempotent."""
        if self.next_at is None:
            self.next_at = now + self.every_s

    def pick(self, now: float, eligible: Sequence[int], all_up: bool) -> int | None:
        """The rank to kill now, or None (not armed, not due yet, or nobody may be killed:
        ``all_up`` false means a worker is down or rejoining)."""
        if self.next_at is None or now < self.next_at or not all_up or not eligible:
            return None
        rank = self.rng.choice(sorted(eligible))
        self.next_at = now + self.every_s
        self.kills.append({"rank": rank, "t": now})
        return rank
