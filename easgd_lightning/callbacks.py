"""Lightning callbacks used by the CLI: comm metrics, validation history, fault injection,
an atomic CheckpointIO, checkpoints that keep ``last.ckpt`` newest, and the graceful stop on
SIGTERM / SIGINT."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins import TorchCheckpointIO
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities.exceptions import SIGTERMException

from easgd_lightning.comm import get_meter, ops
from easgd_lightning.compat import lightning as compat
from easgd_lightning.compat.lightning import PATH
from easgd_lightning.utils import stop
from easgd_lightning.utils.atomic import atomic_torch_save
from easgd_lightning.utils.cputime import cpu_delta, cpu_reading

__all__ = [
    "AtomicCheckpointIO",
    "CommMetricsCallback",
    "ValHistoryCallback",
    "TrainClockCallback",
    "FaultInjectionCallback",
    "EpochPrinter",
    "LastFirstCheckpoint",
    "SignalStop",
]


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` that writes a temporary file and renames it into place."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PATH, storage_options: Any | None = None) -> None:
        atomic_torch_save(checkpoint, path)


def comm_series(snapshot: dict, elapsed: float) -> dict[str, float]:
    """The ``comm/*`` series of one meter snapshot: totals (bytes sent, dense bytes, time
    and exposed time as fractions of ``elapsed``) and, per traffic kind, its bytes sent and
    exposed seconds (``comm/<kind>/bytes_sent``, ``comm/<kind>/exposed_s``)."""
    elapsed = max(1e-9, elapsed)
    out = {
        "comm/bytes_sent": float(snapshot["bytes_sent"]),
        "comm/dense_bytes": float(snapshot["dense_bytes"]),
        "comm/time_fraction": snapshot["time_s"] / elapsed,
        "comm/exposed_fraction": snapshot["exposed_s"] / elapsed,
    }
    for kind, totals in snapshot.get("by_kind", {}).items():
        out[f"comm/{kind}/bytes_sent"] = float(totals["bytes_sent"])
        out[f"comm/{kind}/exposed_s"] = float(totals["exposed_s"])
    return out


class CommMetricsCallback(pl.Callback):
    """Logs this rank's communication series (:func:`comm_series`) every ``every`` steps,
    to whichever logger the Trainer has (wandb, TensorBoard, CSV)."""

    def __init__(self, every: int = 10) -> None:
        self.every = max(1, every)
        self.fit_start: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.fit_start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every or self.fit_start is None:
            return
        series = comm_series(get_meter().snapshot(), time.perf_counter() - self.fit_start)
        pl_module.log_dict(series, on_step=True, on_epoch=False)


class ValHistoryCallback(pl.Callback):
    """Records (seconds since fit start, step, val/acc, val/loss) after each validation."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.history: list[dict] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.start is None or trainer.sanity_checking:
            return
        m = trainer.callback_metrics
        self.history.append(
            {
                "time_s": time.perf_counter() - self.start,
                "step": int(trainer.global_step),
                "epoch": int(trainer.current_epoch),
                "val_acc": float(m["val/acc"]) if "val/acc" in m else None,
                "val_loss": float(m["val/loss"]) if "val/loss" in m else None,
            }
        )


class TrainClockCallback(pl.Callback):
    """This rank's training clock: seconds from ``on_train_start`` to the end of its last
    training batch, less the validation passes run in between (``train_time_s``, None until
    a batch ends). Unlike the wall time of ``fit`` it leaves out the process group's and
    the strategy's set-up and the final validation, whose jitter from run to run would
    otherwise enter a step time taken as the difference of two runs (``bench/_tables.py``)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.val_start: float | None = None
        self.val_s = 0.0
        self.train_time_s: float | None = None
        self._cpu_start: dict | None = None
        self._val_cpu: list[tuple[dict, dict]] = []  # (start, end) readings of validation passes
        #: CPU time from the start to the end of training, validation passes left out:
        #: ``cputime.cpu_delta`` of the machine's and this process's; None before the end
        self.train_cpu: dict | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.start, self.val_s = time.perf_counter(), 0.0
        self._cpu_start, self._val_cpu, self.train_cpu = cpu_reading(), [], None

    def on_train_end(self, trainer, pl_module) -> None:
        if self._cpu_start is not None:
            self.train_cpu = cpu_delta(cpu_reading(), self._cpu_start, less=self._val_cpu)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.start is not None:
            self.train_time_s = time.perf_counter() - self.start - self.val_s

    def on_validation_start(self, trainer, pl_module) -> None:
        if self.start is not None and not trainer.sanity_checking:
            self.val_start = time.perf_counter()
            self._val_cpu.append((cpu_reading(), {}))

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.val_start is not None:
            self.val_s += time.perf_counter() - self.val_start
            self.val_start = None
            self._val_cpu[-1] = (self._val_cpu[-1][0], cpu_reading())


class FaultInjectionCallback(pl.Callback):
    """``faults.slow_rank``/``slow_ms``: sleep before every step; ``crash_rank``/``crash_at_step``: die
    (``os._exit(17)``); ``kill_rank``/``kill_at_step``: SIGKILL itself (``kill_at_end``: after its last
    step, in the callbacks' end of fit -- before the strategy's, where it reports its end)."""

    def __init__(self, slow_rank=None, slow_ms=0, crash_rank=None, crash_at_step=None, kill_rank=None,
                 kill_at_step=None, kill_at_end=False, **_: Any):
        self.slow_rank, self.slow_ms = slow_rank, float(slow_ms or 0)
        self.crash_rank, self.crash_at_step = crash_rank, crash_at_step
        # faults.kill_rank / kill_at_step: SIGKILL, on the worker's first start only (a worker
        # restarted under ft=torchft, EASGD_FT_ATTEMPT > 0, is not killed again)
        first_start = os.environ.get("EASGD_FT_ATTEMPT", "0") == "0"
        self.kill_rank, self.kill_at_step = (kill_rank, kill_at_step) if first_start else (None, None)
        self.kill_at_end = bool(kill_at_end) and first_start
        self.steps = 0

    def on_train_end(self, trainer, pl_module) -> None:
        if self.kill_at_end and self.kill_rank is not None and trainer.global_rank == self.kill_rank:
            print(f"[faults] rank {self.kill_rank} SIGKILLs itself after its last step ({self.steps})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        rank = trainer.global_rank
        self.steps += 1
        if self.crash_rank is not None and rank == self.crash_rank and self.steps >= self.crash_at_step:
            print(f"[faults] rank {rank} crashing at step {self.steps}", flush=True)
            os._exit(17)
        if self.kill_at_step is not None and rank == self.kill_rank and self.steps >= self.kill_at_step:
            print(f"[faults] rank {rank} SIGKILLs itself at step {self.steps}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.slow_rank is not None and rank == self.slow_rank and self.slow_ms > 0:
            time.sleep(self.slow_ms / 1000.0)


class EpochPrinter(pl.Callback):
    """One plain progress line per validation on global rank 0 (for logs and pipes)."""

    def __init__(self, label: str = "") -> None:
        self.label = label
        self.start: float | None = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking or self.start is None:
            return
        if trainer.state.fn != "fit":
            return
        m = trainer.callback_metrics
        acc = f"{float(m['val/acc']):.4f}" if "val/acc" in m else "-"
        loss = f"{float(m['val/loss']):.4f}" if "val/loss" in m else "-"
        meter = get_meter()
        print(
            f"[{self.label}] epoch {trainer.current_epoch + 1}/{trainer.max_epochs} "
            f"step {trainer.global_step} t={time.perf_counter() - self.start:.1f}s "
            f"val/acc={acc} val/loss={loss} sent={meter.bytes_sent / 1e6:.2f}MB "
            f"comm={meter.time_s:.2f}s",
            flush=True,
        )


class LastFirstCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that writes ``last.ckpt`` *before* the epoch file.

    Lightning writes ``epochNNN.ckpt`` and then ``last.ckpt``; a kill between the two leaves
    ``last.ckpt`` one epoch older than the newest epoch file, and resuming from it loses that
    epoch. In this order a kill in between leaves ``last.ckpt`` the newest, never older.
    Overrides Lightning's two private write steps by name
    (:data:`~easgd_lightning.compat.lightning.CHECKPOINT_TOPK_STEP`, ``CHECKPOINT_LAST_STEP``;
    checked by ``tests/unit/compat/test_compat_lightning.py``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last_written_at: tuple[int, int] | None = None

    def _save_topk_checkpoint(self, trainer, monitor_candidates) -> None:
        if self.save_last and self.save_top_k != 0:
            self._save_last_checkpoint(trainer, monitor_candidates)
        super()._save_topk_checkpoint(trainer, monitor_candidates)

    def _save_last_checkpoint(self, trainer, monitor_candidates) -> None:
        at = (trainer.current_epoch, trainer.global_step)
        if self._last_written_at == at:  # already written just before the epoch file
            return
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_written_at = at


class _FlagSignalConnector(compat.SignalConnector):
    """Lightning's signal connector without its SIGTERM handler (which runs a broadcast
    inside the handler and hangs when a rank never joins). ``received_sigterm`` is True
    once ``SignalStop`` has decided to stop; the signal itself only sets a flag."""

    def __init__(self, trainer) -> None:
        self.stopping = False
        super().__init__(trainer)

    @property  # type: ignore[override]
    def received_sigterm(self) -> bool:
        return self.stopping

    @received_sigterm.setter
    def received_sigterm(self, value: bool) -> None:  # Lightning resets it; the decision is ours
        pass

    def register_signal_handlers(self) -> None:
        stop.install_stop_handlers(stop.grace_s())

    def teardown(self) -> None:
        pass  # keep routing signals to the flag until the process ends


#: seconds between two stop checks of the lockstep strategies (a stop takes effect within
#: about this long plus a step); STOP_CHECK_MAX_PERIOD bounds the steps between checks
STOP_CHECK_INTERVAL_S = 0.2
STOP_CHECK_MAX_PERIOD = 1000


class SignalStop(pl.Callback):
    """Stop training at a step boundary after SIGTERM / SIGINT, all ranks together.

    * Strategies whose ranks step in lockstep (DDP, synchronous EASGD, local SGD, round
      robin, pipeline): global rank 0 decides. A signalled rank publishes its signal in the
      rendezvous store (key ``easgd/stop/<run id>/<rank>``); at a check step rank 0 reads
      the store's stop counter and broadcasts who was signalled, and every rank stops at
      that same step. This replaces Lightning's broadcast of a SIGTERM flag before every
      step: the broadcast also carries how many steps until the next check, chosen by rank
      0 so that checks are about ``STOP_CHECK_INTERVAL_S`` apart (every step when steps
      are slower than that), so short steps do not pay a round trip each.
    * Strategies that replaced that per-step broadcast with a local check (the parameter
      server and Hogwild families, whose workers never wait for each other): each rank
      stops on its own signal.

    On the stop, ``last.ckpt`` is written when checkpointing is on (all ranks take part:
    saving may gather state), then ``SIGTERMException`` ends ``fit``.
    """

    def __init__(self, checkpoint_dir: str | None = None) -> None:
        self.checkpoint_dir = checkpoint_dir
        self.signalled_ranks: list[int] = []  # ranks whose own signal stopped the run
        self.signal: int | None = None
        self._connector: _FlagSignalConnector | None = None
        self._store = None
        self._published = False
        self._until_check = 0  # steps before the next agreed check (0: check now)
        self._last_check: tuple[float, int] | None = None  # rank 0: (time, steps) of the last check
        self._calls = 0

    def attach(self, trainer: pl.Trainer) -> None:
        """Replace the trainer's signal connector (call before ``fit``)."""
        self._connector = _FlagSignalConnector(trainer)
        compat.set_signal_connector(trainer, self._connector)

    def on_fit_start(self, trainer, pl_module) -> None:
        original = compat.sigterm_broadcast_replacement(trainer)
        if original is not None:
            # the strategy checks locally (its workers run apart): a rank stops on its own flag

            def local_stop() -> None:
                signum = stop.stop_signal()
                if signum is not None:
                    self._decide(trainer, signum, [trainer.global_rank])
                original()

            compat.replace_sigterm_broadcast(trainer, local_stop)
        else:
            self._store = _stop_store()
            compat.replace_sigterm_broadcast(trainer, lambda: self._agree(trainer))

    def _key(self, rank: int | str) -> str:
        return f"easgd/stop/{os.environ.get('EASGD_RUN_ID', 'run')}/{rank}"

    def _agree(self, trainer) -> None:
        import torch.distributed as dist

        mine = stop.stop_signal()
        rank, world = trainer.global_rank, trainer.world_size
        if not (dist.is_available() and dist.is_initialized() and world > 1):
            if mine is not None:
                self._decide(trainer, mine, [rank])
            return
        if mine is not None and not self._published and self._store is not None:
            self._store.set(self._key(rank), str(mine))
            self._store.add(self._key("count"), 1)
            self._published = True
        self._calls += 1
        if self._until_check > 1:
            self._until_check -= 1
            return
        flags = torch.zeros(world + 1, dtype=torch.int64, device=trainer.strategy.root_device)
        if rank == 0:
            if mine is not None:
                flags[0] = mine
            if self._store is not None and self._store.add(self._key("count"), 0) > 0:
                for r in range(1, world):
                    if self._store.check([self._key(r)]):
                        flags[r] = int(self._store.get(self._key(r)))
            flags[world] = self._next_period()
        ops.broadcast_control(flags, src=0)  # errors propagate: a lost peer must fail the run
        values = flags.tolist()
        self._until_check = int(values[world])
        signalled = [r for r, s in enumerate(values[:world]) if s]
        if signalled:
            self._decide(trainer, int(values[signalled[0]]), signalled)

    def _next_period(self) -> int:
        """Rank 0: steps until the next check, so that checks are ~STOP_CHECK_INTERVAL_S apart
        (from the steps per second since the last check; 1 at first)."""
        now = time.monotonic()
        last, self._last_check = self._last_check, (now, self._calls)
        if last is None or now <= last[0]:
            return 1
        per_step = (now - last[0]) / max(1, self._calls - last[1])
        return max(1, min(STOP_CHECK_MAX_PERIOD, int(STOP_CHECK_INTERVAL_S / per_step)))

    def _decide(self, trainer, signum: int, ranks: list[int]) -> None:
        self.signal, self.signalled_ranks = signum, ranks
        if self._connector is not None:
            self._connector.stopping = True
        raise SIGTERMException()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or self.signal is None or not self.checkpoint_dir:
            return
        trainer.save_checkpoint(os.path.join(self.checkpoint_dir, "last.ckpt"))


def _stop_store():
    """A client of the rendezvous store (``MASTER_ADDR:MASTER_PORT``), or None without one."""
    from datetime import timedelta

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        return torch.distributed.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=30))
    except (RuntimeError, ValueError):  # no store to reach: rank 0's own signal still stops all
        return None
