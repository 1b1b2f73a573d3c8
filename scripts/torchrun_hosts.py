"""``torchrun`` across emulated hosts: every strategy family, each compared with the same run
launched by ``easgd-train`` on one host.

    sudo .venv/bin/python scripts/torchrun_hosts.py                 # every family, 2 hosts
    sudo .venv/bin/python scripts/torchrun_hosts.py --hosts 4 ddp_topk sync_easgd
    sudo .venv/bin/python scripts/torchrun_hosts.py --deepspeed     # + pipeline_3d via `deepspeed`

Hosts are Linux network namespaces behind a bridge (``bench/_netem.py``'s
:class:`EmulatedCluster`, a 1 Gbit/s link each); on host ``i`` one launcher runs

    torchrun --nnodes N --nproc-per-node 2 --node-rank i --rdzv-backend c10d \\
      --rdzv-endpoint HOST0:PORT --local-addr HOSTi -m easgd_lightning.cli.train ...

(``--local-addr``: every namespace shares the machine's hostname, which resolves to
127.0.0.1, so each agent names its own address; host 0 also passes ``--rdzv-conf
is_host=1`` for the same reason, and ``GLOO_SOCKET_IFNAME=eth0``). Each host gets its own
run directory (no shared file system between hosts): the run must end with exactly one
``summary.json``, on host 0, whose train loss equals the single-host run's (float64, same
world size) for the synchronous families; ``async_easgd`` (the server on the last rank of
the last host) is checked for a finished run only. Prints one line per run (wall time,
losses) and a table; exit 1 when a check failed, 2 when namespaces are not available.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # a script: the checkout's bench package (the emulated hosts)
from bench._netem import ClusterUnavailable, EmulatedCluster, LinkSpec, check_privileges  # noqa: E402
from bench._runs import wait_all  # noqa: E402
from easgd_lightning.utils.rank_env import clean_env  # noqa: E402

__all__ = ["FAMILIES", "HostRun", "run_on_hosts", "run_deepspeed_on_hosts", "run_on_one_host", "compare", "main"]

BIN = Path(sys.executable).parent
COMMON = [
    "trainer.max_epochs=1", "trainer.limit_train_batches=4", "trainer.limit_val_batches=2",
    "checkpoint.enabled=false", "logger=csv", "trainer.enable_progress_bar=false",
]
DIGITS64 = ["trainer.precision=64-true"]
#: family -> (overrides, exact: the single-host run must give the same train loss)
FAMILIES: dict[str, tuple[list[str], bool]] = {
    "ddp_topk": (["strategy=ddp", "compression=topk", "compression.min_numel=0", *DIGITS64], True),
    "sync_easgd": (["strategy=sync_easgd", *DIGITS64], True),
    "local_sgd": (["strategy=local_sgd", *DIGITS64], True),
    "async_easgd": (["strategy=async_easgd", *DIGITS64], False),
    # pp=2 stages x dp = world / 2 replicas (ranks 0..world/2-1: stage 0): the stages on different hosts
    "pipeline_3d": (["recipe=nlp3d/gpt_tiny_pp2_dp2_optimus", "strategy.dp=null", "trainer.max_steps=4",
                     "trainer.precision=32-true", "trainer.limit_val_batches=1"], True),
}


@dataclass
class HostRun:
    """One launch: exit codes per host launcher, wall time, the summaries each host holds."""

    name: str
    launcher: str
    codes: list[int | None]
    wall_s: float
    summaries: list[dict | None] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    @property
    def summary(self) -> dict | None:
        return self.summaries[0] if self.summaries else None

    def tail(self, n: int = 3000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}" for p in self.logs if p.exists())


def _read_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def host_env(cluster: EmulatedCluster) -> dict[str, str]:
    """A launcher's environment on an emulated host: no inherited rendezvous, gloo on eth0."""
    return clean_env(repo=REPO, HYDRA_FULL_ERROR="1", GLOO_SOCKET_IFNAME=cluster.host_ifname)


def _wait(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Every host's launcher ends, one fails (the others get 2 s), or ``timeout_s`` passes."""
    return wait_all(procs, timeout_s)[0]


def torchrun_cmd(cluster: EmulatedCluster, host: int, nnodes: int, nproc: int, port: int, run_id: str) -> list[str]:
    return [
        str(BIN / "torchrun"), "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
        "--node-rank", str(host), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{cluster.addr(0)}:{port}",
        "--rdzv-id", run_id, "--rdzv-conf", f"is_host={int(host == 0)}", "--local-addr", cluster.addr(host),
        "--max-restarts", "0", "-m", "easgd_lightning.cli.train",
    ]


def run_on_hosts(cluster: EmulatedCluster, name: str, overrides: list[str], out: Path, *, hosts: int | None = None,
                 nproc: int = 2, port: int = 29400, timeout_s: float = 300.0) -> HostRun:
    """``torchrun`` on the first ``hosts`` hosts of ``cluster`` (all by default), ``nproc``
    ranks each; each host its own run directory ``out/host<i>``."""
    hosts = hosts or cluster.workers
    procs, logs = [], []
    started = time.monotonic()
    for host in range(hosts):
        cmd = [*torchrun_cmd(cluster, host, hosts, nproc, port, f"{name}-{hosts}x{nproc}"), *COMMON, *overrides,
               f"trainer.devices={nproc}", f"trainer.num_nodes={hosts}", f"hydra.run.dir={out / f'host{host}'}"]
        logs.append(out / f"host{host}.log")
        procs.append(cluster.spawn(host, cmd, host_env(cluster), logs[-1]))
    codes = _wait(procs, timeout_s)
    wall = time.monotonic() - started
    if any(c is None for c in codes):
        cluster.kill_procs()
    return HostRun(name, "torchrun", codes, wall, [_read_summary(out / f"host{h}") for h in range(hosts)], logs)


def run_deepspeed_on_hosts(cluster: EmulatedCluster, name: str, overrides: list[str], out: Path, *,
                           hosts: int | None = None, nproc: int = 2, port: int = 29500,
                           timeout_s: float = 300.0) -> HostRun:
    """DeepSpeed's launcher on every host, ssh-less: ``deepspeed --hostfile H --no_ssh
    --node_rank i --master_addr HOST0 --master_port P --no_local_rank --module ...`` (each
    host's ``deepspeed.launcher.launch`` starts its ``slots`` ranks; nothing is started over
    ssh or pdsh). ``--no_local_rank``: Hydra takes no ``--local_rank`` argument."""
    hosts = hosts or cluster.workers
    out.mkdir(parents=True, exist_ok=True)
    hostfile = out / "hostfile"
    hostfile.write_text("".join(f"{cluster.addr(h)} slots={nproc}\n" for h in range(hosts)))
    procs, logs = [], []
    started = time.monotonic()
    for host in range(hosts):
        cmd = [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(host),
               "--master_addr", cluster.addr(0), "--master_port", str(port), "--no_local_rank",
               "--module", "easgd_lightning.cli.train", *COMMON, *overrides, f"trainer.devices={nproc}",
               f"trainer.num_nodes={hosts}", f"hydra.run.dir={out / f'ds_host{host}'}"]
        logs.append(out / f"ds_host{host}.log")
        procs.append(cluster.spawn(host, cmd, {**host_env(cluster), "DS_ACCELERATOR": "cpu"}, logs[-1]))
    codes = _wait(procs, timeout_s)
    wall = time.monotonic() - started
    if any(c is None for c in codes):
        cluster.kill_procs()
    return HostRun(name, "deepspeed", codes, wall,
                   [_read_summary(out / f"ds_host{h}") for h in range(hosts)], logs)


def run_on_one_host(name: str, overrides: list[str], out: Path, world: int, timeout_s: float = 300.0) -> HostRun:
    """The same run launched by ``easgd-train`` on this machine (``world`` local ranks)."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "one_host.log"
    started = time.monotonic()
    with open(log, "wb") as fh:
        proc = subprocess.run(
            [str(BIN / "easgd-train"), *COMMON, *overrides, f"trainer.devices={world}", f"hydra.run.dir={out / 'one'}"],
            env=clean_env(repo=REPO, HYDRA_FULL_ERROR="1"), cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
            timeout=timeout_s,
        )
    return HostRun(name, "easgd-train", [proc.returncode], time.monotonic() - started, [_read_summary(out / "one")],
                   [log])


def compare(multi: HostRun, one: HostRun | None, exact: bool) -> list[str]:
    """What is wrong with the multi-host run (empty when nothing): exit codes, one summary on
    host 0 only, status ok, world size, and (``exact``) the single-host run's train loss."""
    problems = []
    if any(c != 0 for c in multi.codes):
        problems.append(f"launcher exit codes {multi.codes}")
    s = multi.summary
    if s is None:
        return [*problems, "no summary.json on host 0"]
    extra = [h for h, other in enumerate(multi.summaries[1:], start=1) if other is not None]
    if extra:
        problems.append(f"summary.json also on host(s) {extra}")
    if s.get("status") != "ok":
        problems.append(f"status {s.get('status')}: {s.get('error')}")
    if one is not None and one.summary is not None:
        if s.get("world_size") != one.summary.get("world_size"):
            problems.append(f"world size {s.get('world_size')} != {one.summary.get('world_size')}")
        if exact and s.get("train_loss") != one.summary.get("train_loss"):
            problems.append(f"train loss {s.get('train_loss')!r} != one host's {one.summary.get('train_loss')!r}")
    elif exact:
        problems.append("no single-host summary to compare with")
    if not (isinstance(s.get("train_loss"), float) and math.isfinite(s["train_loss"])):
        problems.append(f"train loss {s.get('train_loss')!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", default=list(FAMILIES), help=f"of {', '.join(FAMILIES)}")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2, help="ranks per host")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "torchrun_hosts")
    parser.add_argument("--timeout-s", type=float, default=400.0)
    parser.add_argument("--deepspeed", action="store_true",
                        help="also launch pipeline_3d with DeepSpeed's launcher (--no_ssh on each host)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; valid: {', '.join(FAMILIES)}")
    try:
        check_privileges()
        from bench._netem import install_signal_handlers

        install_signal_handlers()
        rows, failed = [], 0
        with EmulatedCluster(args.hosts, LinkSpec(1000.0, 0.0), run_id=f"easgd-bench-{os.getpid()}") as cluster:
            for i, name in enumerate(args.families):
                overrides, exact = FAMILIES[name]
                out = args.out / f"{name}_{args.hosts}x{args.nproc}"
                multi = run_on_hosts(cluster, name, overrides, out, nproc=args.nproc, port=29400 + i,
                                     timeout_s=args.timeout_s)
                one = run_on_one_host(name, overrides, out, args.hosts * args.nproc, args.timeout_s)
                problems = compare(multi, one, exact)
                failed += bool(problems)
                loss = (multi.summary or {}).get("train_loss")
                ref = (one.summary or {}).get("train_loss")
                rows.append((name, multi.wall_s, one.wall_s, loss, ref, "ok" if not problems else "; ".join(problems)))
                print(f"[torchrun_hosts] {name}: torchrun {args.hosts}x{args.nproc} {multi.wall_s:.1f}s "
                      f"loss={loss!r}; easgd-train 1x{args.hosts * args.nproc} {one.wall_s:.1f}s loss={ref!r}: "
                      f"{rows[-1][-1]}", flush=True)
                if problems:
                    print(multi.tail(), file=sys.stderr)
                if args.deepspeed and name == "pipeline_3d":
                    ds = run_deepspeed_on_hosts(cluster, name, overrides, out, nproc=args.nproc, port=29600,
                                                timeout_s=args.timeout_s)
                    problems = compare(ds, one, exact)
                    failed += bool(problems)
                    loss = (ds.summary or {}).get("train_loss")
                    rows.append((f"{name} (deepspeed)", ds.wall_s, one.wall_s, loss, ref,
                                 "ok" if not problems else "; ".join(problems)))
                    print(f"[torchrun_hosts] {name}: deepspeed --no_ssh {args.hosts}x{args.nproc} {ds.wall_s:.1f}s "
                          f"loss={loss!r}: {rows[-1][-1]}", flush=True)
                    if problems:
                        print(ds.tail(), file=sys.stderr)
    except ClusterUnavailable as err:
        print(f"torchrun_hosts: {err}", file=sys.stderr)
        return 2
    print(f"\n| family | torchrun {args.hosts}x{args.nproc} (s) | easgd-train 1 host (s) | train loss | one host | check |")
    print("|---|---|---|---|---|---|")
    for name, w_multi, w_one, loss, ref, check in rows:
        print(f"| {name} | {w_multi:.1f} | {w_one:.1f} | {loss!r} | {ref!r} | {check} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
