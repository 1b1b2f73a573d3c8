"""A worker's side of the parameter server: requests, replies and the end of fit.

:class:`ServerClient` speaks the protocol of :mod:`easgd_lightning.strategies.ps.protocol`
to the server rank; :class:`ServerTransport` is the :class:`CenterTransport` the
strategies hold when a parameter server keeps the center.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from easgd_lightning.comm import get_meter, ops
from easgd_lightning.comm.liveness import CancellableWait, Liveness, interruption
from easgd_lightning.strategies.ps.protocol import (
    HEADER,
    OP_CELASTIC,
    OP_CGRAD,
    OP_DONE,
    OP_ELASTIC,
    OP_GRAD,
    OP_PULL,
    OP_STATE,
    TAG_REP,
    TAG_REP_DATA,
    TAG_REP_STATE,
    TAG_REQ,
    TAG_REQ_DATA,
    from_blob,
)
from easgd_lightning.strategies.ps.shards import merge_states
from easgd_lightning.strategies.ps.transport import CenterTransport

__all__ = ["ServerClient", "ServerTransport", "ShardedTransport"]


class _Pending:
    """A request in flight: its works, the reply buffers and what must stay alive."""

    __slots__ = ("works", "reply_hdr", "reply", "keep", "start")

    def __init__(self, works, reply_hdr, reply, keep) -> None:
        self.works, self.reply_hdr, self.reply, self.keep = works, reply_hdr, reply, keep
        self.start = time.perf_counter()


class ServerClient:
    """A worker's side of the parameter-server protocol.

    Args:
        server_rank: the server's global rank.
        like: a tensor with the flat payload's size, dtype and device.
        world_size: number of ranks (sizes the state reply).
        n_params: leading entries of the payload that are parameters (sizes the momentum).
        kind: meter traffic class.
        liveness: heartbeat reader (used while waiting for the final center).
        header_size: entries of a request header (the server's :func:`request_header_size`).
        interrupted: returns a signal number once this process got SIGTERM (waits stop).
        group: this worker's channel to the server (:func:`~.server.worker_channels`);
            None: the default group.
        peer: the server's rank within ``group`` when it is a pair group (a restarted
            worker's channel, :mod:`~easgd_lightning.strategies.ps.rejoin`); None: global ranks.
    """

    def __init__(
        self,
        server_rank: int,
        like: torch.Tensor,
        world_size: int,
        *,
        n_params: int | None = None,
        kind: str = "parameter_server",
        liveness: Liveness | None = None,
        poll_s: float = 0.1,
        header_size: int = HEADER,
        interrupted: Callable[[], int | None] | None = None,
        group=None,
        peer: int | None = None,
    ) -> None:
        self.server, self.like, self.world = server_rank, like, world_size
        self.group, self.peer = group, peer
        self._channel = {"group": group, "group_peer": peer}  # how every message addresses the server
        #: bytes of the last :meth:`pull_state` (the center and the server's state)
        self.last_state_bytes = 0
        self.n_params = like.numel() if n_params is None else n_params
        self.kind, self.liveness, self.poll_s = kind, liveness, poll_s
        self.header_size, self.interrupted = header_size, interrupted
        self.stop = False
        self.updates = 0

    def _error(self, err: BaseException) -> RuntimeError:
        return RuntimeError(
            f"the parameter server (rank {self.server}) stopped answering: {err}"
        )

    def _header(self, op: int, step: int, lr: float, wd: float, extras: list[float] | None) -> torch.Tensor:
        hdr = torch.zeros(self.header_size, dtype=torch.float64)
        values = [op, step, lr, wd, *(extras or [])]
        hdr[: len(values)] = torch.tensor(values, dtype=torch.float64)
        return hdr

    def begin(self, op: int, payload: torch.Tensor | None, step: int, lr: float = 0.0, wd: float = 0.0,
              extras: list[float] | None = None, dense_reply: bool = True,
              dense_bytes: int | None = None) -> _Pending:
        """Send a request and post the reply receives; returns a handle for :meth:`end`.
        ``dense_reply`` False: the reply is a uint8 message whose length its header gives
        (received in :meth:`end`). ``dense_bytes``: what an uncompressed payload would
        have taken (the meter's ``dense_bytes``; None: the payload is dense)."""
        hdr = self._header(op, step, lr, wd, extras)
        works = [ops.isend(hdr, self.server, kind=self.kind, tag=TAG_REQ, **self._channel)]
        if payload is not None:
            works.append(ops.isend(payload, self.server, kind=self.kind, tag=TAG_REQ_DATA, **self._channel,
                                   dense_bytes=dense_bytes))
        reply_hdr = torch.zeros(HEADER, dtype=torch.float64)
        reply = torch.empty_like(self.like) if dense_reply else None
        works.append(ops.irecv(reply_hdr, self.server, kind=self.kind, tag=TAG_REP, **self._channel))
        if dense_reply:
            works.append(ops.irecv(reply, self.server, kind=self.kind, tag=TAG_REP_DATA, **self._channel))
        return _Pending(works, reply_hdr, reply, (hdr, payload))

    def end(self, pending: _Pending, meter: bool = True) -> torch.Tensor:
        """Wait for a request's reply; returns its payload (and records stop / updates).

        The meter gets the request's whole time, from :meth:`begin`, and as exposed only
        this wait: between ``begin`` and ``end`` the worker computes (SC17 overlap).
        ``meter`` False: the caller charges the time (requests to several servers in flight
        together, :class:`ShardedTransport`)."""
        waited_from = time.perf_counter()
        try:
            for work in pending.works:
                work.wait()
            if pending.reply is None:  # a message whose length the reply header gives
                pending.reply = torch.empty(int(pending.reply_hdr[3]), dtype=torch.uint8)
                ops.recv(pending.reply, self.server, kind=self.kind, tag=TAG_REP_DATA, **self._channel)
        except RuntimeError as err:
            raise self._error(err) from err
        done = time.perf_counter()
        if meter:
            get_meter().add_time(self.kind, done - pending.start, exposed=done - waited_from)
        self.updates = int(pending.reply_hdr[1])
        self.stop = self.stop or bool(pending.reply_hdr[2])
        return pending.reply

    def call(self, op: int, payload: torch.Tensor | None, step: int, lr: float = 0.0, wd: float = 0.0,
             extras: list[float] | None = None) -> torch.Tensor:
        return self.end(self.begin(op, payload, step, lr, wd, extras))

    def push_compressed(self, message: torch.Tensor, step: int, extras: list[float] | None,
                        dense_reply: bool, dense_bytes: int) -> torch.Tensor:
        """``OP_CGRAD``: a compressed push (its byte length in the header's lr entry); the
        reply: the dense center, or (``dense_reply`` False) the server's uint8 message.
        ``dense_bytes``: the size of the uncompressed gradient (metered as dense bytes)."""
        return self.end(self.begin(OP_CGRAD, message, step, lr=float(message.numel()), extras=extras,
                                   dense_reply=dense_reply, dense_bytes=dense_bytes))

    def begin_compressed_elastic(self, message: torch.Tensor, step: int, dense_bytes: int) -> _Pending:
        """``OP_CELASTIC``: a compressed elastic push (its byte length in the header's lr
        entry); :meth:`end` returns the dense elastic difference d."""
        return self.begin(OP_CELASTIC, message, step, lr=float(message.numel()), dense_bytes=dense_bytes)

    def pull(self, step: int) -> torch.Tensor:
        """The server's current center."""
        return self.call(OP_PULL, None, step)

    def pull_state(self, step: int) -> dict:
        """The center and the server's state (for checkpoints)."""
        pending = self.begin(OP_STATE, None, step)
        center = self.end(pending)
        blob = torch.empty(int(pending.reply_hdr[3]), dtype=torch.uint8)
        try:
            ops.recv(blob, self.server, kind=self.kind, tag=TAG_REP_STATE, **self._channel)
        except RuntimeError as err:
            raise self._error(err) from err
        self.last_state_bytes = ops.nbytes(center, blob)
        state = from_blob(blob)
        state["center"] = center.detach().cpu().clone()
        return state

    def finish(self, step: int) -> torch.Tensor:
        """Tell the server this worker is done; wait for (and return) the final center."""
        hdr = self._header(OP_DONE, step, 0.0, 0.0, None)
        reply_hdr = torch.zeros(HEADER, dtype=torch.float64)
        final = torch.empty_like(self.like)
        try:
            ops.send(hdr, self.server, kind=self.kind, tag=TAG_REQ, **self._channel)
            w_hdr = ops.irecv(reply_hdr, self.server, kind=self.kind, tag=TAG_REP, **self._channel)
            w_data = ops.irecv(final, self.server, kind=self.kind, tag=TAG_REP_DATA, **self._channel)
            start = time.perf_counter()
            waiter = CancellableWait()
            for work in (w_hdr, w_data):
                ok = waiter.wait(work, self._server_alive, self.poll_s, keep=(reply_hdr, final))
                if not ok:
                    raise RuntimeError("its heartbeat stopped while this worker waited for the final center")
            get_meter().add_time(self.kind, time.perf_counter() - start)
        except RuntimeError as err:
            raise self._error(err) from err
        self.stop = True
        return final

    def _server_alive(self) -> bool:
        signum = self.interrupted() if self.interrupted is not None else None
        if signum:
            raise interruption(signum, "worker waiting for the final center")
        return self.liveness is None or self.liveness.alive(self.server)


class ServerTransport(CenterTransport):
    """Worker-side exchange through the parameter server."""

    def __init__(self, client: ServerClient, push=None) -> None:
        self.client = client
        #: compressed pushes (:class:`~easgd_lightning.strategies.ps.compressed.WorkerPush`,
        #: or :class:`~easgd_lightning.strategies.ps.compressed.ElasticPush` for the elastic rule)
        self.push = push

    @property
    def stop(self) -> bool:
        return self.client.stop

    def begin_elastic(self, x: torch.Tensor, step: int, lr: float) -> Any:
        if self.push is None:
            return self.client.begin(OP_ELASTIC, x, step, lr)
        message = self.push.encode(x)
        return self.client.begin_compressed_elastic(message, step, dense_bytes=ops.nbytes(x))

    def end_elastic(self, handle: Any) -> torch.Tensor:
        d = self.client.end(handle)
        return d if self.push is None else self.push.apply(d)

    #: the worker's own optimizer does not step: the server steps the user's optimizer
    steps_locally = False

    def push_gradient(self, g: torch.Tensor, step: int, extras: list[float]) -> torch.Tensor:
        if self.push is None:
            return self.client.call(OP_GRAD, g, step, extras=extras)
        message = self.push.encode(g)
        reply = self.client.push_compressed(message, step, extras, dense_reply=not self.push.two_way,
                                            dense_bytes=ops.nbytes(g))
        return self.push.apply(reply).to(device=g.device, dtype=g.dtype)

    def pull(self, step: int) -> torch.Tensor:
        return self.client.pull(step)

    def pull_state(self, step: int) -> dict:
        return self.client.pull_state(step)

    def finish(self, step: int) -> torch.Tensor:
        return self.client.finish(step)


class ShardedTransport(CenterTransport):
    """Worker-side exchange with S parameter servers (``strategy.servers=S``), server j
    holding the contiguous shard ``bounds[j]`` of the flat center
    (:mod:`~easgd_lightning.strategies.ps.shards`).

    Every exchange sends shard j of the payload to server j, all S requests issued before
    waiting on any reply (they travel in parallel, each on its own worker-server channel),
    and concatenates the replies in shard order. A reply of each server is its rule applied
    to its shard, so the whole reply is what one server would return, shard by shard. The
    meter gets one time per exchange (from the first send to the last reply; exposed: the
    wait), not S overlapping ones. Stop: once any server says so.

    Args:
        clients: one :class:`ServerClient` per server, in shard order (``like``: its shard).
        bounds: each shard's ``[lo, hi)`` in the flat center.
        param_ranges: each shard's parameter tensors ``[a, b)`` (the SGD rule's has-gradient
            mask of a request carries only its shard's); None for the elastic rule.
        n_groups: the optimizer's parameter groups (their learning rates lead the extras).
    """

    steps_locally = False

    def __init__(self, clients: list[ServerClient], bounds: list[tuple[int, int]],
                 param_ranges: list[tuple[int, int]] | None = None, n_groups: int = 0) -> None:
        self.clients, self.bounds = clients, bounds
        self.param_ranges, self.n_groups = param_ranges, n_groups
        self.kind = clients[0].kind
        self.push = None  # compressed pushes are not sharded (the strategy refuses them)

    @property
    def stop(self) -> bool:
        return any(c.stop for c in self.clients)

    def _shard_extras(self, extras: list[float] | None, j: int) -> list[float] | None:
        if extras is None or self.param_ranges is None:
            return extras
        a, b = self.param_ranges[j]
        return extras[: self.n_groups] + extras[self.n_groups + a : self.n_groups + b]

    def _begin(self, op: int, payload: torch.Tensor | None, step: int, lr: float = 0.0,
               extras: list[float] | None = None) -> tuple:
        start = time.perf_counter()
        pending = [c.begin(op, None if payload is None else payload[lo:hi], step, lr,
                           extras=self._shard_extras(extras, j))
                   for j, (c, (lo, hi)) in enumerate(zip(self.clients, self.bounds))]
        return start, pending

    def _end(self, handle: tuple) -> torch.Tensor:
        start, pending = handle
        waited_from = time.perf_counter()
        parts = [c.end(p, meter=False) for c, p in zip(self.clients, pending)]
        done = time.perf_counter()
        get_meter().add_time(self.kind, done - start, exposed=done - waited_from)
        return torch.cat(parts)

    def begin_elastic(self, x: torch.Tensor, step: int, lr: float) -> Any:
        return self._begin(OP_ELASTIC, x, step, lr)

    def end_elastic(self, handle: Any) -> torch.Tensor:
        return self._end(handle)

    def push_gradient(self, g: torch.Tensor, step: int, extras: list[float]) -> torch.Tensor:
        return self._end(self._begin(OP_GRAD, g, step, extras=extras))

    def pull(self, step: int) -> torch.Tensor:
        return self._end(self._begin(OP_PULL, None, step))

    def pull_state(self, step: int) -> dict:
        states = [c.pull_state(step) for c in self.clients]
        numels = [c.n_params for c in self.clients]
        return merge_states(states, numels)

    def finish(self, step: int) -> torch.Tensor:
        return torch.cat([c.finish(step) for c in self.clients])
