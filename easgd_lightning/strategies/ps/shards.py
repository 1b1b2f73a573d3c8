"""A sharded center (``strategy.servers=S``): where the flat center is cut, and one state
from the S servers' states. Pure functions, no I/O.

The center (the flattened parameters, then the floating-point buffers) is cut into S
contiguous shards, shard j held by server rank ``world - S + j``; each server applies the
unchanged per-request rule to its shard, so the rule per shard is the rule of one server.

* **Elastic rule** (``async_easgd``, ``async_measgd``): ``d = alpha (x - c); c <- c + d`` is
  elementwise, so the cut is at equal numel (``k * N // S``): every server carries the same
  bytes, whatever the layer sizes (a model of one large layer is still split evenly).
* **SGD rule** (``async_sgd``, ``async_msgd``): the server steps the user's optimizer, whose
  state and arithmetic are per parameter tensor (Adam's step count, a per-tensor norm in
  other optimizers), so the cut is parameter-aligned: at the parameter boundary nearest
  ``k * N / S`` (each shard at least one parameter tensor; the buffers go with the last).
  Each server keeps the user's whole optimizer and steps only its shard's parameters (the
  others get no gradient, which ``torch.optim`` skips), so the step of a parameter is the
  one a single server would take.
"""

from __future__ import annotations

import torch

__all__ = ["equal_bounds", "aligned_bounds", "shard_bounds", "merge_states"]


def equal_bounds(total: int, servers: int) -> list[tuple[int, int]]:
    """``servers`` contiguous ranges of ``[0, total)`` of equal numel (the first ones one
    entry longer when it does not divide): shard j is ``[j*N//S, (j+1)*N//S)``."""
    edges = [j * total // servers for j in range(servers + 1)]
    return list(zip(edges[:-1], edges[1:]))


def aligned_bounds(sizes: list[int], total: int, servers: int) -> list[tuple[int, int]]:
    """``servers`` contiguous ranges of ``[0, total)`` whose inner edges fall on the
    boundaries of the tensors of ``sizes`` (the parameters; ``total`` minus their sum is the
    buffers' tail, which goes with the last range): edge k is the parameter boundary nearest
    ``k * sum(sizes) / servers`` that leaves every range at least one tensor.

    Raises:
        ValueError: fewer tensors than ``servers`` (naming ``strategy.servers``).
    """
    if len(sizes) < servers:
        raise ValueError(f"strategy.servers={servers}: the SGD rule cuts the center at parameter boundaries and "
                         f"the model has {len(sizes)} parameter tensors; choose strategy.servers <= {len(sizes)}")
    ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]  # the boundary after tensor i
    n_params = ends[-1] if ends else 0
    edges, last = [0], -1
    for k in range(1, servers):
        target = k * n_params / servers
        # tensor boundaries still free: after the previous edge's tensor, leaving one tensor per later range
        lo, hi = last + 1, len(sizes) - (servers - k) - 1
        i = min(range(lo, hi + 1), key=lambda j: (abs(ends[j] - target), j))
        edges.append(ends[i])
        last = i
    edges.append(total)
    return list(zip(edges[:-1], edges[1:]))


def shard_bounds(rule: str, sizes: list[int], total: int, servers: int) -> list[tuple[int, int]]:
    """The S ranges of the flat center (module docstring): equal numel for the elastic rule,
    parameter-aligned for the SGD rule. ``servers`` 1: the whole center."""
    if servers == 1:
        return [(0, total)]
    if rule == "sgd":
        return aligned_bounds(sizes, total, servers)
    return equal_bounds(total, servers)


def _elementwise_max(lists: list[list | None]) -> list[int] | None:
    present = [list(v) for v in lists if v is not None]
    if not present:
        return None
    width = max(len(v) for v in present)
    return [max(int(v[i]) if i < len(v) else 0 for v in present) for i in range(width)]


def merge_states(states: list[dict], param_numels: list[int]) -> dict:
    """One center state from the S servers' states (each as :meth:`ParameterServer.state_dict`
    plus its shard ``center``), in shard order.

    ``center``: the shards concatenated. ``updates``, ``served``, ``worker_steps``: the
    largest over the shards (every request goes to every shard: they agree but for the
    requests in flight). ``optimizer``: each server's user optimizer holds state only for
    its own parameters (keyed by their index in the whole optimizer), so the states' union
    with the shared ``param_groups`` is the whole optimizer's. ``momentum``: the shards'
    flat buffers concatenated, zeros for a shard without any (``param_numels``: each
    shard's parameter entries); None when no shard has one. ``shards``: the states as given.
    """
    merged: dict = {"center": torch.cat([s["center"].reshape(-1) for s in states]), "shards": list(states)}
    merged["updates"] = max((int(s.get("updates") or 0) for s in states), default=0)
    for key in ("served", "worker_steps"):
        merged[key] = _elementwise_max([s.get(key) for s in states])
    optims = [s.get("optimizer") for s in states if s.get("optimizer") is not None]
    merged["optimizer"] = None if not optims else {
        "state": {k: v for o in optims for k, v in o["state"].items()}, "param_groups": optims[0]["param_groups"]}
    moms = [s.get("momentum") for s in states]
    like = next((m for m in moms if m is not None), None)
    merged["momentum"] = None if like is None else torch.cat(
        [m.reshape(-1) if m is not None else torch.zeros(n, dtype=like.dtype) for m, n in zip(moms, param_numels)])
    return merged
