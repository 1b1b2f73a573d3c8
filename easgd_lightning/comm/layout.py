"""How a dense all-reduce travels: fused buffers (lazy all-reduce) and, optionally,
hierarchical reduction over the nodes (the ``comm`` config group).

Hierarchical reduction (``hierarchy="node"``; GradientFlow's multi-level all-reduce, SC17's
KNL "divide and conquer"): the processes of a node first reduce to the node's leader (its
lowest rank) over the node's own fast path, the leaders all-reduce among themselves over
the network, and each leader broadcasts the sum inside its node::

    s_n = sum_{i in node n} x_i          reduce to leader(n)       (intra-node)
    s   = sum_n s_n                      all-reduce, leaders only  (inter-node)
    x_i <- s                             broadcast from leader(n)  (intra-node)

Only one process per node puts the buffer on the inter-node link, instead of every
process. The sum is the same as the flat all-reduce's up to the order of floating-point
additions ((a + b) + (c + d) for 2 nodes x 2 processes), identical on every rank.

Nodes: ``procs_per_node`` consecutive ranks when given (for tests on one machine), else
``LOCAL_WORLD_SIZE`` consecutive ranks (torchrun's layout), else the ranks that share a
host name. Sub-groups of the default process group are made once per layout
(``dist.new_group`` is collective: every rank creates every group, in the same order).

The three phases of one buffer run in order on one background thread per layout, so a
non-blocking all-reduce (Sync EASGD's overlap, CoCoD-SGD, the DDP hook) stays
non-blocking; the buffers of an exchange go through that thread in launch order, the same
on every rank. Metered per phase under the caller's ``kind`` (one message each), with no
exposed time: the caller charges its wait (:func:`easgd_lightning.comm.ops.wait`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from easgd_lightning.comm import ops
from easgd_lightning.comm.fusion import DEFAULT_FUSION_MB, fusion_buckets, fusion_threshold
from easgd_lightning.comm.meter import get_meter
from easgd_lightning.utils.checks import check_choice, check_float, check_int

__all__ = ["ALLREDUCES", "AGGREGATORS", "HIERARCHIES", "CommLayout", "NodeGroups", "node_ranks"]

#: accepted values of ``comm.hierarchy``
HIERARCHIES = ("flat", "node")
#: accepted values of ``comm.allreduce`` (strategy=ddp's dense hook): gloo's ring, or the
#: emulated in-network aggregator (:mod:`easgd_lightning.comm.switch`)
ALLREDUCES = ("ring", "switch")
#: accepted values of ``comm.aggregator``: who starts the switch's aggregator process
AGGREGATORS = ("rank0", "external")


def node_ranks(world: int, procs_per_node: int) -> list[list[int]]:
    """Consecutive blocks of ``procs_per_node`` ranks (torchrun's rank layout)."""
    if procs_per_node < 1 or world % procs_per_node:
        raise ValueError(
            f"comm.procs_per_node: {procs_per_node} does not divide the {world} processes into nodes"
        )
    return [list(range(n, n + procs_per_node)) for n in range(0, world, procs_per_node)]


def _detect_nodes(world: int, procs_per_node: int | None, group=None) -> list[list[int]]:
    """The nodes' ranks: ``procs_per_node``, else ``LOCAL_WORLD_SIZE``, else host names."""
    if procs_per_node is not None:
        return node_ranks(world, procs_per_node)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and int(local) >= 1 and world % int(local) == 0:
        return node_ranks(world, int(local))
    hosts = ops.all_gather_object(socket.gethostname(), group=group)
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    return sorted(nodes.values())


class _Job:
    """One buffer's hierarchical all-reduce in flight: a torch future resolved by the
    layout's thread with ``[tensor]`` (the shape of ``ops.all_reduce_async``'s)."""

    __slots__ = ("tensor", "kind", "future")

    def __init__(self, tensor: torch.Tensor, kind: str) -> None:
        self.tensor, self.kind = tensor, kind
        self.future: torch.futures.Future = torch.futures.Future()


class NodeGroups:
    """The sub-groups of a hierarchical all-reduce and the thread that runs it.

    Args:
        nodes: each node's global ranks (together: every rank once).
        rank: this process's global rank.
    """

    def __init__(self, nodes: Sequence[Sequence[int]], rank: int) -> None:
        self.nodes = [list(n) for n in nodes]
        self.rank = rank
        self.leaders = [n[0] for n in self.nodes]
        self.node = next(n for n in self.nodes if rank in n)
        self.leader = self.node[0]
        self.intra = None
        for n in self.nodes:  # collective: every rank creates every group, in order
            g = dist.new_group(ranks=n) if len(n) > 1 else None
            if rank in n:
                self.intra = g
        self.inter = dist.new_group(ranks=self.leaders) if len(self.leaders) > 1 else None
        self._queue: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    # ------------------------------------------------------------------ the reduction
    def reduce_(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        """The three phases on ``tensor`` (in place, blocking); metered with no exposed time."""
        size = ops.nbytes(tensor)
        meter = get_meter()
        k = len(self.node)
        if self.intra is not None:
            start = time.perf_counter()
            dist.reduce(tensor, dst=self.leader, group=self.intra)
            sent, recv = (0, size * (k - 1)) if self.is_leader else (size, 0)
            meter.record(kind, sent=sent, recv=recv, dense=sent, seconds=time.perf_counter() - start, exposed=0.0)
        if self.inter is not None and self.is_leader:
            start = time.perf_counter()
            dist.all_reduce(tensor, group=self.inter)
            meter.record(kind, sent=size, recv=size, seconds=time.perf_counter() - start, exposed=0.0)
        if self.intra is not None:
            start = time.perf_counter()
            dist.broadcast(tensor, src=self.leader, group=self.intra)
            sent, recv = (size * (k - 1), 0) if self.is_leader else (0, size)
            meter.record(kind, sent=sent, recv=recv, dense=sent, seconds=time.perf_counter() - start, exposed=0.0)
        return tensor

    def reduce_async(self, tensor: torch.Tensor, kind: str) -> torch.futures.Future:
        """:meth:`reduce_` on the layout's thread; the future resolves to ``[tensor]``."""
        job = _Job(tensor, kind)
        with self._cv:
            if self._closed:
                raise RuntimeError("comm.hierarchy=node: the node groups are closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="easgd-hierarchy", daemon=True)
                self._thread.start()
            self._queue.append(job)
            self._cv.notify()
        return job.future

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
            try:
                self.reduce_(job.tensor, job.kind)
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                job.future.set_exception(err)
            else:
                job.future.set_result([job.tensor])

    def close(self) -> None:
        """Stop the thread once its queue is empty (the groups die with the default group)."""
        with self._cv:
            self._closed = True
            self._cv.notify()


class _Buckets:
    """The bucket all-reduces of one buffer in flight; ``wait()`` returns the buffer."""

    def __init__(self, flat: torch.Tensor, futures: list) -> None:
        self._flat, self._futures = flat, futures

    def wait(self) -> torch.Tensor:
        for fut in self._futures:
            fut.wait()
        return self._flat


class CommLayout:
    """The ``comm`` config group: how dense all-reduces travel.

    Args:
        fusion_mb: lazy all-reduce buffer size in MiB (>= 0; 0 = one message per tensor).
        hierarchy: ``flat`` (one all-reduce over every rank) or ``node`` (reduce inside the
            node, all-reduce among node leaders, broadcast inside the node).
        procs_per_node: processes per node for ``hierarchy=node`` (None: ``LOCAL_WORLD_SIZE``,
            else the host names).
        allreduce: ``ring`` (gloo's all-reduce) or ``switch`` (strategy=ddp's dense buckets
            summed by the emulated in-network aggregator, :mod:`easgd_lightning.comm.switch`;
            not with ``hierarchy=node``).
        aggregator: who starts the switch's aggregator process: ``rank0`` (beside itself)
            or ``external`` (bench/cluster.py --aggregator switch).

    Raises:
        ValueError: a bad value, naming its ``comm.`` key.
    """

    def __init__(
        self,
        fusion_mb: float = DEFAULT_FUSION_MB,
        hierarchy: str = "flat",
        procs_per_node: int | None = None,
        allreduce: str = "ring",
        aggregator: str = "rank0",
    ) -> None:
        check_float("comm.fusion_mb", fusion_mb, 0.0, unit="MiB")  # 0: no fusion
        check_choice("comm.hierarchy", hierarchy, HIERARCHIES)
        check_int("comm.procs_per_node", procs_per_node, nullable=True)
        check_choice("comm.allreduce", allreduce, ALLREDUCES)
        check_choice("comm.aggregator", aggregator, AGGREGATORS)
        if allreduce == "switch" and hierarchy == "node":
            raise ValueError("comm.allreduce: switch sums every process's bucket itself; it does not combine with comm.hierarchy=node")
        self.fusion_mb = float(fusion_mb)
        self.hierarchy = hierarchy
        self.procs_per_node = procs_per_node
        self.allreduce = allreduce
        self.aggregator = aggregator
        self.node: NodeGroups | None = None
        self.nodes_used: list | None = None  # the nodes of the last setup (kept after close, for the summary)

    @property
    def fusion_bytes(self) -> int:
        return fusion_threshold(self.fusion_mb)

    def __repr__(self) -> str:
        return (
            f"CommLayout(fusion_mb={self.fusion_mb:g}, hierarchy={self.hierarchy!r}, "
            f"procs_per_node={self.procs_per_node!r}, allreduce={self.allreduce!r}, aggregator={self.aggregator!r})"
        )

    def as_dict(self) -> dict:
        out = {"fusion_mb": self.fusion_mb, "hierarchy": self.hierarchy, "procs_per_node": self.procs_per_node}
        if self.allreduce != "ring":
            out |= {"allreduce": self.allreduce, "aggregator": self.aggregator}
        if self.nodes_used is not None:
            out["nodes"] = self.nodes_used
        return out

    def check_world(self, world_size: int) -> None:
        """Before launch: ``procs_per_node`` divides the processes."""
        if self.hierarchy == "node" and self.procs_per_node is not None:
            node_ranks(world_size, self.procs_per_node)

    def setup(self) -> None:
        """Make the node sub-groups (``hierarchy=node``; collective, every rank, once)."""
        if self.hierarchy != "node" or not dist.is_initialized():
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        if self.node is not None and sum(map(len, self.node.nodes)) == world and self.node.rank == rank:
            return
        self.node = NodeGroups(_detect_nodes(world, self.procs_per_node), rank)
        self.nodes_used = self.node.nodes

    def close(self) -> None:
        if self.node is not None:
            self.node.close()
            self.node = None

    # ------------------------------------------------------------------ all-reduce
    def all_reduce_async(self, tensor: torch.Tensor, *, kind: str, group=None) -> torch.futures.Future:
        """Sum ``tensor`` over the ranks in place, non-blocking: the future resolves to
        ``[tensor]`` (hierarchically with ``hierarchy=node``, only on the default group)."""
        if self.node is not None and group is None:
            return self.node.reduce_async(tensor, kind)
        return ops.all_reduce_async(tensor, kind=kind, group=group)

    def all_reduce_flat_async(
        self, flat: torch.Tensor, numels: Sequence[int] | None, *, kind: str, group=None
    ) -> _Buckets:
        """Sum the flat buffer ``flat`` (the tensors of ``numels``, one after the other)
        over the ranks in place, as lazy all-reduce buckets of views of it; ``wait()``
        (charge it with :func:`easgd_lightning.comm.ops.wait`) returns ``flat``.
        ``numels=None``: the buffer is one tensor."""
        flat1 = flat.reshape(-1)
        sizes = [flat1.numel()] if numels is None else list(numels)
        if sum(sizes) != flat1.numel():
            raise ValueError(f"all_reduce_flat_async: numels cover {sum(sizes)} elements, the buffer has {flat1.numel()}")
        item = flat1.element_size()
        futures, offsets = [], [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        for first, end in fusion_buckets([n * item for n in sizes], self.fusion_bytes):
            view = flat1[offsets[first] : offsets[end]]
            futures.append(self.all_reduce_async(view, kind=kind, group=group))
        return _Buckets(flat, futures)

    def all_reduce_flat(self, flat: torch.Tensor, numels: Sequence[int] | None, *, kind: str, group=None) -> torch.Tensor:
        """Blocking :meth:`all_reduce_flat_async` (the whole time is exposed)."""
        return ops.wait(self.all_reduce_flat_async(flat, numels, kind=kind, group=group), kind=kind)


def build_comm_layout(layout: CommLayout | dict | None) -> CommLayout:
    """A :class:`CommLayout` from itself, its keyword dict, or None (the defaults)."""
    if isinstance(layout, CommLayout):
        return layout
    return CommLayout(**dict(layout or {}))


__all__ += ["build_comm_layout"]
