"""The environment of a rank started by hand (tests, benchmarks), the way torchrun sets it.

* :func:`free_port` -- a TCP port free on this host now, for ``MASTER_PORT``.
* :func:`clean_env` -- ``os.environ`` without any rendezvous variables a launcher or a
  scheduler left there (so a child never joins someone else's group), one thread per
  process, Weights & Biases offline and quiet, and optionally a checkout first on
  ``PYTHONPATH``.
* :func:`rank_env` -- that environment plus ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` for one rank.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

__all__ = ["RENDEZVOUS_KEYS", "free_port", "clean_env", "rank_env"]

#: Variables that tie a process to a process group or a scheduler's job.
RENDEZVOUS_KEYS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "GLOO_SOCKET_IFNAME",
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on at ``host`` now (the OS picks it; port 0)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def clean_env(*, repo: str | os.PathLike | None = None, **extra: str) -> dict[str, str]:
    """``os.environ`` minus :data:`RENDEZVOUS_KEYS`, with ``OMP_NUM_THREADS`` and
    ``MKL_NUM_THREADS`` = 1, unbuffered output, ``WANDB_MODE`` offline unless set and
    ``WANDB_SILENT``; ``repo`` (a checkout) goes first on ``PYTHONPATH``; ``extra`` last."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_KEYS}
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        WANDB_MODE=env.get("WANDB_MODE", "offline"),
        WANDB_SILENT="true",
    )
    if repo is not None:
        paths = [str(Path(repo)), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.update(extra)
    return env


def rank_env(
    env: dict[str, str],
    rank: int,
    world: int,
    port: int,
    *,
    addr: str = "127.0.0.1",
    node_per_rank: bool = False,
) -> dict[str, str]:
    """``env`` plus the rendezvous variables of ``rank`` of ``world``.

    Ranks share one node (``LOCAL_RANK`` = rank, ``NODE_RANK`` = 0), or with
    ``node_per_rank`` each is a node of its own (``LOCAL_RANK`` = 0, ``NODE_RANK`` = rank,
    ``LOCAL_WORLD_SIZE`` = 1), as on an emulated cluster.
    """
    out = dict(env)
    out.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0" if node_per_rank else str(rank),
        NODE_RANK=str(rank) if node_per_rank else "0",
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
    )
    if node_per_rank:
        out["LOCAL_WORLD_SIZE"] = "1"
    return out
