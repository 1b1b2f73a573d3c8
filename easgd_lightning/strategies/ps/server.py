"""The parameter server: first-come-first-served service of worker requests.

The server receives request headers from *any source*, so it serves whichever worker
arrives first, never in rank order, and never waits for all workers. It applies the elastic
rule or steps the user's optimizer (:mod:`easgd_lightning.strategies.ps.rules`) and
replies to that one worker (:mod:`easgd_lightning.strategies.ps.protocol`). While waiting
for a request it checks the workers' heartbeats (:mod:`easgd_lightning.comm.liveness`): a
worker whose heartbeat stops is declared dead and the server goes on without it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.optim import Optimizer

from easgd_lightning.comm import get_meter, ops
from easgd_lightning.comm.liveness import CancellableWait, Liveness, interruption
from easgd_lightning.compat import lightning as compat
from easgd_lightning.strategies.ps import rules
from easgd_lightning.strategies.ps.protocol import (
    OP_CGRAD,
    OP_DONE,
    OP_ELASTIC,
    OP_FINAL,
    OP_GRAD,
    OP_PULL,
    OP_STATE,
    TAG_REP,
    TAG_REP_DATA,
    TAG_REP_STATE,
    TAG_REQ,
    TAG_REQ_DATA,
    request_header_size,
    split_request_extras,
    to_blob,
)

log = logging.getLogger(__name__)

__all__ = ["ParameterServer"]


class ParameterServer:
    """The server loop: first-come-first-served service of worker requests.

    Args:
        rank: this (server) rank.
        workers: the worker ranks.
        center: the flat center / shared weights (updated in place).
        n_params: how many leading entries of ``center`` are parameters (the rest are
            floating-point buffers, which SGD requests overwrite instead of stepping).
        rule: ``"elastic"`` (Async EASGD) or ``"sgd"`` (Async SGD/MSGD).
        alpha: moving rate of the elastic rule.
        lr: fixed server learning rate of every parameter group (None: the ones each request
            carries, i.e. the requesting worker's current learning rates).
        optimizer: the user's optimizer, stepped by the SGD rule (required for it). Its
            parameters are ``params``, which the server binds to views of ``center`` so that
            ``optimizer.step()`` moves the center; the server holds the optimizer's state.
        params: the parameter tensors of ``optimizer``, in the center's order.
        lockfree: apply updates on a thread pool without a lock (Hogwild on a server):
            concurrent updates race with each other (elastic rule; the optimizer's steps run
            one at a time, its state is not thread-safe) and with the replies' reads.
        interrupted: returns a signal number once this process got SIGTERM (serving stops).
        liveness: heartbeat reader used while waiting.
        stop_policy: ``"first"``: tell everyone to stop once one worker is done.
        kind: meter traffic class.
        on_checkpoint: ``fn(state_dict)`` called every ``checkpoint_every_s`` and at the end.
        poll_s: how often liveness is checked while waiting.
        replies: compressed pushes (``OP_CGRAD``) and, two-way, compressed replies with one
            replica per worker (:class:`~easgd_lightning.strategies.ps.compressed.ServerReplies`).
    """

    def __init__(
        self,
        *,
        rank: int,
        workers: list[int],
        center: torch.Tensor,
        n_params: int,
        rule: str,
        alpha: float = 0.0,
        lr: float | None = None,
        optimizer: Optimizer | None = None,
        params: list[torch.Tensor] | None = None,
        lockfree: bool = False,
        liveness: Liveness | None = None,
        stop_policy: str = "first",
        kind: str = "parameter_server",
        on_checkpoint: Callable[[dict], None] | None = None,
        checkpoint_every_s: float | None = None,
        poll_s: float = 0.1,
        log_size: int = 2000,
        interrupted: Callable[[], int | None] | None = None,
        replies=None,
    ) -> None:
        if rule not in ("elastic", "sgd"):
            raise ValueError(f"rule must be 'elastic' or 'sgd', got {rule!r}")
        if rule == "sgd" and (optimizer is None or params is None):
            raise ValueError("the SGD rule steps the user's optimizer: pass optimizer= and params=")
        self.rank, self.workers, self.center = rank, list(workers), center
        self.n_params, self.rule, self.alpha = n_params, rule, alpha
        self.lr, self.lockfree = lr, lockfree
        self.liveness, self.stop_policy, self.kind = liveness, stop_policy, kind
        self.on_checkpoint, self.checkpoint_every_s, self.poll_s = on_checkpoint, checkpoint_every_s, poll_s
        world = max(workers + [rank]) + 1
        self.updates = 0
        self.served = [0] * world
        self.worker_steps = [0] * world
        self.optimizer, self.params = optimizer, list(params or [])
        if optimizer is not None:
            rules.bind_views(self.params, center)
        self.header_size = request_header_size(optimizer, self.params)
        self.interrupted = interrupted
        self.replies = replies
        if replies is not None and (rule != "sgd" or lockfree):
            raise ValueError("compressed pushes need the SGD rule without lockfree application")
        self.active: set[int] = set(workers)
        self.done: list[int] = []
        self.dead: list[int] = []
        self.stop = False
        self.service_log: deque = deque(maxlen=log_size)
        self._waiter = CancellableWait()
        workers_n = 1 if optimizer is not None else 2  # an optimizer's state is not thread-safe
        self._pool = ThreadPoolExecutor(max_workers=workers_n, thread_name_prefix="easgd-hogwild") if lockfree else None
        self._last_ckpt = time.monotonic()
        self.started = self.finished = None

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """Update counts and the optimizer's state (``momentum``: SGD's buffers, flat, if any)."""
        return {
            "updates": self.updates,
            "served": list(self.served),
            "worker_steps": list(self.worker_steps),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "momentum": None if self.optimizer is None else rules.momentum_buffers(self.optimizer, self.params),
        }

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state.get("updates", 0))
        for key in ("served", "worker_steps"):
            values = list(state.get(key) or [])
            getattr(self, key)[: len(values)] = [int(v) for v in values]
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    # ---------------------------------------------------------------- rules
    def _apply(self, op: int, payload: torch.Tensor, hdr: torch.Tensor) -> torch.Tensor:
        """Apply one request to the center; returns the reply payload."""
        if op == OP_ELASTIC:
            if self._pool is None:
                return rules.server_elastic_update(self.center, payload, self.alpha)
            diff = (payload - self.center).mul_(self.alpha)  # racy read of c, on purpose
            self._pool.submit(self.center.add_, diff)
            return diff
        grad = payload if self._pool is None else payload.clone()
        lrs, mask = split_request_extras(hdr, len(self.optimizer.param_groups))
        if self.lr is not None:
            lrs = [self.lr] * len(lrs)

        def step() -> None:
            rules.optimizer_step_on(self.optimizer, self.params, grad[: self.n_params], mask, lrs)
            self.center[self.n_params :].copy_(grad[self.n_params :])

        if self._pool is None:
            step()
        else:
            self._pool.submit(step)
        return self.center.clone()

    # ---------------------------------------------------------------- loop
    def _keep_waiting(self) -> bool:
        signum = self.interrupted() if self.interrupted is not None else None
        if signum:
            self._maybe_checkpoint(force=True)
            raise interruption(signum, f"parameter server (rank {self.rank})")
        self._maybe_checkpoint()
        if self.liveness is None:
            return True
        for r in sorted(self.active):
            if not self.liveness.alive(r):
                log.warning("parameter server: worker %d stopped sending heartbeats; going on without it", r)
                self.active.discard(r)
                self.dead.append(r)
        return bool(self.active)

    def _reply(self, dst: int, op: int, payload: torch.Tensor | None, extra: float = 0.0) -> bool:
        hdr = torch.tensor([op, self.updates, float(self.stop), extra], dtype=torch.float64)
        try:
            ops.send(hdr, dst, kind=self.kind, tag=TAG_REP)
            if payload is not None:
                ops.send(payload, dst, kind=self.kind, tag=TAG_REP_DATA)
        except RuntimeError as err:  # the peer's connection closed: it died
            self._lost(dst, err)
            return False
        return True

    def _lost(self, r: int, err: BaseException) -> None:
        log.warning("parameter server: lost worker %d (%s)", r, err)
        self.active.discard(r)
        if r not in self.dead:
            self.dead.append(r)

    def serve(self) -> None:
        """Serve requests until every worker is done or dead, then send the final center."""
        self.started = time.time()
        self._maybe_checkpoint(force=True)
        payload = torch.empty_like(self.center)
        while self.active:
            self._maybe_checkpoint()
            hdr = torch.zeros(self.header_size, dtype=torch.float64)
            start = time.perf_counter()
            work = ops.irecv(hdr, src=None, kind=self.kind, tag=TAG_REQ)
            if not self._waiter.wait(work, self._keep_waiting, self.poll_s, keep=hdr):
                break
            get_meter().add_time(self.kind, time.perf_counter() - start)
            sender = compat.source_rank(work)
            op, step = int(hdr[0]), int(hdr[1])
            if sender in self.dead:  # it was only slow
                self.dead.remove(sender)
                if sender not in self.done:
                    self.active.add(sender)
            self.worker_steps[sender] = max(self.worker_steps[sender], step)
            try:
                if op in (OP_ELASTIC, OP_GRAD):
                    ops.recv(payload, src=sender, kind=self.kind, tag=TAG_REQ_DATA)
                    reply = self._apply(op, payload, hdr)
                    self.updates += 1
                    self.served[sender] += 1
                    self.service_log.append(sender)
                    self._reply(sender, op, reply)
                elif op == OP_CGRAD and self.replies is not None:
                    self._serve_compressed(sender, hdr)
                elif op == OP_PULL:
                    self._reply(sender, op, self.center)
                elif op == OP_STATE:
                    self._reply_state(sender)
                elif op == OP_DONE:
                    self.active.discard(sender)
                    if sender not in self.done:
                        self.done.append(sender)
                    if self.stop_policy == "first":
                        self.stop = True
                else:
                    raise RuntimeError(f"parameter server: unknown request op {op} from rank {sender}")
            except RuntimeError as err:
                if "unknown request" in str(err):
                    raise
                self._lost(sender, err)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.stop = True
        for r in list(self.done):
            self._reply(r, OP_FINAL, self.center)
        self.finished = time.time()
        self._maybe_checkpoint(force=True)

    def _serve_compressed(self, sender: int, hdr: torch.Tensor) -> None:
        """A compressed push: decode it, step as for a dense gradient, reply with the dense
        center (one-way) or d = C(w - r_sender) (two-way)."""
        message = torch.empty(int(hdr[2]), dtype=torch.uint8)
        ops.recv(message, src=sender, kind=self.kind, tag=TAG_REQ_DATA)
        grad = self.replies.decode_push(message, self.center.dtype).to(self.center.device)
        self._apply(OP_GRAD, grad, hdr)
        self.updates += 1
        self.served[sender] += 1
        self.service_log.append(sender)
        if self.replies.two_way:
            reply = self.replies.reply(sender, self.center)
            self._reply(sender, OP_CGRAD, reply, extra=float(reply.numel()))
        else:
            self._reply(sender, OP_CGRAD, self.center.clone())

    def _reply_state(self, dst: int) -> None:
        """The center, then the rest of :meth:`state_dict` as one serialized blob."""
        blob = to_blob(self.state_dict())
        if not self._reply(dst, OP_STATE, self.center, extra=float(blob.numel())):
            return
        try:
            ops.send(blob, dst, kind=self.kind, tag=TAG_REP_STATE)
        except RuntimeError as err:
            self._lost(dst, err)

    def _maybe_checkpoint(self, force: bool = False) -> None:
        if self.on_checkpoint is None:
            return
        every = self.checkpoint_every_s
        if force or (every is not None and time.monotonic() - self._last_ckpt >= every):
            self._last_ckpt = time.monotonic()
            state = self.state_dict()
            state["center"] = self.center.detach().cpu().clone()
            self.on_checkpoint(state)

