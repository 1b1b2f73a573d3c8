"""``faults.kill_every_s``'s draw (easgd_lightning/ft/punisher.py): when a kill is due and
whom it falls on, against an independent replay of the rule with ``random.Random``."""

from __future__ import annotations

import random

import pytest

from easgd_lightning.ft.punisher import Punisher

pytestmark = pytest.mark.unit


def test_kills_are_every_interval_after_arming_and_seeded() -> None:
    p = Punisher(every_s=5.0, seed=7)
    assert p.pick(100.0, [0, 1, 2], all_up=True) is None  # not armed: the workers have not all joined
    p.arm(10.0)
    p.arm(12.0)  # idempotent: the clock starts at the first arming
    assert p.pick(14.9, [0, 1, 2], all_up=True) is None
    ref = random.Random(7)
    picks, t = [], 15.0
    for _ in range(6):
        assert p.pick(t - 0.01, [2, 0, 1], all_up=True) is None  # not due yet
        picks.append(p.pick(t, [2, 0, 1], all_up=True))
        t += 5.0
    assert picks == [ref.choice([0, 1, 2]) for _ in range(6)]
    assert [k["t"] for k in p.kills] == [15.0, 20.0, 25.0, 30.0, 35.0, 40.0]


def test_a_due_kill_waits_until_every_worker_is_up_and_restarts_from_it() -> None:
    p = Punisher(every_s=5.0, seed=0)
    p.arm(0.0)
    assert p.pick(6.0, [0, 2], all_up=False) is None  # worker 1 is down or rejoining
    assert p.pick(7.0, [], all_up=True) is None  # nobody has a restart left
    victim = p.pick(9.0, [1], all_up=True)
    assert victim == 1
    assert p.pick(13.9, [0, 1, 2], all_up=True) is None  # the next one is 5 s after the kill, not after 5.0
    assert p.pick(14.0, [0, 1, 2], all_up=True) is not None


def test_a_nonpositive_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="faults.kill_every_s"):
        Punisher(every_s=0, seed=0)
