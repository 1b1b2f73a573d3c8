"""One worker under ``ft=torchft``: its own replica group, and the quorum exchange.

Rule (torchft's model, ALGORITHMS.md section 9): every worker is a replica group of one
process. Lightning sees a world of one (a private one-rank gloo group on a private TCPStore,
which is also the replica group's store), so nothing Lightning does -- barriers, logging
reductions, validation -- ever waits for another worker. All traffic between workers goes
through the worker's torchft ``Manager`` and its reconfigurable ``ProcessGroupGloo``.

One exchange (:meth:`FTSession.exchange`), tried until committed::

    start_quorum(); wait_quorum()          the lighthouse's quorum of the workers present
    n = num_participants()                 the workers at the newest step (a joiner is not one)
    b = payload(n)                         e.g. x / n (local SGD), d = alpha (x - c) (EASGD)
    allreduce(b, SUM)                      through the Manager: a joiner's b is zeroed
    if should_commit(): apply(b)           a joiner loads its peer's state first, here
    else: retry (nothing was applied)      the next quorum leaves the dead worker out

A worker restarted by the launcher (``EASGD_FT_ATTEMPT`` > 0) joins at its first exchange:
its Manager's step (0) is behind, so torchft sends it the live state of a healthy peer
(HTTP checkpoint transport: centre, worker variable, optimizer, counters, learning-rate
schedulers) and it contributes nothing to that exchange. The first exchange of a fresh run
has every worker at step 0: it is the set-up broadcast (replica rank 0 contributes its
variable, the others zeros), so all start equal.

Under an external launcher (``EASGD_FT_EXTERNAL``: torchrun or SLURM, ``ft/external.py``)
the workers share no store of the launcher's: the start barrier waits until the lighthouse
holds a fresh heartbeat of every initial worker (its dashboard), and the worker advertises
this host's name instead of 127.0.0.1. A restarted worker whose first quorum holds no one but
itself has no live peer to recover from (the others have finished or are gone): it raises
:class:`NoPeerToRecover` instead of training again from its initial state -- under
easgd-train's own launcher the launcher ends such a worker itself.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from easgd_lightning.compat.torchft import quorum_id, quorum_pending, quorum_ranks
from easgd_lightning.utils import stop
from easgd_lightning.utils.procs import exit_now

log = logging.getLogger(__name__)

__all__ = ["FTContext", "FTSession", "NoPeerToRecover", "prepare", "current", "failure_fields", "replica_name",
           "tensor_bytes"]

#: the launcher sets these for every worker under ft=torchft
ENV_ATTEMPT = "EASGD_FT_ATTEMPT"
ENV_LIGHTHOUSE = "EASGD_FT_LIGHTHOUSE"
ENV_RANK = "EASGD_FT_RANK"
ENV_WORLD = "EASGD_FT_WORLD"
#: set by the external-launcher paths (ft/external.py): "torchrun" or "slurm"
ENV_EXTERNAL = "EASGD_FT_EXTERNAL"

_CURRENT: FTContext | None = None

#: exchanges tried (each bounded by ft.quorum_timeout_s + ft.collective_timeout_s) before a worker gives up
MAX_TRIES = 8


class NoPeerToRecover(RuntimeError):
    """A restarted worker found no live peer to receive the run's state from."""


def interface_address(ifname: str) -> str | None:
    """The IPv4 address of network interface ``ifname`` (Linux ``SIOCGIFADDR``), None if it has none."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def advertised_host() -> str:
    """How peers reach this worker's store, Manager and checkpoint transport under an external
    launcher: the address of ``GLOO_SOCKET_IFNAME``'s interface where it is set (the network the
    collectives use: on a node whose host name resolves to another network, or on hosts that
    share one name), else this machine's host name."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    return (interface_address(ifname) if ifname else None) or socket.gethostname()


def replica_name(rank: int) -> str:
    """The replica id of worker ``rank`` at the lighthouse (torchft appends ``:uuid``); sorted
    by the lighthouse, so the replica rank is the worker rank; the trailing digits are the rank."""
    return f"r{rank:05d}"


def process_started() -> float:
    """Wall-clock time this process started (Linux: its start in ``/proc/self/stat``, in
    clock ticks since boot; elsewhere: now)."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()
    return time.time() - max(0.0, since_boot)


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested dict / list / tuple."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class FTContext:
    """What a worker under ``ft=torchft`` knows: its rank among the workers, their number,
    which start this is, the lighthouse, its replica group's store, the ``ft`` options."""

    def __init__(self, cfg: Any, run_dir: str) -> None:
        ft = cfg.ft
        self.rank = int(os.environ[ENV_RANK])
        self.world = int(os.environ[ENV_WORLD])
        self.attempt = int(os.environ.get(ENV_ATTEMPT, "0"))
        self.lighthouse = os.environ[ENV_LIGHTHOUSE]
        self.min_replicas = int(ft.get("min_replicas", 1))
        self.timeout_s = float(ft.get("quorum_timeout_s", 60))
        self.collective_timeout_s = float(ft.get("collective_timeout_s", 10))
        self.run_dir = str(run_dir)
        self.started = process_started()  # a restart's recovery is timed from here (interpreter start included)
        self.external = os.environ.get(ENV_EXTERNAL) or None
        # the address peers reach this worker's store and Manager at (torchft's checkpoint
        # transport uses the hostname too); one machine under easgd-train's own launcher
        self.hostname = advertised_host() if self.external else "127.0.0.1"
        self.launch_store = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0")))
        from torch.distributed import TCPStore

        # the replica group's store (torchft's Manager and Lightning's one-rank group use it)
        self.store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=self.timeout_s), wait_for_workers=False)
        self.quorum_pending = False  # set by FTSession.shutdown

    def barrier_initial_workers(self) -> None:
        """First start only: wait (bounded by ``ft.quorum_timeout_s``) until every initial
        worker has its Manager heartbeating, so the first quorum holds them all instead of
        whoever came first: over the launcher's store, or under an external launcher at the
        lighthouse (a late worker then receives a peer's state at its first exchange)."""
        if self.attempt > 0:
            return
        if self.external:
            self._barrier_at_lighthouse()
            return
        from torch.distributed import TCPStore

        store = TCPStore(self.launch_store[0], self.launch_store[1], None, False,
                         timedelta(seconds=self.timeout_s), wait_for_workers=False)
        store.add("ft/ready", 1)
        deadline = time.monotonic() + self.timeout_s
        while store.add("ft/ready", 0) < self.world and time.monotonic() < deadline:
            time.sleep(0.02)

    def _barrier_at_lighthouse(self) -> None:
        from easgd_lightning.compat.torchft import live_replicas

        want = {replica_name(r) for r in range(self.world)}
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            live = live_replicas(self.lighthouse)
            if live is None:
                log.warning("ft: the lighthouse's dashboard at %s/status cannot be read: no start barrier", self.lighthouse)
                return
            if want <= live:
                return
            time.sleep(0.05)
        log.warning("ft: workers %s not heartbeating after %.0fs (ft.quorum_timeout_s): starting without them",
                    sorted(want - live), self.timeout_s)

    def mark_joined(self, info: dict) -> None:
        """Tell the launcher this start has committed its first exchange (and its pid)."""
        from easgd_lightning.comm.liveness import write_join_record

        write_join_record(self.run_dir, self.rank, self.attempt, {"started_at": self.started, **info})


def prepare(cfg: Any, run_dir: str) -> FTContext:
    """Turn this process into a one-process Lightning world under ``ft=torchft``: keep the
    worker's rank and the number of workers, give Lightning a world of one on a private
    store, a logger on worker 0 only (checkpoints too: only worker 0 is Lightning's global
    zero; they hold the centre, as without ft, and are not what a lost worker recovers from)."""
    global _CURRENT
    os.environ[ENV_RANK] = os.environ.get("RANK", "0")
    os.environ[ENV_WORLD] = os.environ.get("WORLD_SIZE", "1")
    ctx = FTContext(cfg, run_dir)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(ctx.store.port), TORCHELASTIC_USE_AGENT_STORE="True")
    cfg.trainer.devices = 1
    if "num_nodes" in cfg.trainer:  # the workers may span nodes (trainer.num_nodes x devices): each is one process here
        cfg.trainer.num_nodes = 1
    if ctx.rank != 0:
        cfg.logger.name = "none"
    _CURRENT = ctx
    return ctx


def leave_if_quorum_pending(code: int) -> None:
    """End this worker now with ``code`` (exit handlers run, streams flushed) when its torchft
    session shut down with a quorum request pending: the thread inside it would hold the
    interpreter's exit for up to ``ft.quorum_timeout_s``. Returns otherwise."""
    if _CURRENT is None or not _CURRENT.quorum_pending:
        return
    log.info("ft: leaving without waiting for the pending quorum request")
    exit_now(code, join_threads=False)


def _sigterm_exception() -> BaseException:
    """Lightning's ``SIGTERMException`` (imported when a stop happens: not on the quorum's path,
    where an import would delay a worker's first exchange by seconds)."""
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    return SIGTERMException()


def current() -> FTContext | None:
    """This worker's context (None unless :func:`prepare` ran in this process)."""
    return _CURRENT


def failure_fields(err: BaseException) -> dict:
    """What a failed worker's report adds under ``ft=torchft``: which start it was
    (``ft_attempt``), and ``status: ended_before_rejoin`` for :class:`NoPeerToRecover`;
    {} without ft."""
    if _CURRENT is None:
        return {}
    out: dict = {"ft_attempt": _CURRENT.attempt}
    if isinstance(err, NoPeerToRecover):
        out["status"] = "ended_before_rejoin"
    return out


class FTSession:
    """A worker's torchft ``Manager`` and the record of what it saw (for summary.json).

    ``async_quorum`` (torchft's ``use_async_quorum``): True, a joiner receives its peer's
    state inside the exchange (or step) it joins and contributes nothing to it; False, it
    receives the state when the quorum forms, before the step, and takes part in the step
    as every member does (the compressed DDP hook: its collectives and codec state must be
    the peers' from the step's first message).
    """

    def __init__(self, ctx: FTContext, state_fn: Callable[[], dict], load_fn: Callable[[dict], None],
                 async_quorum: bool = True) -> None:
        from torchft import Manager, ProcessGroupGloo

        from easgd_lightning.compat.torchft import http_transport

        self.ctx = ctx
        self._state_fn, self._load_fn = state_fn, load_fn
        t = timedelta(seconds=ctx.collective_timeout_s)
        self.pg = ProcessGroupGloo(timeout=t)
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=ctx.min_replicas,
            use_async_quorum=async_quorum,
            timeout=t,
            quorum_timeout=timedelta(seconds=ctx.timeout_s),
            connect_timeout=t,
            rank=0,
            world_size=1,
            store_addr=ctx.hostname,
            store_port=ctx.store.port,
            lighthouse_addr=ctx.lighthouse,
            replica_id=replica_name(ctx.rank),
            hostname=ctx.hostname,
            init_sync=False,  # our first exchange is the set-up broadcast
            # torchft's transport names this machine's host name in the address it gives a
            # joiner; ours names the address the worker advertises (ft/worker.py advertised_host)
            checkpoint_transport=http_transport(t, ctx.hostname) if ctx.external else None,
        )
        ctx.barrier_initial_workers()
        self.exchanges = 0
        self.quorum_changes: list[dict] = []
        self.not_committed: list[int] = []
        # this process's recoveries from a peer: its rejoin after a restart, and any catch-up of
        # a live worker whose commit failed where a peer's succeeded (torchft's commit vote is
        # per replica group: the one left behind receives the peer's state at the next quorum)
        self.recoveries: list[dict] = []
        self.served: list[dict] = []  # recoveries this worker sent to joiners
        self._quorum_id: int | None = None
        self._loaded_bytes = 0
        self._loaded_step: int | None = None
        self._loaded_now = False  # this step's state came from a peer (a synchronous quorum's heal)
        self._joined = False

    # ---------------------------------------------------------------- torchft callbacks
    def _state(self) -> dict:
        state = self._state_fn()  # copies: the transport serves CPU tensors by reference
        self.served.append({"step": self._step_of(state), "bytes": tensor_bytes(state), "t": time.time()})
        return state

    def _load(self, state: dict) -> None:
        self._loaded_bytes = tensor_bytes(state)
        self._loaded_step = self._step_of(state)
        self._loaded_now = True
        self._load_fn(state)

    @staticmethod
    def _step_of(state: dict) -> int | None:
        return state.get("local_steps") if isinstance(state, dict) else None

    # ---------------------------------------------------------------- the exchange
    def _check_peer(self, n: int, healing: bool) -> None:
        """Under an external launcher, a restarted worker's first quorum must hold a peer.

        Raises:
            NoPeerToRecover: it is the only contributor and receives nothing (module doc).
        """
        if self.ctx.external and self.ctx.attempt > 0 and not self._joined and not healing and n <= 1:
            raise NoPeerToRecover(f"worker {self.ctx.rank} (restart {self.ctx.attempt}) found no live peer in its "
                                  "quorum to receive the run's state from: the others have finished or are gone")

    def members(self) -> list[int]:
        """Worker ranks of the current quorum (torchft's process group keeps them)."""
        return quorum_ranks(self.manager)

    def exchange(self, payload: Callable[[int, bool], list[torch.Tensor]],
                 apply: Callable[[list[torch.Tensor], bool], None], *, step: int, kind: str) -> None:
        """One exchange as a quorum step (module doc), retried until committed.

        ``payload(n, healing)``: this worker's buffers (summed over the quorum), given the
        number of contributing workers ``n``; ``apply(sums, healed)`` once committed,
        ``healed`` True when this worker received a peer's state in this exchange.

        Raises:
            RuntimeError: no commit in :data:`MAX_TRIES` quorums, or the quorum itself
                failed (e.g. the lighthouse is gone).
        """
        from torch.distributed import ReduceOp

        from easgd_lightning.comm.meter import get_meter

        m = self.manager
        for _ in range(MAX_TRIES):
            t0 = time.time()
            self._quorum(m.start_quorum, m.wait_quorum)
            healing = not m.is_participating()
            n = m.num_participants()
            self._check_peer(n, healing)
            qid = quorum_id(m)
            if qid != self._quorum_id:
                self._quorum_id = qid
                self.quorum_changes.append({"step": step, "quorum_id": qid, "members": self.members(),
                                            "participants": n, "t": time.time()})
            bufs = payload(n, healing)
            start = time.perf_counter()
            works = [m.allreduce(b, reduce_op=ReduceOp.SUM) for b in bufs]
            for w in works:
                w.wait()
            seconds = time.perf_counter() - start
            for b in bufs:  # metered as ops.all_reduce does: one message per buffer
                size = b.numel() * b.element_size()
                get_meter().record(kind, sent=size, recv=size, seconds=seconds / len(bufs))
            if m.should_commit():  # a joiner loads its peer's state in here
                if healing:  # at its peer's step, not its own
                    step = self._loaded_step if self._loaded_step is not None else step
                    if self.quorum_changes and self.quorum_changes[-1]["quorum_id"] == qid:
                        self.quorum_changes[-1]["step"] = step
                    self.recoveries.append({"step": step, "bytes": self._loaded_bytes, "quorum_s": time.time() - t0,
                                            "joined_at": time.time(), "started_at": self.ctx.started})
                apply(bufs, healing)
                self.exchanges += 1
                if not self._joined:
                    self._joined = True
                    self.ctx.mark_joined({"joined_at": time.time(), "healed": bool(healing),
                                          "step": step, "recovery_bytes": self._loaded_bytes if healing else 0})
                return
            self.not_committed.append(step)
            if healing:
                self._heal_again()
            log.warning("ft: the exchange at step %d was not committed (%s); retrying with a new quorum",
                        step, m.errored())
        raise RuntimeError(f"ft=torchft: the exchange at step {step} was not committed in {MAX_TRIES} quorums")

    def _quorum(self, *calls: Callable[[], Any]) -> None:
        """Run the quorum calls (start, wait); a stop signal (SIGTERM...) ends the wait at once
        -- the peers got it too and are leaving, no quorum would come -- as the step-boundary
        stop does (``SIGTERMException``), instead of after the stop grace.

        Raises:
            RuntimeError: the quorum failed (e.g. the lighthouse is gone).
        """
        with stop.interruptible(_sigterm_exception):
            try:
                for call in calls:
                    call()
            except Exception as err:
                raise RuntimeError(f"ft=torchft: no quorum from the lighthouse at {self.ctx.lighthouse}: {err}") from err

    def _heal_again(self) -> None:
        """A joiner's exchange that nobody committed: torchft has loaded its peer's state
        (before the vote) and set its step to the peer's, so the next quorum would not heal it
        and it would take part in the retry as an ordinary worker with its first exchange's
        payload and apply (the set-up broadcast's: wrong for a rejoin). Back at step 0, the
        next quorum heals it again."""
        self.manager.load_state_dict({**self.manager.state_dict(), "step": 0})

    # ---------------------------------------------------------------- a DDP step
    def start_step(self, step: int) -> None:
        """Start this step's quorum (asynchronous: it completes while the forward and
        backward run; synchronous: it is formed, and a joiner holds its peer's state, when
        this returns)."""
        self._step, self._step_t0, self._step_noted, self._loaded_now = step, time.time(), False, False
        self._quorum(self.manager.start_quorum)  # a synchronous quorum waits for the lighthouse here

    def group(self):
        """This step's quorum as a group for :mod:`easgd_lightning.comm.ops` (the compressed
        DDP hook's collectives: :class:`~easgd_lightning.comm.managed.ManagedGroup`)."""
        from easgd_lightning.comm.managed import ManagedGroup

        return ManagedGroup(self.manager, self.pg)

    def _note_step_quorum(self) -> tuple[int, bool]:
        m = self.manager
        self._quorum(m.wait_quorum)
        n, healing = m.num_participants(), not m.is_participating()
        self._check_peer(n, healing)
        if not self._step_noted:
            self._step_noted = True
            qid = quorum_id(m)
            if qid != self._quorum_id:
                self._quorum_id = qid
                self.quorum_changes.append({"step": self._step, "quorum_id": qid, "members": self.members(),
                                            "participants": n, "t": time.time()})
        return n, healing

    def allreduce_mean(self, buf: torch.Tensor, kind: str) -> torch.Tensor:
        """``buf <- sum_{i in Q} buf_i / n`` over this step's quorum (n: its contributing
        workers; a joiner's ``buf`` is zeroed by the Manager); blocking, metered."""
        from torch.distributed import ReduceOp

        from easgd_lightning.comm.meter import get_meter

        n, _ = self._note_step_quorum()
        buf.div_(n)
        start = time.perf_counter()
        self.manager.allreduce(buf, reduce_op=ReduceOp.SUM).wait()
        size = buf.numel() * buf.element_size()
        get_meter().record(kind, sent=size, recv=size, seconds=time.perf_counter() - start)
        return buf

    def commit_step(self) -> bool:
        """``should_commit`` for this step (a joiner loads its peer's state in here, or, with
        a synchronous quorum, loaded it in :meth:`start_step`)."""
        _, healing = self._note_step_quorum()
        healing = healing or self._loaded_now
        if not self.manager.should_commit():
            self.not_committed.append(self._step)
            log.warning("ft: step %d was not committed (%s)", self._step, self.manager.errored())
            return False
        if healing:
            step = self._loaded_step if self._loaded_step is not None else self._step
            if self.quorum_changes and self.quorum_changes[-1]["quorum_id"] == self._quorum_id:
                self.quorum_changes[-1]["step"] = step
            self.recoveries.append({"step": step, "bytes": self._loaded_bytes,
                                    "quorum_s": time.time() - self._step_t0, "joined_at": time.time(),
                                    "started_at": self.ctx.started})
        self.exchanges += 1
        if not self._joined:
            self._joined = True
            self.ctx.mark_joined({"joined_at": time.time(), "healed": bool(healing), "step": self._step,
                                  "recovery_bytes": self._loaded_bytes if healing else 0})
        return True

    def report(self) -> dict:
        return {
            "rank": self.ctx.rank,
            "attempt": self.ctx.attempt,
            "started_at": self.ctx.started,
            "exchanges": self.exchanges,
            "quorum_changes": self.quorum_changes,
            "not_committed": self.not_committed,
            "recoveries": self.recoveries,
            "served": self.served,
            "manager_step": self.manager.current_step(),
        }

    def shutdown(self) -> None:
        # a quorum request still inside a call to the lighthouse (gone, or peers that left)
        # returns only after ft.quorum_timeout_s: the interpreter's exit would wait for its
        # thread, so this worker leaves without joining it (leave_if_quorum_pending)
        self.ctx.quorum_pending = quorum_pending(self.manager)
        try:
            self.manager.shutdown(wait=False)
        except Exception:  # pragma: no cover - shutting down must not fail a finished run
            log.debug("torchft manager shutdown failed", exc_info=True)
