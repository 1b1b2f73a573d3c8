"""hooks/_fused.py's group state: made from the members' per-tensor states and split back
into them, with a flat tensor per member-sized entry and, for a codec whose rule keeps state
per tensor (``segment_state``), one dict per member."""

from __future__ import annotations

import torch

from easgd_lightning.hooks._fused import _dissolve, group_state
from easgd_lightning.hooks.compressors.segments import SEGMENT_STATES

MEMBERS = (("a", 0, torch.Size([3])), ("b", 3, torch.Size([2, 2])))


def _per_tensor() -> dict:
    return {"a": {"v": torch.tensor([1.0, 2.0, 3.0]), "stages": 2, "achieved": [0.5], "_scratch": {"x": 1}},
            "b": {"v": torch.full((2, 2), 7.0), "stages": 3, "scale": 0.25, "key_hash": 9}}


def test_member_state_of_its_own_is_kept_per_member_and_given_back():
    states = _per_tensor()
    st = group_state(states, "g", MEMBERS, 7, per_segment=True)
    assert set(states) == {"g"}  # the per-tensor states are gone
    assert torch.equal(st["v"], torch.tensor([1.0, 2.0, 3.0, 7.0, 7.0, 7.0, 7.0]))
    assert st[SEGMENT_STATES] == [{"stages": 2, "achieved": [0.5]}, {"stages": 3, "scale": 0.25}]
    st["v"][0] = -1.0
    st[SEGMENT_STATES][1]["stages"] = 4  # the rule moved on
    _dissolve(states, "g")
    assert set(states) == {"a", "b"}
    assert torch.equal(states["a"]["v"], torch.tensor([-1.0, 2.0, 3.0]))
    assert states["a"]["stages"] == 2 and states["a"]["achieved"] == [0.5]
    assert states["b"]["stages"] == 4 and states["b"]["scale"] == 0.25
    assert torch.equal(states["b"]["v"], torch.full((4,), 7.0))


def test_without_state_per_member_the_first_members_entry_stands_for_all():
    states = _per_tensor()
    st = group_state(states, "g", MEMBERS, 7)
    assert SEGMENT_STATES not in st and st["stages"] == 2 and st["scale"] == 0.25
    assert group_state(states, "g", MEMBERS, 7) is st  # made once
