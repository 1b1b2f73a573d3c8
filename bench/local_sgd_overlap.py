"""Step time of local SGD with and without CoCoD-SGD overlap, measured in the same run.

Starts ``--workers`` gloo processes (one rank each, as nodes of a multi-node run); each
trains the same MLP on synthetic data with ``LocalSGDStrategy(tau=H, cocod=False)``
and ``cocod=True`` alternately (``--repeats`` runs of each, a fresh Trainer every time)
and records the wall time of every optimizer step after the first round.

Communication-slowing knobs:

* ``--rate-mbit R`` (and ``--latency-ms L``): the ranks run in network namespaces joined by
  a bridge whose links are shaped with ``tc`` (``bench/cluster.py``'s
  :class:`EmulatedCluster`; needs root or CAP_NET_ADMIN + CAP_SYS_ADMIN). The transfer
  then takes real time while the CPUs stay free, as on a real network.
* ``--payload-mb M``: a buffer of M megabytes joins the averaged variable, so every
  averaging all-reduce carries it, while the compute per step stays that of the MLP
  (``--hidden``, ``--batch``). On loopback (no ``--rate-mbit``) gloo's transfer and
  reduction are memory copies that compete with the computation for the same cores, so on
  a machine with fewer free cores than 2 x workers overlap cannot pay off.
* ``--sleep-ms S``: emulated accelerator compute: the training step sleeps S ms, leaving
  the CPU to the communication thread, as while a GPU computes.

Prints, per mode: mean step time (per step, the slowest rank; median over runs), the
meter's communication time per rank (for the overlap mode it includes the time the
all-reduce ran behind the computation), bytes sent, and the ratio overlap / blocking.
Nothing is asserted about time: it is a measurement.

Usage::

    OMP_NUM_THREADS=1 .venv/bin/python -m bench.local_sgd_overlap
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.local_sgd_overlap --rate-mbit 100 --payload-mb 4
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.local_sgd_overlap --payload-mb 0      # no slowing
    OMP_NUM_THREADS=1 .venv/bin/python -m bench.local_sgd_overlap --sleep-ms 40 --hidden 64

Exit codes: 0 measured; 1 a rank failed; 2 the emulated network cannot be built here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._scenarios import REPO
from easgd_lightning.utils.rank_env import clean_env, free_port, rank_env

__all__ = ["main", "parse_args", "summarise"]

RANK_TIMEOUT_S = 600


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=2, help="gloo processes (default 2)")
    p.add_argument("--period", type=int, default=4, help="H, local steps per round (default 4)")
    p.add_argument("--steps", type=int, default=48, help="optimizer steps per run (default 48)")
    p.add_argument(
        "--payload-mb", type=float, default=8.0, help="extra megabytes in every average (default 8)"
    )
    p.add_argument(
        "--rate-mbit",
        type=float,
        default=None,
        help="shape every rank's link to this rate (network namespaces; default: loopback)",
    )
    p.add_argument(
        "--latency-ms", type=float, default=0.0, help="one-way link latency with --rate-mbit"
    )
    p.add_argument(
        "--hidden", type=int, default=512, help="MLP width: the compute knob (default 512)"
    )
    p.add_argument("--batch", type=int, default=256, help="batch size per worker (default 256)")
    p.add_argument(
        "--sleep-ms",
        type=float,
        default=0.0,
        help="emulated accelerator compute per step, the CPU left free (default 0)",
    )
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating (default 2)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--as-rank", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for key in ("workers", "period", "steps", "hidden", "batch", "repeats"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.workers < 2:
        p.error("--workers must be >= 2 (averaging needs two workers)")
    for key in ("payload_mb", "sleep_ms", "latency_ms"):
        if getattr(args, key) < 0:
            p.error(f"--{key.replace('_', '-')} must be >= 0")
    if args.rate_mbit is not None and not args.rate_mbit > 0:
        p.error("--rate-mbit must be > 0")
    if args.steps <= 2 * args.period:
        p.error("--steps must exceed 2 x --period (the first round is not timed)")
    return args


# ---------------------------------------------------------------------- one rank
def _rank_main(args: argparse.Namespace) -> None:
    """One rank: RANK / WORLD_SIZE / MASTER_* come from the environment."""
    import torch
    from torch.utils.data import TensorDataset

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    env = dict(os.environ)
    torch.set_num_threads(1)
    net, timer = _module_and_timer(args)
    g = torch.Generator().manual_seed(rank)
    n = args.batch * args.steps
    data = TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))
    results = [_timed_fit(args, net, timer, overlap, data, world, env) for overlap in [False, True] * args.repeats]
    (args.as_rank / f"rank{rank}.json").write_text(json.dumps(results))


def _module_and_timer(args: argparse.Namespace) -> tuple[type, type]:
    """The rank's LightningModule (an MLP of ``--hidden`` units, ``--payload-mb`` of an
    averaged buffer, ``--sleep-ms`` per step) and a callback that records each step's end."""
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(64, args.hidden),
                nn.ReLU(),
                nn.Linear(args.hidden, args.hidden),
                nn.ReLU(),
                nn.Linear(args.hidden, 10),
            )
            numel = int(args.payload_mb * 2**20 / 4)
            self.register_buffer("payload", torch.zeros(numel))  # averaged, never computed on

        def training_step(self, batch, batch_idx):
            if args.sleep_ms:
                time.sleep(args.sleep_ms / 1000.0)
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.ends.append(time.perf_counter())

    return Net, StepTimer


def _timed_fit(args: argparse.Namespace, net: type, timer_cls: type, overlap: bool, data, world: int,
               env: dict[str, str]) -> dict:
    """One fit of local SGD with or without CoCoD's overlap: its step time from the end of
    the first round on, and what the meter saw of the averaging."""
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader

    from easgd_lightning.comm import reset_meter
    from easgd_lightning.strategies.local_sgd import LocalSGDStrategy

    os.environ.clear()
    os.environ.update(env)  # Lightning's environment teardown removes WORLD_SIZE
    pl.seed_everything(0, verbose=False)
    meter = reset_meter()
    timer = timer_cls()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=world,
        strategy=LocalSGDStrategy(tau=args.period, cocod=overlap),
        max_steps=args.steps,
        logger=False,
        callbacks=[timer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(net(), train_dataloaders=DataLoader(data, batch_size=args.batch))
    ends = timer.ends[args.period - 1 :]  # from the end of the first round on
    kinds = meter.snapshot()["by_kind"].get("model_averaging", {})
    return {
        "overlap": overlap,
        "step_s": (ends[-1] - ends[0]) / (len(ends) - 1),
        "comm_time_s": kinds.get("time_s", 0.0),
        "bytes_sent": kinds.get("bytes_sent", 0),
        "rounds": trainer.strategy.summary_extras()["rounds"],
    }


# ---------------------------------------------------------------------- launch
def _rank_cmd(argv: list[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "bench.local_sgd_overlap", *argv, "--as-rank", str(out)]


def _wait(procs: list[subprocess.Popen]) -> list[int]:
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


def _run_local(args: argparse.Namespace, argv: list[str], out: Path) -> list[int]:
    port = free_port()
    procs = []
    for rank in range(args.workers):
        env = rank_env(clean_env(repo=REPO), rank, args.workers, port, node_per_rank=True)
        procs.append(
            subprocess.Popen(
                _rank_cmd(argv, out),
                env=env,
                cwd=REPO,
                stdout=open(out / f"log{rank}.txt", "wb"),
                stderr=subprocess.STDOUT,
            )
        )
    return _wait(procs)


def _run_shaped(args: argparse.Namespace, argv: list[str], out: Path) -> list[int]:
    from bench._netem import EmulatedCluster, LinkSpec, check_privileges, install_signal_handlers

    check_privileges()
    install_signal_handlers()
    with EmulatedCluster(
        args.workers, LinkSpec(args.rate_mbit, args.latency_ms), run_id=f"easgd-lsgd-{os.getpid()}"
    ) as cluster:
        port = 29400 + os.getpid() % 1000
        procs = []
        for rank in range(args.workers):
            env = rank_env(
                clean_env(repo=REPO, GLOO_SOCKET_IFNAME=cluster.host_ifname), rank,
                args.workers, port, addr=cluster.addr(0), node_per_rank=True,
            )
            procs.append(cluster.spawn(rank, _rank_cmd(argv, out), env, out / f"log{rank}.txt"))
        return _wait(procs)


def summarise(per_rank: list[list[dict]], overlap: bool) -> dict:
    """Median over runs of each run's step time (a step ends when the slowest rank is done)."""
    mine = [[r for r in rows if r["overlap"] is overlap] for rows in per_rank]
    by_run = list(zip(*mine))  # by_run[i]: run i as seen by every rank
    return {
        "step_ms": 1000 * statistics.median(max(r["step_s"] for r in run) for run in by_run),
        "comm_s": statistics.median(
            statistics.mean(r["comm_time_s"] for r in run) for run in by_run
        ),
        "bytes_sent": mine[0][0]["bytes_sent"],
        "rounds": mine[0][0]["rounds"],
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.as_rank is not None:
        _rank_main(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="local_sgd_overlap_") as tmp:
        out = Path(tmp)
        if args.rate_mbit is None:
            codes = _run_local(args, argv, out)
        else:
            try:
                codes = _run_shaped(args, argv, out)
            except Exception as err:  # ClusterUnavailable, missing tools, no privileges
                if type(err).__name__ not in ("ClusterUnavailable", "SystemExit"):
                    raise
                print(f"local_sgd_overlap: emulated network unavailable: {err}", file=sys.stderr)
                return 2
        if any(c != 0 for c in codes):
            for rank in range(args.workers):
                log = out / f"log{rank}.txt"
                tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
                print(f"--- rank {rank} (exit {codes[rank]}) ---\n{tail}", file=sys.stderr)
            return 1
        per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.workers)]
    blocking, overlap = summarise(per_rank, False), summarise(per_rank, True)
    ratio = overlap["step_ms"] / blocking["step_ms"]
    link = (
        f"link {args.rate_mbit:g} Mbit/s, {args.latency_ms:g} ms" if args.rate_mbit else "loopback"
    )
    print(
        f"local SGD, {args.workers} workers, H={args.period}, {args.steps} steps, {link}, "
        f"payload +{args.payload_mb:g} MB per average, MLP width {args.hidden}, batch {args.batch}, "
        f"sleep {args.sleep_ms:g} ms/step, median of {args.repeats} runs"
    )
    print(
        f"{'mode':<10} {'step time (ms)':>15} {'comm time/rank (s)':>19} {'bytes sent/rank':>16} {'rounds':>7}"
    )
    for name, row in (("blocking", blocking), ("overlap", overlap)):
        print(
            f"{name:<10} {row['step_ms']:>15.2f} {row['comm_s']:>19.3f} {row['bytes_sent']:>16d} {row['rounds']:>7d}"
        )
    print(f"step time ratio overlap / blocking: {ratio:.3f}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "blocking": blocking,
                    "overlap": overlap,
                    "ratio": ratio,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
