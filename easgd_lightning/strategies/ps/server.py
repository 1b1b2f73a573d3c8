"""The parameter server: first-come-first-served service of worker requests, and a
worker's loss that costs the others nothing.

Rules:

* **One channel per worker.** Each worker talks to the server on a process group of its own,
  ``{worker, server}`` (:func:`worker_channels`, created by every rank at set-up). Gloo
  closes *every* connection of a group when one of its operations times out, and fails the
  operations bound to a peer that died; on the default group one dead or frozen worker
  would take the others' traffic down with it. On its own group it takes only its own.
* **One receiving thread per worker, one applying thread.** A :class:`_Link` thread per
  worker receives that worker's requests (header and payload) on its channel and sends the
  replies; the server's loop takes whole requests from one queue in the order they arrived
  (first come, first served, never rank order), applies the rule
  (:mod:`easgd_lightning.strategies.ps.rules`) and hands the reply back to that worker's
  link. The loop never calls gloo, so a worker that stops reading (SIGSTOP) blocks only its
  own link's send, never the loop or another worker.
* **Losing a worker.** A worker is dropped when its channel fails (the process died:
  SIGKILL, a crash, ``os._exit``) or when its heartbeat (:mod:`easgd_lightning.comm.liveness`)
  has stopped for ``dead_after_s`` (frozen or hung). The server goes on with the others,
  records the loss (:attr:`ParameterServer.lost`: rank, time, cause, the server's update
  count) and declares it in the rendezvous store, where the local launcher reads it (the
  run does not fail for it). A dropped worker whose request arrives later was only slow:
  it is served again and the declaration withdrawn.
* **Re-admission** (``rejoin_store``; ``ft=torchft``, :mod:`~easgd_lightning.strategies.ps.rejoin`).
  A restarted process of worker ``r`` arrives on a new channel, a two-process group made
  over the run's store (the set-up groups have fixed members): its old process is dropped
  if it was still held (cause ``restarted``), the new channel replaces the old one (what the
  old one still delivers is ignored), the loss declaration is withdrawn and ``r`` is served
  again. Its first request is ``OP_STATE`` (the center and the server's state); a
  compressed-message replica of ``r`` is reset to the center sent in that reply. While no
  worker is active but a lost one may come back (not ``stop``, the launcher has not given
  it up), serving waits for it up to ``rejoin_wait_s``. :attr:`ParameterServer.membership`
  records who is served after every loss and admission.
* **The end.** Serving ends when every worker is done or lost; each done worker then gets
  the final center. Link threads blocked on a lost worker are daemons and are abandoned.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from easgd_lightning.comm import get_meter, ops
from easgd_lightning.comm.liveness import LONG_WAIT, Liveness, interruption
from easgd_lightning.strategies.ps import rules
from easgd_lightning.strategies.ps.protocol import (
    OP_CELASTIC,
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
from easgd_lightning.strategies.ps.rejoin import Admissions, Join

log = logging.getLogger(__name__)

__all__ = ["ParameterServer", "worker_channels"]


def worker_channels(server: int, workers: list[int], timeout=None) -> dict[int, dist.ProcessGroup]:
    """One process group ``{w, server}`` per worker ``w`` (see the module docstring), its
    operations timing out after ``timeout`` (a ``timedelta``; the run's ``timeout_s``).

    Collective over the default group: every rank calls it at set-up with the same
    arguments (a rank gets handles it never uses for the groups it is not in)."""
    return {w: ops.new_group(sorted([w, server]), timeout=timeout) for w in workers}


def check_served_a_worker(done: list[int], lost: list[dict], rank: int) -> None:
    """A server whose serving ended with every worker lost and none done has nothing to
    deliver: it fails, naming each worker's loss, instead of ending its fit as a success."""
    if done or not lost:
        return
    causes = ", ".join(f"worker {w['rank']}: {w['cause']}" for w in lost)
    raise RuntimeError(f"parameter server (rank {rank}): every worker was lost before finishing ({causes})")


class _Link:
    """The server's end of one worker's channel: a daemon thread that receives the worker's
    requests (header, then the payload the header announces), puts each whole request on
    the server's queue, and sends the one reply the server hands back for it.

    Events are ``(link, header, payload, error)``: a failed receive or send (the worker's
    process died) puts ``(link, None, None, err)`` and ends the thread. Waits never time
    out (:data:`LONG_WAIT`): a timeout would close the channel of a worker that is only
    busy; liveness decides instead. ``peer``: the worker's rank within ``group`` when the
    group is a pair group (:func:`~easgd_lightning.comm.ops.pair_group`), else None.
    """

    def __init__(self, worker: int, group, like: torch.Tensor, header_size: int, kind: str,
                 inbox: queue.SimpleQueue, peer: int | None = None) -> None:
        self.worker, self.group, self.like, self.peer = worker, group, like, peer
        self.header_size, self.kind, self.inbox = header_size, kind, inbox
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"easgd-ps-link-{worker}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def reply(self, parts: list[tuple[torch.Tensor, int, int | None]]) -> None:
        """Send ``parts`` (tensor, tag, dense bytes: None when the tensor is not compressed)
        to the worker, in order, as the answer to its last request."""
        self._replies.put(parts)

    def close(self) -> None:
        """No reply will come: end the thread once it asks for one."""
        self._replies.put(None)

    def _recv(self, tensor: torch.Tensor, tag: int) -> None:
        ops.irecv(tensor, self.worker, kind=self.kind, tag=tag, group=self.group,
                  group_peer=self.peer).wait(LONG_WAIT)

    def _run(self) -> None:
        try:
            while True:
                hdr = torch.zeros(self.header_size, dtype=torch.float64)
                self._recv(hdr, TAG_REQ)
                op, data = int(hdr[0]), None
                if op in (OP_ELASTIC, OP_GRAD):
                    data = torch.empty_like(self.like)
                elif op in (OP_CGRAD, OP_CELASTIC):  # a compressed push: its byte length in the header
                    data = torch.empty(int(hdr[2]), dtype=torch.uint8)
                if data is not None:
                    self._recv(data, TAG_REQ_DATA)
                self.inbox.put((self, hdr, data, None))
                parts = self._replies.get()
                if parts is None:
                    return
                for tensor, tag, dense in parts:
                    ops.isend(tensor, self.worker, kind=self.kind, tag=tag, group=self.group,
                              dense_bytes=dense, group_peer=self.peer).wait(LONG_WAIT)
                if op == OP_DONE:  # that was the final center: the worker asks nothing more
                    return
        except RuntimeError as err:  # the channel failed: the worker's process is gone
            self.inbox.put((self, None, None, err))


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
            replica per worker (:class:`~easgd_lightning.strategies.ps.compressed.ServerReplies`);
            for the elastic rule, compressed elastic pushes (``OP_CELASTIC``,
            :class:`~easgd_lightning.strategies.ps.compressed.ElasticReplies`).
        channels: each worker's process group (:func:`worker_channels`); None: the default
            group for every worker (then one worker's death or a timeout may close the
            others' connections too).
        rejoin_store: returns a new client of the run's store: restarted workers are
            re-admitted (module docstring); None: they are not.
        rejoin_timeout: a ``timedelta``: how long a rejoining worker's channel waits for it.
        rejoin_wait_s: how long serving waits for a lost worker to come back when no other
            is active.
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
        channels: dict[int, dist.ProcessGroup] | None = None,
        rejoin_store: Callable[[], object] | None = None,
        rejoin_timeout: timedelta = timedelta(minutes=5),
        rejoin_wait_s: float = 300.0,
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
        if replies is not None and lockfree:
            raise ValueError("compressed pushes are not applied lock-free (Hogwild)")
        self.active: set[int] = set(workers)
        self.done: list[int] = []
        self.dead: list[int] = []  # the workers dropped (and not back)
        #: every loss: ``{rank, at (time.time()), cause, error, updates, worker_step}``, and
        #: ``back_at`` when the worker answered again
        self.lost: list[dict] = []
        #: who is served after every change: ``{step: the update count, members, t}``
        self.membership: list[dict] = []
        #: every re-admission: ``{rank, attempt, at, updates}``
        self.rejoins: list[dict] = []
        self.stop = False
        self.service_log: deque = deque(maxlen=log_size)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        channels = channels or {}
        self._links = {w: _Link(w, channels.get(w), center, self.header_size, kind, self._inbox) for w in workers}
        self._admissions = None if rejoin_store is None else Admissions(
            rejoin_store, workers, rejoin_timeout, on_join=self._inbox.put)
        self.rejoin_wait_s = float(rejoin_wait_s)
        self._joining: set[int] = set()  # admitted, their state not pulled yet
        self._last_loss = time.monotonic()
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
        """Stop on a signal, checkpoint when due, drop workers whose heartbeat stopped;
        False once no worker is active."""
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
                self._drop(r, "heartbeat stopped", f"no heartbeat for {self.liveness.dead_after_s:g}s")
        return bool(self.active) or self._awaiting_rejoin()

    def _awaiting_rejoin(self) -> bool:
        """No worker is active, but a lost one may still come back: re-admission is on, no
        worker asked everyone to stop, the launcher has not given it up, and the last loss
        was less than ``rejoin_wait_s`` ago."""
        if self._admissions is None or self.stop or time.monotonic() - self._last_loss >= self.rejoin_wait_s:
            return False
        gone = self.liveness.is_gone if self.liveness is not None else (lambda _r: False)
        return any(r not in self.done and not gone(r) for r in self.dead)

    def _note_members(self) -> None:
        """Record who is served now (the workers not lost) at the current update count."""
        self.membership.append({"step": self.updates, "members": [w for w in self.workers if w not in self.dead],
                                "t": time.time()})

    def _drop(self, r: int, cause: str, err: BaseException | str) -> None:
        """Go on without worker ``r``: record it and declare it lost (module docstring)."""
        self.active.discard(r)
        if r in self.dead:
            return
        if cause != "heartbeat stopped":
            log.warning("parameter server: lost worker %d (%s: %s); going on without it", r, cause, err)
        self.dead.append(r)
        self._last_loss = time.monotonic()
        info = {"rank": r, "at": time.time(), "cause": cause, "error": str(err)[:300],
                "updates": self.updates, "worker_step": self.worker_steps[r]}
        self.lost.append(info)
        self._note_members()
        if self.liveness is not None:
            self.liveness.declare_lost(r, info)

    def _readmit(self, r: int, attempt: int | None = None) -> None:
        """A dropped worker is back: its request arrived (it was only slow), or its restarted
        process ``attempt`` was admitted (:meth:`_admit`)."""
        if attempt is None:
            log.warning("parameter server: worker %d answered again; serving it again", r)
        self.dead.remove(r)
        if r not in self.done:
            self.active.add(r)
        for info in self.lost:
            if info["rank"] == r and "back_at" not in info:
                info["back_at"] = time.time()
                if attempt is not None:
                    info["restarted"] = attempt
        self._note_members()
        if self.liveness is not None:
            self.liveness.withdraw_lost(r)

    def _admit(self, join: Join) -> None:
        """A restarted process of worker ``join.rank`` (module docstring, Re-admission)."""
        r = join.rank
        if r not in self.dead:  # its old process was not noticed gone yet
            self._drop(r, "restarted", f"start {join.attempt} of this worker asked to join")
        self._links[r].close()  # blocked on the dead process: abandoned (a daemon)
        self._links[r] = _Link(r, join.group, self.center, self.header_size, self.kind, self._inbox, peer=0)
        self._links[r].start()
        if r in self.done:  # it died after saying done: its new process trains again
            self.done.remove(r)
        self._joining.add(r)
        self._readmit(r, join.attempt)
        self.rejoins.append({"rank": r, "attempt": join.attempt, "at": time.time(), "updates": self.updates})
        log.warning("parameter server: worker %d rejoined (start %d); serving it again", r, join.attempt)

    def _header(self, op: int, extra: float = 0.0) -> torch.Tensor:
        return torch.tensor([op, self.updates, float(self.stop), extra], dtype=torch.float64)

    def _reply(self, dst: int, op: int, payload: torch.Tensor | None, extra: float = 0.0,
               blob: torch.Tensor | None = None, dense_bytes: int | None = None) -> None:
        """Hand the reply to ``dst``'s link, which sends it (``payload``: not changed after;
        ``dense_bytes``: its uncompressed size when it is a compressed message)."""
        parts = [(self._header(op, extra), TAG_REP, None)]
        if payload is not None:
            parts.append((payload, TAG_REP_DATA, dense_bytes))
        if blob is not None:
            parts.append((blob, TAG_REP_STATE, None))
        self._links[dst].reply(parts)

    def serve(self) -> None:
        """Serve requests until every worker is done or lost, then send the final center."""
        self.started = time.time()
        self._maybe_checkpoint(force=True)
        self._note_members()
        for link in self._links.values():
            link.start()
        if self._admissions is not None:
            self._admissions.start()
        checked = time.monotonic()
        while self.active or self._awaiting_rejoin():
            start = time.perf_counter()
            try:
                event = self._inbox.get(timeout=self.poll_s)
            except queue.Empty:
                event = None
            get_meter().add_time(self.kind, time.perf_counter() - start)  # waiting for requests
            if event is None or time.monotonic() - checked >= self.poll_s:
                checked = time.monotonic()
                if not self._keep_waiting():
                    break
            if event is None:
                continue
            if isinstance(event, Join):
                self._admit(event)
                continue
            link, hdr, data, err = event
            if self._links[link.worker] is not link:  # a replaced (restarted) worker's old channel
                continue
            if hdr is None:
                self._drop(link.worker, "connection lost", err)
                continue
            self._serve_request(link.worker, hdr, data)
        if self._admissions is not None:
            self._admissions.stop()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.stop = True
        for r in self.done:
            if r not in self.dead:
                self._reply(r, OP_FINAL, self.center)  # the center does not change any more
        for r in self.done:  # bounded: a worker whose heartbeat stops is not waited for
            link = self._links[r].thread
            while link.is_alive() and (self.liveness is None or self.liveness.alive(r)):
                link.join(self.poll_s)
            if link.is_alive():
                self._drop(r, "heartbeat stopped", "no heartbeat while it waited for the final center")
        while not self._inbox.empty():  # a done worker that died before its final center
            event = self._inbox.get()
            if isinstance(event, Join):  # too late: serving is over
                continue
            link, hdr, _, err = event
            if hdr is None and self._links[link.worker] is link:
                self._drop(link.worker, "connection lost", err)
        self.finished = time.time()
        self._maybe_checkpoint(force=True)
        check_served_a_worker(self.done, self.lost, self.rank)

    def _serve_request(self, sender: int, hdr: torch.Tensor, data: torch.Tensor | None) -> None:
        op, step = int(hdr[0]), int(hdr[1])
        if sender in self.dead:
            self._readmit(sender)
        self.worker_steps[sender] = max(self.worker_steps[sender], step)
        if op in (OP_ELASTIC, OP_GRAD):
            reply = self._apply(op, data, hdr)
            self._count(sender)
            self._reply(sender, op, reply)
        elif op == OP_CGRAD and self.replies is not None and self.rule == "sgd":
            self._serve_compressed(sender, hdr, data)
        elif op == OP_CELASTIC and self.replies is not None and self.rule == "elastic":
            d = self.replies.serve(sender, data, self.center)
            self._count(sender)
            self._reply(sender, op, d)
        elif op == OP_PULL:
            self._reply(sender, op, self.center.clone())
        elif op == OP_STATE:
            if sender in self._joining:  # a rejoined worker starts from this center
                self._joining.discard(sender)
                if self.replies is not None:
                    self.replies.reset(sender, self.center)
            blob = to_blob(self.state_dict())
            self._reply(sender, OP_STATE, self.center.clone(), extra=float(blob.numel()), blob=blob)
        elif op == OP_DONE:  # answered with the final center, once serving ends
            self.active.discard(sender)
            if sender not in self.done:
                self.done.append(sender)
            if self.stop_policy == "first":
                self.stop = True
        else:
            raise RuntimeError(f"parameter server: unknown request op {op} from rank {sender}")

    def _count(self, sender: int) -> None:
        self.updates += 1
        self.served[sender] += 1
        self.service_log.append(sender)

    def _serve_compressed(self, sender: int, hdr: torch.Tensor, message: torch.Tensor) -> None:
        """A compressed push: decode it, step as for a dense gradient, reply with the dense
        center (one-way) or d = C(w - r_sender) (two-way)."""
        grad = self.replies.decode_push(message, self.center.dtype).to(self.center.device)
        self._apply(OP_GRAD, grad, hdr)
        self._count(sender)
        if self.replies.two_way:
            reply = self.replies.reply(sender, self.center)
            self._reply(sender, OP_CGRAD, reply, extra=float(reply.numel()), dense_bytes=ops.nbytes(self.center))
        else:
            self._reply(sender, OP_CGRAD, self.center.clone())

    def _maybe_checkpoint(self, force: bool = False) -> None:
        if self.on_checkpoint is None:
            return
        every = self.checkpoint_every_s
        if force or (every is not None and time.monotonic() - self._last_ckpt >= every):
            self._last_ckpt = time.monotonic()
            state = self.state_dict()
            state["center"] = self.center.detach().cpu().clone()
            self.on_checkpoint(state)

