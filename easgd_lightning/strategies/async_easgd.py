"""Asynchronous parameter-server family: Async EASGD, Async MEASGD, Async SGD, Async MSGD.

Rules (Zhang, Choromanska, LeCun, NeurIPS 2015; You, Buluc, Demmel, SC17; the pure math is
in :mod:`easgd_lightning.strategies.async_rules`):

* ``async_easgd``: every ``tau`` local steps worker i sends x_i (the point where this step's
  gradient is computed) to the server, which applies, on arrival and for that one worker,
  ``d = alpha (x_i - c); c <- c + d`` and returns d; the worker sets
  ``x_i <- opt_step(x_i, g_i) - d``. The request is sent *before* the local step and the
  reply is awaited after it, so the worker computes its gradient while d travels (SC17).
  Default beta = p * alpha = 0.9 over the p workers, tau = 1.
* ``async_measgd``: the same exchange; the worker's local step is EAMSGD's Nesterov form
  (``v <- delta v; x <- x + v; g = grad(x); x <- x - eta g; v <- v - eta g``) with
  ``momentum`` = delta in [0, 1) (default 0.9). The strategy owns that momentum: the
  optimizer's own ``momentum`` is set to 0 (with a warning) so it is not applied twice.
* ``async_sgd``: every step the worker computes g at its copy of the weights and pushes g;
  the server takes one step of the user's optimizer (its class, parameter groups, weight
  decay; the server holds its state) for g and returns w, which the worker loads. With plain
  SGD that is ``w <- w - eta (g + wd w)``. Each group's eta is the worker optimizer's current
  learning rate of that group (sent with the request; schedules apply) unless ``lr`` is set.
  Parameters the worker has no gradient for (frozen) are skipped, as ``torch.optim`` does.
* ``async_msgd``: Async SGD with heavy-ball momentum held by the server
  (``b <- mu b + g; w <- w - eta b``, ``momentum`` = mu, default 0.9): SGD's own momentum,
  so the optimizer must be ``torch.optim.SGD`` with momentum 0 or mu (refused otherwise).

Design decisions (and their trade-offs):

* **Dedicated server rank.** The last global rank (``world_size - 1``) is the parameter
  server and does not train; ranks ``0 .. world_size - 2`` are the workers. So
  ``trainer.devices`` (x ``num_nodes``) is workers + 1, at least 3; ``summary.json``
  shows ``roles`` (``"server"`` for that rank) and ``trained_ranks``. The alternative, a
  thread beside rank 0's worker, would save a process but gloo point-to-point calls from two
  threads of one process on one process group are not safe, and a worker that also serves
  stalls every other worker whenever it computes. The last rank, not rank 0, serves so that
  rank 0 (Lightning's global zero: logger, checkpoint files, ``val_history``) is a worker.
* **Engine: point-to-point on the gloo process group** through :mod:`easgd_lightning.comm.ops`
  (every byte metered, ``kind="parameter_server"``). The server receives request headers with
  ``recv`` from *any source*, so it serves whichever worker arrives first (FCFS), never in rank
  order, and never waits for all workers. A request is a float64 header
  ``[op, local_step, lr, weight_decay]`` plus one flat payload (the SC17 single-layer message);
  the reply is a header ``[op, server_updates, stop, extra]`` plus one flat payload.
* **Liveness without hangs.** Gloo has no way to cancel a receive, and a receive that times
  out closes every connection of the process group. So the server never lets a receive time
  out: it waits for a request on a helper thread (with a very long timeout) and meanwhile
  checks heartbeats that every rank posts to the rendezvous store (``TCPStore``) every
  ``heartbeat_s``. A worker whose heartbeat stops for ``worker_timeout_s`` (default
  ``min(30, timeout_s / 2)``) is declared dead: the server finishes with the remaining
  workers. Workers wait for the final center the same way (checking the server's
  heartbeat); if the server dies, a worker's pending receive fails (connection closed) or
  times out after ``timeout_s``, and it stops with an error naming the server rank. The
  store lives in rank 0, so rank 0's death stops the run with an error.
* **No collectives after set-up.** Workers run at different speeds, so every Lightning
  collective would re-synchronise them (or hang on a dead worker): after set-up this strategy
  answers ``barrier``/``broadcast``/``reduce``/``all_gather`` locally, skips Lightning's
  per-step SIGTERM broadcast (a local check replaces it) and the module-state broadcast of
  ``trainer.validate``. Validation loaders are not sharded: each rank evaluates the whole
  validation set on the center, so ``val/*`` needs no all-reduce. The training set is
  sharded over the workers only.
* **Stopping.** ``stop_policy="first"`` (default): ``trainer.max_epochs``/``max_steps`` count
  for the fastest worker; when the first worker finishes, the server tells every other
  worker to stop at its next exchange. ``"all"``: every worker runs its own epochs.
  ``max_time_s``: a wall-clock budget per worker (from the start of its training).
  Workers send ``done`` at the end of fit; once every worker is done (or dead) the server
  sends each the final center, which the user's module then holds on every rank.
* **Metrics and signals.** ``torchmetrics`` metrics compute from their own rank's state (see
  :func:`local_metrics`); a user's own collective fails at ``timeout_s`` with an error that
  says why. Lightning's SIGTERM handler broadcasts (a collective): it is replaced by a local
  flag the server and the waits check; a rank blocked in a C++ wait is ended
  ``SIGNAL_GRACE_S`` after SIGTERM/SIGINT by :class:`_SignalWatch`.
* **Validation, checkpoints, final ``train_loss``** use the center: workers pull it from the
  server for each validation and checkpoint (rank 0 with the server's state: a checkpoint
  written after a validation holds the center that validation scored). Rank 0's Lightning checkpoints
  (``last.ckpt``, per epoch) hold the center as the module weights and, in
  ``checkpoint["easgd"]["server"]``, the server's state (update count, per-worker counts
  and, for the SGD rule, the user's optimizer's state; ``momentum``: SGD's buffers, flat). The server also writes its own
  ``center.ckpt`` (atomically: temporary file + rename) every ``checkpoint_every_s`` seconds
  and at the end, so a crash of any worker leaves an intact, loadable center. Either file
  resumes a run (``checkpoint.resume=...``): the center and the server state are restored;
  workers restart from the center with fresh optimizer (and velocity) state.
"""

from __future__ import annotations

import io
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning_fabric.utilities.types import _PATH
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.trainer.states import RunningStage, TrainerFn
from pytorch_lightning.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer
from typing_extensions import override

from easgd_lightning.comm import get_meter, ops
from easgd_lightning.strategies import async_rules, elastic
from easgd_lightning.strategies.async_rules import bind_views, momentum_buffers, optimizer_step_on
from easgd_lightning.strategies.base import (
    CenterStrategy,
    check_positive_int,
    flatten,
    unflatten_into,
)
from easgd_lightning.strategies.registry import register_strategy

log = logging.getLogger(__name__)

__all__ = [
    "AsyncEASGDStrategy",
    "AsyncMEASGDStrategy",
    "AsyncSGDStrategy",
    "AsyncMSGDStrategy",
    "AsyncCenterStrategy",
    "ParameterServer",
    "ServerClient",
    "Liveness",
]

# request / reply operation codes (first header entry)
OP_ELASTIC, OP_GRAD, OP_PULL, OP_STATE, OP_DONE, OP_FINAL = 1, 2, 3, 4, 5, 6
# point-to-point tags (gloo slots)
TAG_REQ, TAG_REQ_DATA, TAG_REP, TAG_REP_DATA, TAG_REP_STATE = 41, 42, 43, 44, 45
HEADER = 4
_LONG_WAIT = timedelta(days=7)  # a receive must never time out: that closes the process group
_DDP_KEYS = {
    "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
    "precision_plugin", "precision", "process_group_backend", "timeout", "start_method",
}
STOP_POLICIES = ("first", "all")


def request_header_size(optimizer: Optimizer | None, params: list[torch.Tensor]) -> int:
    """Entries of a request header: ``[op, step, lr, wd]``, then (SGD rule) each parameter
    group's learning rate and, per parameter tensor, 1.0 when the worker had a gradient for it."""
    if optimizer is None:
        return HEADER
    return HEADER + len(optimizer.param_groups) + len(params)


def request_extras(optimizer: Optimizer, params: list[torch.Tensor]) -> list[float]:
    """The worker's side of :func:`request_header_size`: its groups' current learning rates
    (so its schedulers apply at the server) and which parameters have a gradient."""
    return [float(g["lr"]) for g in optimizer.param_groups] + [float(p.grad is not None) for p in params]


def split_request_extras(hdr: torch.Tensor, n_groups: int) -> tuple[list[float], list[bool]]:
    """(learning rate per group, has-gradient per parameter) from a request header."""
    extras = hdr[HEADER:].tolist()
    return extras[:n_groups], [v > 0.5 for v in extras[n_groups:]]


def _to_blob(obj: Any) -> torch.Tensor:
    """``obj`` (tensors and plain data) serialized into a uint8 tensor, to send."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_blob(blob: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)


def _interruption(signum: int, who: str) -> BaseException:
    """The exception a rank stops with after SIGTERM / SIGINT (Lightning's own for SIGTERM)."""
    from pytorch_lightning.utilities.exceptions import SIGTERMException

    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
        return KeyboardInterrupt(f"{who}: interrupted by {name}")
    return SIGTERMException(f"{who}: interrupted by {name}")


def _reject_unknown(name: str, kwargs: dict, options: tuple[str, ...]) -> None:
    """ValueError naming the first keyword that is neither an option of ``name`` nor Lightning's."""
    unknown = sorted(set(kwargs) - _DDP_KEYS - set(options) - {"num_nodes_hint", "optim_hint", "compression"})
    if unknown:
        raise ValueError(
            f"strategy.{unknown[0]} is not an option of {name}; its options are: {', '.join(options)}"
        )


# ---------------------------------------------------------------------------- liveness
class Liveness:
    """Heartbeats through the rendezvous store: who is still alive.

    Every rank bumps a counter ``<prefix>/hb/<rank>`` every ``interval_s`` from a daemon
    thread (its own store connection). :meth:`alive` reads another rank's counter and calls
    it dead once the counter has not moved for ``dead_after_s``.

    Args:
        prefix: key prefix shared by the ranks of one run.
        rank: this process's global rank.
        interval_s: heartbeat period.
        dead_after_s: silence after which a rank is declared dead.
        store_factory: returns a new store client (default: a TCPStore client of
            ``MASTER_ADDR:MASTER_PORT``, else the default process group's store).
    """

    def __init__(
        self,
        prefix: str,
        rank: int,
        *,
        interval_s: float = 0.5,
        dead_after_s: float = 30.0,
        store_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.prefix, self.rank = prefix, rank
        self.interval_s, self.dead_after_s = float(interval_s), float(dead_after_s)
        self._factory = store_factory or _default_store
        self._reader = self._factory()
        self._seen: dict[int, tuple[int, float, float]] = {}  # rank -> (value, changed_at, read_at)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _key(self, rank: int, what: str = "hb") -> str:
        return f"{self.prefix}/{what}/{rank}"

    def start(self) -> Liveness:
        self._reader.add(self._key(self.rank), 1)
        self._thread = threading.Thread(target=self._beat, name="easgd-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        try:
            store = self._factory()
            while not self._stop.wait(self.interval_s):
                store.add(self._key(self.rank), 1)
        except Exception:  # the store went away (rank 0 exited): nothing left to report to
            log.debug("heartbeat stopped", exc_info=True)

    def stop(self) -> None:
        self._stop.set()

    def alive(self, rank: int) -> bool:
        """Whether ``rank`` posted a heartbeat within the last ``dead_after_s`` seconds.

        Raises:
            RuntimeError: the store is unreachable (it lives in rank 0's process).
        """
        now = time.monotonic()
        value, changed, read = self._seen.get(rank, (-1, now, 0.0))
        if now - read >= min(self.interval_s, 0.25):
            try:
                current = int(self._reader.add(self._key(rank), 0))
            except Exception as err:
                raise RuntimeError(
                    f"lost the rendezvous store (it lives in rank 0; did rank 0 die?): {err}"
                ) from err
            if current != value:
                value, changed = current, now
            read = now
        self._seen[rank] = (value, changed, read)
        return now - changed < self.dead_after_s

    def mark_done(self) -> None:
        self._reader.set(self._key(self.rank, "done"), "1")

    def is_done(self, rank: int) -> bool:
        return bool(self._reader.check([self._key(rank, "done")]))

    def mark_left(self) -> None:
        """This rank will not read the store again (rank 0, its host, may now exit)."""
        self._reader.set(self._key(self.rank, "left"), "1")

    def has_left(self, rank: int) -> bool:
        return bool(self._reader.check([self._key(rank, "left")]))


def _default_store():
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=30))
    return dist.distributed_c10d._get_default_store()


class _Waiter:
    """Waits for gloo work on a daemon thread, so the caller can check liveness meanwhile."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, threading.Event, dict]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="easgd-wait", daemon=True)
        self._thread.start()
        self.abandoned: list = []  # buffers of receives that may still complete: keep them alive

    def _run(self) -> None:
        while True:
            work, done, box = self._jobs.get()
            try:
                work.wait(_LONG_WAIT)
            except BaseException as err:  # handed to the caller
                box["error"] = err
            finally:
                done.set()

    def wait(self, work, keep_waiting: Callable[[], bool], poll_s: float, keep: Any = None) -> bool:
        """True when ``work`` completed; False when ``keep_waiting()`` said to give up.

        A given-up wait leaves this waiter's thread blocked forever (gloo cannot cancel a
        receive): a new thread takes over, and ``keep`` (the receive buffers) is kept alive.
        """
        done, box = threading.Event(), {}
        self._jobs.put((work, done, box))
        while not done.wait(poll_s):
            if not keep_waiting():
                self.abandoned.append((work, keep))
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, name="easgd-wait", daemon=True)
                self._thread.start()
                return False
        if "error" in box:
            raise box["error"]
        return True


def _source_rank(work) -> int:
    fn = getattr(work, "_source_rank", None) or work.source_rank
    return int(fn())


# ---------------------------------------------------------------------------- metrics, signals
def _never_distributed() -> bool:
    return False


def local_metrics(module: torch.nn.Module) -> int:
    """Make every ``torchmetrics.Metric`` in ``module`` compute from this rank's own state.

    A metric's epoch-end sync gathers over every rank of the default process group: the
    parameter server never joins it, and workers that run apart would each wait there for
    the others. It is also not needed: evaluation data are not sharded (each rank evaluates
    the whole set on the center), so a rank's own value is the full value; a training
    metric is that worker's own. Returns how many metrics were switched.
    """
    try:
        from torchmetrics import Metric
    except ImportError:  # torchmetrics is optional
        return 0
    count = 0
    for sub in module.modules():
        if isinstance(sub, Metric):
            sub.distributed_available_fn = _never_distributed
            count += 1
    return count


#: seconds a rank may take to end by itself after SIGTERM / SIGINT before it is ended
SIGNAL_GRACE_S = 5.0


class _SignalWatch:
    """Ends this process when it does not end by itself within ``grace_s`` of SIGTERM/SIGINT.

    Python runs signal handlers on the main thread between bytecodes only, so a rank blocked
    in a gloo wait (C++, the GIL released) never runs them. The C-level handler also writes
    the signal number to the wakeup file descriptor (``signal.set_wakeup_fd``): a daemon
    thread reads it there, calls ``on_signal(signum)`` at once (e.g. to pass the signal on
    to the processes this rank started), waits ``grace_s`` (a rank that is not stuck stops
    at its next batch or request) and then exits the process with ``128 + signum``.
    """

    def __init__(self, who: str, grace_s: float = SIGNAL_GRACE_S,
                 on_signal: Callable[[int], None] | None = None) -> None:
        self.who, self.grace_s, self.on_signal = who, float(grace_s), on_signal
        self._old_fd = -1
        self._fds: tuple[int, int] | None = None

    def start(self) -> bool:
        """Install (main thread only); False when it cannot be installed here."""
        if self._fds is not None:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except ValueError:
            os.close(r)
            os.close(w)
            return False
        self._fds = (r, w)
        threading.Thread(target=self._watch, args=(r,), name="easgd-signal-watch", daemon=True).start()
        return True

    def _watch(self, r: int) -> None:
        while True:
            try:
                data = os.read(r, 64)
            except OSError:
                return
            if not data:
                return
            if self._old_fd != -1:  # whoever installed a wakeup fd before still hears of it
                try:
                    os.write(self._old_fd, data)
                except OSError:
                    pass
            caught = [b for b in data if b in (signal.SIGTERM, signal.SIGINT)]
            if caught:
                if self.on_signal is not None:
                    try:
                        self.on_signal(caught[0])
                    except Exception:  # passing it on is best effort; ending this rank is not
                        log.debug("on_signal failed", exc_info=True)
                time.sleep(self.grace_s)  # a rank that ends by itself never wakes up here
                name = signal.Signals(caught[0]).name
                print(f"{self.who}: still running {self.grace_s:g} s after {name} (blocked in a wait "
                      f"that Python cannot interrupt); exiting", file=sys.stderr, flush=True)
                os._exit(128 + caught[0])

    def stop(self) -> None:
        """Uninstall (no signal came); the thread ends when the pipe closes."""
        if self._fds is None or threading.current_thread() is not threading.main_thread():
            return
        r, w = self._fds
        try:
            current = signal.set_wakeup_fd(self._old_fd)
            if current != w:  # someone replaced ours meanwhile: keep theirs
                signal.set_wakeup_fd(current)
                return
        except ValueError:
            return
        self._fds = None
        os.close(w)


# ---------------------------------------------------------------------------- server
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
            bind_views(self.params, center)
        self.header_size = request_header_size(optimizer, self.params)
        self.interrupted = interrupted
        self.active: set[int] = set(workers)
        self.done: list[int] = []
        self.dead: list[int] = []
        self.stop = False
        self.service_log: deque = deque(maxlen=log_size)
        self._waiter = _Waiter()
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
            "momentum": None if self.optimizer is None else momentum_buffers(self.optimizer, self.params),
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
                return async_rules.server_elastic_update(self.center, payload, self.alpha)
            diff = (payload - self.center).mul_(self.alpha)  # racy read of c, on purpose
            self._pool.submit(self.center.add_, diff)
            return diff
        grad = payload if self._pool is None else payload.clone()
        lrs, mask = split_request_extras(hdr, len(self.optimizer.param_groups))
        if self.lr is not None:
            lrs = [self.lr] * len(lrs)

        def step() -> None:
            optimizer_step_on(self.optimizer, self.params, grad[: self.n_params], mask, lrs)
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
            raise _interruption(signum, f"parameter server (rank {self.rank})")
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
            sender = _source_rank(work)
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

    def _reply_state(self, dst: int) -> None:
        """The center, then the rest of :meth:`state_dict` as one serialized blob."""
        blob = _to_blob(self.state_dict())
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


# ---------------------------------------------------------------------------- client
class _Pending:
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
    ) -> None:
        self.server, self.like, self.world = server_rank, like, world_size
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
              extras: list[float] | None = None) -> _Pending:
        """Send a request and post the reply receives; returns a handle for :meth:`end`."""
        hdr = self._header(op, step, lr, wd, extras)
        works = [ops.isend(hdr, self.server, kind=self.kind, tag=TAG_REQ)]
        if payload is not None:
            works.append(ops.isend(payload, self.server, kind=self.kind, tag=TAG_REQ_DATA))
        reply_hdr = torch.zeros(HEADER, dtype=torch.float64)
        reply = torch.empty_like(self.like)
        works.append(ops.irecv(reply_hdr, self.server, kind=self.kind, tag=TAG_REP))
        works.append(ops.irecv(reply, self.server, kind=self.kind, tag=TAG_REP_DATA))
        return _Pending(works, reply_hdr, reply, (hdr, payload))

    def end(self, pending: _Pending) -> torch.Tensor:
        """Wait for a request's reply; returns its payload (and records stop / updates)."""
        try:
            for work in pending.works:
                work.wait()
        except RuntimeError as err:
            raise self._error(err) from err
        get_meter().add_time(self.kind, time.perf_counter() - pending.start)
        self.updates = int(pending.reply_hdr[1])
        self.stop = self.stop or bool(pending.reply_hdr[2])
        return pending.reply

    def call(self, op: int, payload: torch.Tensor | None, step: int, lr: float = 0.0, wd: float = 0.0,
             extras: list[float] | None = None) -> torch.Tensor:
        return self.end(self.begin(op, payload, step, lr, wd, extras))

    def pull(self, step: int) -> torch.Tensor:
        """The server's current center."""
        return self.call(OP_PULL, None, step)

    def pull_state(self, step: int) -> dict:
        """The center and the server's state (for checkpoints)."""
        pending = self.begin(OP_STATE, None, step)
        center = self.end(pending)
        blob = torch.empty(int(pending.reply_hdr[3]), dtype=torch.uint8)
        try:
            ops.recv(blob, self.server, kind=self.kind, tag=TAG_REP_STATE)
        except RuntimeError as err:
            raise self._error(err) from err
        state = _from_blob(blob)
        state["center"] = center.detach().cpu().clone()
        return state

    def finish(self, step: int) -> torch.Tensor:
        """Tell the server this worker is done; wait for (and return) the final center."""
        hdr = self._header(OP_DONE, step, 0.0, 0.0, None)
        reply_hdr = torch.zeros(HEADER, dtype=torch.float64)
        final = torch.empty_like(self.like)
        try:
            ops.send(hdr, self.server, kind=self.kind, tag=TAG_REQ)
            w_hdr = ops.irecv(reply_hdr, self.server, kind=self.kind, tag=TAG_REP)
            w_data = ops.irecv(final, self.server, kind=self.kind, tag=TAG_REP_DATA)
            start = time.perf_counter()
            waiter = _Waiter()
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
            raise _interruption(signum, "worker waiting for the final center")
        return self.liveness is None or self.liveness.alive(self.server)


class _GradOnlyOptimizer:
    """Forwards to the wrapped optimizer, except that ``step(closure)`` only runs the closure.

    Lightning's closure (forward, backward, gradient clipping, hooks) runs as usual; the
    update itself is done by the parameter server / the shared model.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        object.__setattr__(self, "_optimizer", optimizer)

    def step(self, closure: Callable[[], Any] | None = None, **_: Any) -> Any:
        return closure() if closure is not None else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


# ---------------------------------------------------------------------------- transports
class _ServerTransport:
    """Worker-side exchange through the parameter server."""

    def __init__(self, client: ServerClient) -> None:
        self.client = client

    @property
    def stop(self) -> bool:
        return self.client.stop

    def begin_elastic(self, x: torch.Tensor, step: int, lr: float) -> Any:
        return self.client.begin(OP_ELASTIC, x, step, lr)

    def end_elastic(self, handle: Any) -> torch.Tensor:
        return self.client.end(handle)

    #: the worker's own optimizer does not step: the server steps the user's optimizer
    steps_locally = False

    def push_gradient(self, g: torch.Tensor, step: int, extras: list[float]) -> torch.Tensor:
        return self.client.call(OP_GRAD, g, step, extras=extras)

    def pull(self, step: int) -> torch.Tensor:
        return self.client.pull(step)

    def pull_state(self, step: int) -> dict:
        return self.client.pull_state(step)

    def finish(self, step: int) -> torch.Tensor:
        return self.client.finish(step)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- strategies
def _optimizer_from_hint(hint: dict | None) -> Optimizer | None:
    """A stand-in of the optimizer the CLI's module will build (``optim.*``), to check it
    before launch; None when the hint names none this knows (the config check reports it)."""
    if not hint:
        return None
    probe = [torch.zeros(1, requires_grad=True)]
    try:
        lr = float(hint.get("lr") or 0.0)
        wd = float(hint.get("weight_decay") or 0.0)
        if hint.get("optimizer") == "sgd":
            return torch.optim.SGD(probe, lr=lr, momentum=float(hint.get("momentum") or 0.0), weight_decay=wd)
        if hint.get("optimizer") == "adamw":
            return torch.optim.AdamW(probe, lr=lr, weight_decay=wd)
    except (TypeError, ValueError):  # a bad optim.* value: the config check names it
        return None
    return None


class AsyncCenterStrategy(CenterStrategy):
    """Shared machinery of the asynchronous strategies (see the module docstring)."""

    strategy_name = ""
    comm_kind = "parameter_server"
    min_world_size = 3
    #: "elastic" (EASGD family) or "sgd" (gradients pushed, weights pulled)
    rule = "elastic"
    #: EAMSGD velocity on the worker
    worker_momentum = False
    #: heavy-ball momentum at the server (Async MSGD)
    server_momentum = False
    #: lock-free application of updates (Hogwild)
    lockfree = False
    supports_final_validate = True

    def __init__(
        self,
        *,
        tau: int = 1,
        alpha: float | None = None,
        beta: float | None = None,
        rho: float | None = None,
        momentum: float | None = None,
        lr: float | None = None,
        server: str | None = "dedicated",
        stop_policy: str = "first",
        max_time_s: float | None = None,
        worker_timeout_s: float | None = None,
        heartbeat_s: float = 0.5,
        checkpoint_every_s: float | None = 30.0,
        checkpoint_path: str | None = None,
        overlap: bool = True,
        num_nodes_hint: int | None = None,
        optim_hint: dict | None = None,
        compression: Any = None,
        **kwargs: Any,
    ) -> None:
        name = self.strategy_name
        if compression is not None:
            raise ValueError(
                f"compression: {name} sends uncompressed parameter-server messages; use compression=none "
                "(compressed elastic exchanges: sync_easgd)"
            )
        super().__init__(**kwargs)
        self._tau = check_positive_int("strategy.tau", tau)
        for key, value in (("alpha", alpha), ("beta", beta)):
            if value is not None and not (isinstance(value, (int, float)) and 0.0 < float(value) < 1.0):
                raise ValueError(f"strategy.{key} must be in (0, 1), got {value!r}")
        if rho is not None and not (isinstance(rho, (int, float)) and float(rho) > 0):
            raise ValueError(f"strategy.rho must be > 0, got {rho!r}")
        self._alpha_opt, self._beta_opt, self._rho_opt = alpha, beta, rho
        self._alpha: float | None = None
        self._momentum = async_rules.check_momentum("strategy.momentum", 0.0 if momentum is None else momentum)
        if lr is not None and not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0):
            raise ValueError(f"strategy.lr must be a positive number or null, got {lr!r}")
        self._lr = None if lr is None else float(lr)
        if server not in (None, "dedicated"):
            raise ValueError(
                f"strategy.server={server!r} is not supported; choose 'dedicated' (the last rank serves)"
                + (" or null (shared memory on one node)" if self.lockfree else "")
            )
        self._server_mode = server
        if stop_policy not in STOP_POLICIES:
            raise ValueError(f"strategy.stop_policy={stop_policy!r}; choose one of {', '.join(STOP_POLICIES)}")
        self._stop_policy = stop_policy
        for key, value in (("max_time_s", max_time_s), ("worker_timeout_s", worker_timeout_s),
                           ("checkpoint_every_s", checkpoint_every_s)):
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"strategy.{key} must be a positive number of seconds or null, got {value!r}")
        if not (isinstance(heartbeat_s, (int, float)) and heartbeat_s > 0):
            raise ValueError(f"strategy.heartbeat_s must be > 0 seconds, got {heartbeat_s!r}")
        self._max_time_s = max_time_s
        self._worker_timeout_opt = worker_timeout_s
        self._heartbeat_s = float(heartbeat_s)
        self._checkpoint_every_s = checkpoint_every_s
        self._checkpoint_path = checkpoint_path
        self._overlap = bool(overlap)
        self._num_nodes_hint = num_nodes_hint
        self._check_nodes(num_nodes_hint)
        hinted = _optimizer_from_hint(optim_hint)
        if hinted is not None:  # the CLI: refuse before any process starts
            self._check_optimizer(hinted)
        # run state
        self._detached = False
        self._finished = False
        self._server: ParameterServer | None = None
        self._transport: Any = None
        self._liveness: Liveness | None = None
        self._velocity: torch.Tensor | None = None
        self._n_params = 0
        self._fit_start: float | None = None
        self._stop_reason: str | None = None
        self._exchanges = 0
        self._ckpt_state: dict | None = None
        self._resumed: dict | None = None
        self._center_ckpt_file: Path | None = None
        self._last_center_ckpt = 0.0
        self._error: str | None = None
        self._scored: dict | None = None  # the center (and server state) of the last validation
        self._signals = _SignalWatch(f"{name} rank ?", on_signal=self._pass_signal_on)
        self._interrupted: int | None = None
        self._passed_on = threading.Event()

    @classmethod
    def cli_kwargs(cls, cfg: Any) -> dict:
        """Extra constructor arguments from the full config (the CLI calls this)."""
        optim = cfg.get("optim") or {}
        hint = {k: optim.get(k) for k in ("optimizer", "lr", "momentum", "weight_decay")}
        return {"num_nodes_hint": int(cfg.trainer.get("num_nodes", 1) or 1), "optim_hint": hint}

    def _check_optimizer(self, optimizer: Optimizer) -> None:
        """Refuse (one line, before training) an optimizer this strategy would not run as given.

        * ``async_measgd`` runs EAMSGD: its Nesterov momentum replaces SGD's momentum. On top
          of another optimizer (Adam's first moment, RMSprop's momentum) it would compound two
          momenta, a rule neither the paper nor the user asked for, so it is refused rather
          than warned about (``async_easgd`` runs any optimizer on the workers).
        * ``async_msgd`` and ``hogwild_sgd`` with ``strategy.momentum`` > 0 apply that
          heavy-ball momentum as SGD's: torch.optim.SGD only, and no other momentum.
        * ``strategy.lr`` replaces every group's learning rate: refused over groups that differ.
        """
        who = self.strategy_name
        if self.worker_momentum and not isinstance(optimizer, torch.optim.SGD):
            raise ValueError(
                f"optim.optimizer: {who} adds EAMSGD Nesterov momentum (strategy.momentum) to SGD steps; "
                f"{type(optimizer).__name__} has momentum of its own and the two would compound: use "
                f"optim.optimizer=sgd, or strategy=async_easgd to run {type(optimizer).__name__} on the workers"
            )
        if self.rule != "sgd":
            return
        problem = None
        if self.server_momentum and self._momentum > 0:
            problem = async_rules.check_sgd_momentum(optimizer, self._momentum, who)
        problem = problem or async_rules.check_fixed_lr(optimizer, self._lr, who)
        if problem:
            raise ValueError(problem)

    def _check_nodes(self, num_nodes: int | None) -> None:
        """Hook: Hogwild refuses several nodes without a server."""

    # ------------------------------------------------------------------ roles
    @property
    def uses_server(self) -> bool:
        return self._server_mode is not None

    @property
    def server_rank(self) -> int | None:
        return self.world_size - 1 if self.uses_server else None

    @property
    def is_server(self) -> bool:
        return self.uses_server and self.global_rank == self.world_size - 1

    @property
    def num_workers(self) -> int:
        return self.world_size - 1 if self.uses_server else self.world_size

    @property
    def tau(self) -> int:
        return self._tau

    @property
    def alpha(self) -> float | None:
        return self._alpha

    def validate_world_size(self, world: int) -> None:
        """Called by the CLI before launch."""
        need = 3 if self.uses_server else 2
        if world < need:
            role = "2 workers + 1 parameter server" if self.uses_server else "2 workers"
            raise ValueError(
                f"trainer.devices: {self.strategy_name} needs at least {need} processes ({role}), got {world}"
            )
        if self.rule == "elastic" and self._rho_opt is None:
            elastic.resolve_alpha(
                world_size=world - 1 if self.uses_server else world,
                alpha=self._alpha_opt, beta=self._beta_opt,
            )

    @override
    def _validate_world(self, world_size: int) -> None:
        self.validate_world_size(world_size)
        if self.rule == "elastic":
            self._alpha = elastic.resolve_alpha(
                world_size=self.num_workers,
                alpha=self._alpha_opt,
                beta=self._beta_opt,
                rho=self._rho_opt,
                lr=self._optimizer_lr(self.optimizers[0]) if self.optimizers else None,
            )

    @property
    def _worker_timeout_s(self) -> float:
        if self._worker_timeout_opt is not None:
            return float(self._worker_timeout_opt)
        pg = getattr(self, "_timeout", None)
        total = pg.total_seconds() if isinstance(pg, timedelta) else 300.0
        return max(2.0, min(30.0, total / 2))

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Training data sharded over the workers; evaluation data not sharded (no all-reduce)."""
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        stage = trainer.state.stage if trainer is not None else None
        if stage is not None and stage != RunningStage.TRAINING:
            return {"num_replicas": 1, "rank": 0}
        if self.uses_server:
            return {"num_replicas": self.world_size - 1, "rank": min(self.global_rank, self.world_size - 2)}
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # ------------------------------------------------------------------ local collectives
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._detached:
            return
        super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._detached:
            return obj
        return super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if self._detached:
            return tensor
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if self._detached:
            return bool(decision)
        return super().reduce_boolean_decision(decision, all=all)

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        if self._detached:
            return tensor.unsqueeze(0)
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    def _patch_sigterm(self, trainer) -> None:
        """Lightning broadcasts a SIGTERM flag from rank 0 before every batch: a per-step
        synchronisation that would make the workers wait for each other. Check locally."""
        loop = trainer.fit_loop.epoch_loop
        if not hasattr(loop, "_broadcast_sigterm_tensor"):
            return
        from pytorch_lightning.utilities.exceptions import SIGTERMException

        def local_check() -> None:
            if getattr(trainer, "received_sigterm", False):
                raise SIGTERMException()

        loop._broadcast_sigterm_tensor = local_check

    # ------------------------------------------------------------------ set-up
    def _on_sigterm(self, signum: int, _frame: Any) -> None:
        """Lightning's SIGTERM notifier without its ``dist.broadcast`` (ranks that run apart
        never join one, so it would hang in the handler): record it, forward it to the
        processes Lightning's launcher started, and let the loops stop on it."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._interrupted = self._interrupted or signum
        self._pass_signal_on(signum)
        if trainer is not None:
            trainer._signal_connector.received_sigterm = True

    def _pass_signal_on(self, signum: int) -> None:
        """Once: send the signal to the processes Lightning's launcher started from this one
        (also from the signal watch, when this rank is blocked and its handler cannot run)."""
        if self._passed_on.is_set():
            return
        self._passed_on.set()
        if self.launcher is not None and signum == signal.SIGTERM:
            self.launcher.kill(signum)

    def _interrupted_by(self) -> int | None:
        return self._interrupted

    def _install_signal_handling(self, trainer) -> None:
        """Every rank ends promptly on SIGTERM / SIGINT, even one blocked in a wait."""
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None:  # read by register_signal_handlers(), which runs after setup
            connector._sigterm_notifier_fn = self._on_sigterm
        self._signals.who = f"{self.strategy_name} rank {self.global_rank}"
        self._signals.start()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Say why a collective timed out: after set-up, ranks of this strategy never meet."""
        super().on_exception(exception)
        text = str(exception)
        gloo = isinstance(exception, getattr(dist, "DistBackendError", ())) or any(
            mark in text for mark in ("imed out", "gloo", "Connection closed")
        )
        if self._fit_start is not None and gloo and not text.startswith("the parameter server"):
            server = f"the parameter server (rank {self.server_rank}) never joins one and " if self.uses_server else ""
            exception.args = (
                f"rank {self.global_rank}: a torch.distributed collective over every rank cannot complete "
                f"(it ends at timeout_s, or when a peer that timed out leaves): {self.strategy_name} ranks run "
                f"apart after set-up ({server}workers train at their own pace), so the module and callbacks "
                "must not call one (self.log(sync_dist=True) and torchmetrics metrics are computed per rank "
                f"by this strategy). Cause: {text}",
            )

    @override
    def setup(self, trainer) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            if not self._detached:
                return super().setup(trainer)
            # DDPStrategy.setup without its module-state broadcast (a dead worker would hang it)
            self.accelerator.setup(trainer)
            self.precision_plugin.convert_module(self.model)
            self.model_to_device()
            self.setup_precision_plugin()
            local_metrics(self.lightning_module)
            self._install_signal_handling(trainer)
            return
        DDPStrategy.setup(self, trainer)
        if len(self.optimizers) != 1:
            raise ValueError(
                f"{type(self).__name__} supports exactly one optimizer "
                f"(configure_optimizers returned {len(self.optimizers)})"
            )
        self._check_optimizer(self.optimizers[0])
        self._validate_world(self.world_size)
        module = self.lightning_module
        local_metrics(module)
        tensors = self._elastic_tensors()
        self._n_params = sum(p.numel() for p in module.parameters())
        flat = flatten(tensors)
        ops.broadcast(flat, src=0, kind="setup")
        token = torch.randint(0, 2**62, (1,), dtype=torch.int64)
        ops.broadcast(token, src=0, kind="setup")
        state = self._resume_state
        if state is not None:
            flat = state["center"].to(device=flat.device, dtype=flat.dtype).clone()
            steps = state.get("steps") or []
            if self.global_rank < len(steps) and steps[self.global_rank] is not None:
                self._local_steps = int(steps[self.global_rank])
        unflatten_into(flat, tensors)
        self._center = flat.clone()
        self._liveness = Liveness(
            f"easgd_async/{int(token)}", self.global_rank,
            interval_s=self._heartbeat_s, dead_after_s=self._worker_timeout_s,
        ).start()
        self._setup_checkpoint_file(trainer)
        self._make_transport(trainer, int(token))
        if self.worker_momentum and not self.is_server:
            self._own_momentum(self.optimizers[0])
            self._velocity = torch.zeros_like(flat)
        self._patch_sigterm(trainer)
        self._install_signal_handling(trainer)
        self._detached = True

    def _setup_checkpoint_file(self, trainer) -> None:
        if self._checkpoint_path:
            self._center_ckpt_file = Path(self._checkpoint_path)
            return
        callback = getattr(trainer, "checkpoint_callback", None)
        dirpath = getattr(callback, "dirpath", None)
        self._center_ckpt_file = Path(dirpath) / "center.ckpt" if dirpath else None

    def _make_transport(self, trainer, token: int) -> None:
        """Server: build the server loop; workers: a client of it."""
        if self.is_server:
            self._server = ParameterServer(
                rank=self.global_rank,
                workers=list(range(self.world_size - 1)),
                center=self._center,
                n_params=self._n_params,
                rule=self.rule,
                alpha=self._alpha or 0.0,
                lr=self._lr,
                optimizer=self.optimizers[0] if self.rule == "sgd" else None,
                params=list(self.lightning_module.parameters()) if self.rule == "sgd" else None,
                lockfree=self.lockfree,
                liveness=self._liveness,
                stop_policy=self._stop_policy,
                kind=self.comm_kind,
                on_checkpoint=self._write_center_checkpoint if self._center_ckpt_file else None,
                checkpoint_every_s=self._checkpoint_every_s,
                interrupted=self._interrupted_by,
            )
            if self._resume_state is not None:
                srv = self._resume_state.get("server") or {}
                self._server.load_state_dict(srv)
                self._resumed = _describe_resume(self._center, srv)
        else:
            sgd = self.rule == "sgd"
            header = request_header_size(self.optimizers[0] if sgd else None, list(self.lightning_module.parameters()))
            self._transport = _ServerTransport(
                ServerClient(self.world_size - 1, self._center, self.world_size, n_params=self._n_params,
                             kind=self.comm_kind, liveness=self._liveness, header_size=header,
                             interrupted=self._interrupted_by)
            )

    def _own_momentum(self, optimizer: Optimizer) -> None:
        """EAMSGD applies its own momentum: switch the optimizer's off."""
        changed = False
        for group in optimizer.param_groups:
            if group.get("momentum", 0):
                group["momentum"] = 0.0
                changed = True
            if group.get("nesterov"):
                group["nesterov"] = False
        if changed and self.global_rank == 0:
            rank_zero_warn(
                f"{self.strategy_name} applies its own Nesterov momentum (strategy.momentum="
                f"{self._momentum}); the optimizer's momentum was set to 0 so it is not applied twice"
            )

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        # one real barrier so that start-up skew does not count as speed (everyone is alive here)
        ops.barrier(kind="setup")
        self._fit_start = time.monotonic()
        if self.is_server:
            try:
                self._server.serve()
            finally:
                self._center = self._server.center
            self.lightning_module.trainer.should_stop = True

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model=None, **kwargs: Any) -> Any:
        if self.is_server:  # the server never trains
            self.lightning_module.trainer.should_stop = True
            return None
        self._local_steps += 1
        self._scored = None  # the center moves on: a checkpoint from now on pulls a fresh one
        if self.rule == "sgd":
            local = self._transport.steps_locally  # Hogwild on shared memory: the worker steps
            step_with = optimizer if local else _GradOnlyOptimizer(optimizer)
            compute = lambda: DDPStrategy.optimizer_step(self, step_with, closure, model, **kwargs)  # noqa: E731
            out = self._sgd_exchange(compute, optimizer)
        else:
            take = lambda: DDPStrategy.optimizer_step(self, optimizer, closure, model, **kwargs)  # noqa: E731
            out = self._elastic_exchange(take, optimizer)
        self._after_step()
        return out

    def _elastic_exchange(self, take_step: Callable[[], Any], optimizer: Optimizer) -> Any:
        tensors = self._elastic_tensors()
        pending, diff = None, None
        if elastic.is_exchange_step(self._local_steps, self._tau):
            pending = self._transport.begin_elastic(flatten(tensors), self._local_steps, self._optimizer_lr(optimizer))
            self._exchanges += 1
            if not self._overlap:
                diff, pending = self._transport.end_elastic(pending), None
        x_look = None
        if self._velocity is not None:
            x_look = async_rules.nesterov_lookahead(flatten(tensors), self._velocity, self._momentum)
            unflatten_into(x_look, tensors)
        out = take_step()
        with torch.no_grad():
            x = flatten(tensors)
            if x_look is not None:
                async_rules.nesterov_velocity_update(self._velocity, x_look, x)
            if pending is not None:
                diff = self._transport.end_elastic(pending)
            if diff is not None:
                elastic.apply_elastic_pull(x, diff)
            unflatten_into(x, tensors)
        return out

    def _grad_vector(self) -> torch.Tensor:
        """Gradients (zeros where none: the request's mask says which) then float buffers."""
        module = self.lightning_module
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1)
            for p in module.parameters()
        ]
        parts += [b.detach().reshape(-1) for b in module.buffers() if b.is_floating_point()]
        return torch.cat(parts)

    def _sgd_exchange(self, compute: Callable[[], Any], optimizer: Optimizer) -> Any:
        """Async SGD / MSGD: push the gradient, the server steps the user's optimizer and
        returns w. Hogwild SGD on shared memory: the worker's optimizer steps here and its
        displacement is added to the shared w without a lock."""
        params = list(self.lightning_module.parameters())
        if self._lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = self._lr
        if self._transport.steps_locally:
            before = flatten(params)
            out = compute()
            moves = async_rules.optimizer_displacement(before, params)
            buffers = [b.detach().reshape(-1) for b in self.lightning_module.buffers() if b.is_floating_point()]
            sizes = [p.numel() for p in params]
            weights = self._transport.push_displacement(moves, sizes, buffers, self._local_steps)
        else:
            out = compute()
            extras = request_extras(optimizer, params)
            weights = self._transport.push_gradient(self._grad_vector(), self._local_steps, extras)
        self._exchanges += 1
        unflatten_into(weights, self._elastic_tensors())
        return out

    def _after_step(self) -> None:
        trainer = self.lightning_module.trainer
        if self._transport is not None and self._transport.stop and self._stop_policy == "first":
            self._stop_reason = self._stop_reason or "another worker finished (stop_policy=first)"
            trainer.should_stop = True
        if self._max_time_s is not None and self._fit_start is not None:
            if time.monotonic() - self._fit_start >= self._max_time_s:
                self._stop_reason = self._stop_reason or f"max_time_s={self._max_time_s} reached"
                trainer.should_stop = True

    @override
    def _fetch_center(self) -> None:
        """Pull the center to validate. Rank 0, which writes the checkpoints, pulls it with the
        server's state and keeps both: a checkpoint saved after this validation holds the
        center that was scored (ModelCheckpoint(monitor=...) selects by that score)."""
        # before training starts (sanity check) every rank already holds the set-up center
        if self._finished or self.is_server or self._transport is None or self._fit_start is None:
            return
        trainer = self.lightning_module.trainer
        if self.is_global_zero and trainer.checkpoint_callbacks:
            self._scored = self._transport.pull_state(self._local_steps)
            self._center = self._scored["center"].to(self._center.device, self._center.dtype)
        else:
            self._center = self._transport.pull(self._local_steps)

    @override
    def on_train_end(self) -> None:
        DDPStrategy.on_train_end(self)
        self._scored = None  # from here on the module holds the final center: checkpoints save it
        if self._center is None:
            return
        self._swap_out()
        try:
            if self._transport is not None and not self._finished:
                self._center = self._transport.finish(self._local_steps)
            unflatten_into(self._center, self._elastic_tensors())
        finally:
            self._finished = True
            if self._liveness is not None:
                self._liveness.stop()
            if self._transport is not None:
                self._transport.close()

    # ------------------------------------------------------------------ checkpoints
    def _center_state_dict(self, center: torch.Tensor) -> dict:
        tensors = self._elastic_tensors()
        stash = self._stash if self._stash is not None else flatten(tensors)
        unflatten_into(center, tensors)
        try:
            return {k: v.detach().cpu().clone() for k, v in self.lightning_module.state_dict().items()}
        finally:
            unflatten_into(stash, tensors)

    def _server_state_now(self) -> dict:
        """The center and the server's state, as this rank can best know them now."""
        if self._server is not None:
            state = self._server.state_dict()
            state["center"] = self._server.center.detach().cpu().clone()
            return state
        if self._transport is not None and not self._finished:
            return self._transport.pull_state(self._local_steps)
        return {"center": self._center.detach().cpu().clone(), "updates": None, "momentum": None}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The center's weights: on rank 0, the center of the last validation when this rank has
        not trained since (what a monitored metric scored), else one pulled now with the
        server's state."""
        if self._center is None:
            return DDPStrategy.lightning_module_state_dict(self)
        if self.is_global_zero:
            self._ckpt_state = self._scored if self._scored is not None else self._server_state_now()
            self._center = self._ckpt_state["center"].to(self._center.device, self._center.dtype)
        return self._center_state_dict(self._center)

    def _easgd_payload(self, state: dict) -> dict:
        server = {k: state.get(k) for k in ("updates", "served", "worker_steps", "momentum", "optimizer")}
        steps = state.get("worker_steps")
        return {
            "strategy": self.strategy_name,
            "center": state["center"].detach().cpu().clone(),
            "server": server,
            "steps": steps,
            "workers": [],
            "world_size": self.world_size,
            "server_rank": self.server_rank,
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Rank 0 writes the center and the server state; no collective (workers run apart)."""
        if not self.is_global_zero:
            return
        if self._center is not None:
            state = self._ckpt_state or self._server_state_now()
            self._ckpt_state = None
            checkpoint["easgd"] = self._easgd_payload(state)
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _write_center_checkpoint(self, state: dict) -> None:
        """The center file written by whoever holds the center (atomic: temp file + rename)."""
        if self._center_ckpt_file is None:
            return
        import pytorch_lightning as pl

        from easgd_lightning.utils.atomic import atomic_torch_save

        center = state["center"].to(self._center.device, self._center.dtype)
        payload = {
            "epoch": 0,
            "global_step": 0,
            "pytorch-lightning_version": pl.__version__,
            "state_dict": self._center_state_dict(center),
            "optimizer_states": [],
            "lr_schedulers": [],
            "easgd": self._easgd_payload(state),
            "written_at": time.time(),
        }
        try:
            atomic_torch_save(payload, self._center_ckpt_file)
        except OSError as err:  # never kill the server for a full disk; say so
            log.warning("could not write %s: %s", self._center_ckpt_file, err)

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        """Workers restart from the center with fresh optimizer state."""
        if checkpoint.get("easgd") is None:
            return super().load_optimizer_state_dict(checkpoint)

    # ------------------------------------------------------------------ reporting
    @override
    def summary_extras(self) -> dict:
        extras: dict[str, Any] = {
            "role": "server" if self.is_server else "worker",
            "server_rank": self.server_rank,
            "tau": self._tau if self.rule == "elastic" else None,
            "alpha": self._alpha,
            "momentum": self._momentum,
            "stop_policy": self._stop_policy,
        }
        if self.is_server and self._server is not None:
            srv = self._server
            extras.update(
                updates=srv.updates,
                served_per_rank=srv.served,
                worker_steps=srv.worker_steps,
                done_workers=srv.done,
                dead_workers=srv.dead,
                service_order=list(srv.service_log)[-400:],
                lockfree=srv.lockfree,
                resumed=self._resumed,
                center_checkpoint=str(self._center_ckpt_file) if self._center_ckpt_file else None,
            )
        else:
            extras.update(exchanges=self._exchanges, stop_reason=self._stop_reason or "own epochs/steps done")
        return extras

    @override
    def teardown(self) -> None:
        if self._liveness is not None:  # done serving or failed: either way, stop the heartbeat
            self._liveness.stop()
        self._signals.stop()
        super().teardown()


def _describe_resume(center: torch.Tensor, server_state: dict) -> dict:
    mom = server_state.get("momentum")
    return {
        "center_sum": float(center.double().sum()),
        "updates": server_state.get("updates"),
        "momentum_sum": None if mom is None else float(mom.double().sum()),
    }


_COMMON = ("stop_policy", "max_time_s", "worker_timeout_s", "heartbeat_s", "checkpoint_every_s",
           "checkpoint_path", "server")


@register_strategy("async_easgd")
class AsyncEASGDStrategy(AsyncCenterStrategy):
    """Async EASGD: FCFS parameter server, elastic exchange every tau steps (``strategy="async_easgd"``).

    Args:
        tau: communication period in local steps (>= 1).
        alpha: moving rate in (0, 1); or ``beta`` (= p * alpha over the p workers) or ``rho``
            (alpha = lr * rho). Default beta = 0.9.
        server: ``"dedicated"`` (the last rank serves; the only mode).
        stop_policy: ``"first"`` (stop everyone when the first worker finishes) or ``"all"``.
        max_time_s: optional wall-clock budget per worker.
        worker_timeout_s: heartbeat silence after which a rank is dead (default min(30, timeout/2)).
        checkpoint_every_s: period of the server's ``center.ckpt`` (null: only at the end).
        overlap: send x before the local step and collect d after it (SC17).
    """

    strategy_name = "async_easgd"
    _OPTIONS = ("tau", "alpha", "beta", "rho", "overlap", *_COMMON)

    def __init__(self, tau: int = 1, alpha: float | None = None, beta: float | None = None,
                 rho: float | None = None, **kwargs: Any) -> None:
        _reject_unknown(self.strategy_name, kwargs, self._OPTIONS)
        super().__init__(tau=tau, alpha=alpha, beta=beta, rho=rho, **kwargs)


@register_strategy("async_measgd")
class AsyncMEASGDStrategy(AsyncCenterStrategy):
    """Async MEASGD: Async EASGD with EAMSGD Nesterov momentum on the workers (``strategy="async_measgd"``).

    Args:
        momentum: delta in [0, 1) (default 0.9); replaces the optimizer's own momentum.
        tau, alpha, beta, rho, ...: as :class:`AsyncEASGDStrategy`.
    """

    strategy_name = "async_measgd"
    worker_momentum = True
    _OPTIONS = ("tau", "alpha", "beta", "rho", "momentum", "overlap", *_COMMON)

    def __init__(self, tau: int = 1, momentum: float = 0.9, alpha: float | None = None,
                 beta: float | None = None, rho: float | None = None, **kwargs: Any) -> None:
        _reject_unknown(self.strategy_name, kwargs, self._OPTIONS)
        super().__init__(tau=tau, momentum=momentum, alpha=alpha, beta=beta, rho=rho, **kwargs)


@register_strategy("async_sgd")
class AsyncSGDStrategy(AsyncCenterStrategy):
    """Async SGD: workers push gradients, the server applies SGD and returns weights (``strategy="async_sgd"``).

    Args:
        lr: server learning rate (null: the worker optimizer's current lr, sent with each push).
        stop_policy, max_time_s, ...: as :class:`AsyncEASGDStrategy`.
    """

    strategy_name = "async_sgd"
    rule = "sgd"
    _OPTIONS = ("lr", *_COMMON)

    def __init__(self, lr: float | None = None, **kwargs: Any) -> None:
        _reject_unknown(self.strategy_name, kwargs, self._OPTIONS)
        super().__init__(lr=lr, **kwargs)


@register_strategy("async_msgd")
class AsyncMSGDStrategy(AsyncCenterStrategy):
    """Async MSGD: Async SGD with heavy-ball momentum at the server (``strategy="async_msgd"``).

    Args:
        momentum: mu in [0, 1) (default 0.9), held by the server (checkpointed with it).
        lr: as :class:`AsyncSGDStrategy`.
    """

    strategy_name = "async_msgd"
    rule = "sgd"
    server_momentum = True
    _OPTIONS = ("lr", "momentum", *_COMMON)

    def __init__(self, momentum: float = 0.9, lr: float | None = None, **kwargs: Any) -> None:
        _reject_unknown(self.strategy_name, kwargs, self._OPTIONS)
        super().__init__(momentum=momentum, lr=lr, **kwargs)
