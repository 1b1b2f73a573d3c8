"""Training through worker failures on the emulated cluster (issue 27 section 5; README
"Fault tolerance").

Each row trains one strategy under ``ft=torchft`` on N hosts (network namespaces, links
shaped to ``--rate-mbit``; :mod:`bench._netem`), the time-to-accuracy workload of
``bench.cluster --scenario tta`` (the wide digits MLP), three times:

* ``none``: no fault;
* ``one kill``: worker 1 SIGKILLs itself at a third of the run's steps
  (``faults.kill_rank=1 faults.kill_at_step=S``);
* ``every Ts``: this harness SIGKILLs a worker drawn with ``ft.punisher.Punisher`` (seeded)
  every ``--kill-every-s`` seconds, one down at a time.

How the workers run is the documented external-launcher path (README "Fault tolerance",
torchrun): one lighthouse (``python -m easgd_lightning.ft.lighthouse``) on host 0, and on
each host one worker (``ft.replica_id``) restarted when it dies, as ``torchrun
--max-restarts`` does -- here by this harness, which starts each worker forked from its
host's fork server (the imports done once, as easgd-train's own launcher does), with the
variables torchrun gives (``TORCHELASTIC_RESTART_COUNT``: which start it is).

Figures per row: wall time (first worker started to last worker ended), time to the target
accuracy (summary.json ``val_history``, worker 0's; its clock restarts when worker 0 itself
was restarted: then ``-``), final accuracy, kills, and recovery (death, as this harness saw
it, to the restarted worker's first committed exchange, ``ranks/ft/rank<R>.json``).
Targets, printed PASS/MISS: every run reaches the target accuracy; with one kill the wall
time is at most 1.3x the fault-free run's; the median recovery is at most 5 s.

    sudo .venv/bin/python -m bench.ft_faults                       # every row, 4 hosts
    sudo .venv/bin/python -m bench.ft_faults --rows ddp --modes none,one_kill --epochs 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench._netem import EmulatedCluster, LinkSpec, check_privileges, install_signal_handlers
from bench._runs import merge_overrides
from bench._scenarios import REPO, SCENARIOS
from easgd_lightning.ft.punisher import Punisher
from easgd_lightning.utils.rank_env import clean_env

#: strategy rows: the tta scenario's settings for each (local SGD and DiLoCo at tau 4)
ROWS = {
    "ddp": ("strategy=ddp",),
    "sync_easgd": ("strategy=sync_easgd",),
    "local_sgd": ("strategy=local_sgd", "strategy.tau=4"),
    "diloco": ("strategy=diloco", "strategy.tau=4"),
}
MODES = ("none", "one_kill", "every")
TARGET_SLOWDOWN = 1.3
TARGET_RECOVERY_S = 5.0
_POLL_S = 0.1


@dataclass
class Worker:
    """One worker (replica group) and its starts."""

    replica: int
    proc: object = None
    attempt: int = 0
    done: bool = False
    deaths: list[dict] = field(default_factory=list)


def worker_command(row: str, replica: int, workers: int, run_dir: Path, lighthouse: str, epochs: int,
                   extra: list[str]) -> list[str]:
    """``easgd-train`` argv of one worker (every worker shares ``run_dir``)."""
    tta = SCENARIOS["tta"]
    fixed = [f"hydra.run.dir={run_dir}", "ft=torchft", f"ft.replica_id={replica}", f"ft.lighthouse={lighthouse}",
             "trainer.devices=1", f"trainer.num_nodes={workers}", f"trainer.max_epochs={epochs}",
             "logger=none", "trainer.enable_progress_bar=false", "data.num_workers=0", "checkpoint.enabled=false"]
    exe = Path(sys.executable).parent / "easgd-train"
    return [str(exe), *merge_overrides(tta.workload, tta.extra, ROWS[row], extra, fixed)]


def _env(cluster: EmulatedCluster, attempt: int, max_restarts: int, run_id: str) -> dict[str, str]:
    """What torchrun gives a worker of ``--nnodes 1 --nproc-per-node 1``."""
    return clean_env(repo=REPO, HYDRA_FULL_ERROR="1", GLOO_SOCKET_IFNAME=cluster.host_ifname, RUST_LOG="warn",
                     RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                     TORCHELASTIC_RESTART_COUNT=str(attempt), TORCHELASTIC_MAX_RESTARTS=str(max_restarts),
                     TORCHELASTIC_RUN_ID=run_id)


def _joined(run_dir: Path, w: Worker) -> dict | None:
    try:
        info = json.loads((run_dir / "ranks" / "ft" / f"rank{w.replica}.json").read_text())
    except (OSError, ValueError):
        return None
    return info if info.get("attempt") == w.attempt else None


def start_lighthouse(cluster: EmulatedCluster, run_dir: Path, timeout_s: float = 60.0):
    """The lighthouse on host 0, bound on its address; returns (process, address)."""
    addr_file = run_dir / "lighthouse.addr"
    cmd = [sys.executable, "-m", "easgd_lightning.ft.lighthouse", "--bind", f"{cluster.addr(0)}:0",
           "--address-file", str(addr_file), "--heartbeat-timeout-s", "2", "--join-timeout-s", "10"]
    proc = cluster.spawn(0, cmd, clean_env(repo=REPO, RUST_LOG="warn"), run_dir / "logs" / "lighthouse.log")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if addr_file.exists() and addr_file.read_text().strip():
            return proc, addr_file.read_text().strip()
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"the lighthouse did not start: see {run_dir / 'logs' / 'lighthouse.log'}")


def run_row(cluster: EmulatedCluster, row: str, mode: str, out: Path, args: argparse.Namespace) -> dict:
    """One run: start, restart dead workers, punish, wait; the row's figures."""
    run_dir = out / f"{row}-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)  # no earlier run's address file or reports
    run_dir.mkdir(parents=True)
    lh_proc, lighthouse = start_lighthouse(cluster, run_dir)
    extra = list(args.extra)
    if mode == "one_kill":
        extra += ["faults.kill_rank=1", f"faults.kill_at_step={args.kill_at_step}"]
    workers = [Worker(r) for r in range(cluster.workers)]
    run_id = f"ft-bench-{row}-{mode}-{os.getpid()}"
    punisher = Punisher(args.kill_every_s, args.seed) if mode == "every" else None
    kills: list[dict] = []

    def start(w: Worker) -> None:
        cmd = worker_command(row, w.replica, cluster.workers, run_dir, lighthouse, args.epochs, extra)
        log = run_dir / "logs" / f"worker{w.replica}.start{w.attempt}.log"
        w.proc = cluster.spawn(w.replica, cmd, _env(cluster, w.attempt, args.max_restarts, run_id), log)

    t0 = time.time()
    for w in workers:
        start(w)
    deadline = time.monotonic() + args.timeout_s
    try:
        while not all(w.done for w in workers) and time.monotonic() < deadline:
            for w in workers:
                if w.done or w.proc.poll() is None:
                    continue
                code = w.proc.poll()
                if code == 0 or w.attempt >= args.max_restarts:
                    w.done = True
                    continue
                w.deaths.append({"attempt": w.attempt, "code": code, "t": time.time()})
                w.attempt += 1
                start(w)
            if punisher is not None:
                up = [w for w in workers if not w.done and w.proc.poll() is None and _joined(run_dir, w)]
                all_up = len(up) == len(workers)  # and none has finished: the run is not ending
                if all_up:
                    punisher.arm(time.monotonic())
                eligible = [w.replica for w in up if w.attempt < args.max_restarts]
                victim = punisher.pick(time.monotonic(), eligible, all_up)
                if victim is not None:
                    kills.append({"replica": victim, "attempt": workers[victim].attempt, "t": time.time()})
                    workers[victim].proc.kill()
            time.sleep(_POLL_S)
    finally:
        timed_out = not all(w.done for w in workers)
        cluster.kill_procs()
    wall = time.time() - t0
    return _figures(row, mode, run_dir, workers, kills, wall, timed_out, args.target_acc)


def _recoveries(run_dir: Path, workers: list[Worker]) -> list[float]:
    """Death (as seen here) to the next start's first committed exchange, per rejoin."""
    out = []
    for w in workers:
        for d in w.deaths:
            path = run_dir / "ranks" / "ft" / f"rank{w.replica}.attempt{d['attempt'] + 1}.json"
            try:
                info = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # that start never rejoined (the run ended first)
            if info.get("joined_at"):
                out.append(info["joined_at"] - d["t"])
    return out


def _figures(row, mode, run_dir, workers, kills, wall, timed_out, target) -> dict:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    history = summary.get("val_history") or []
    hit = next((h for h in history if (h.get("val_acc") or 0) >= target), None)
    accs = [h["val_acc"] for h in history if h.get("val_acc") is not None]
    return {
        "row": row, "mode": mode, "status": "timeout" if timed_out else summary.get("status", "no summary"),
        "wall_s": round(wall, 2), "val_acc": summary.get("val_acc"), "best_val_acc": max(accs) if accs else None,
        "time_to_target_s": hit.get("time_s") if hit else None,
        "restarts": [len(w.deaths) for w in workers], "kills": len(kills) + (mode == "one_kill"),
        "recovery_s": [round(r, 2) for r in _recoveries(run_dir, workers)],
        "ft": {k: (summary.get("ft") or {}).get(k) for k in ("rejoins", "lost_ranks", "ended_before_rejoin")},
        "run_dir": str(run_dir),
    }


def judge(results: list[dict], target_acc: float) -> list[tuple[str, bool, str]]:
    """The section's targets, each (what, passed, the figures)."""
    out = []
    for r in results:
        acc = r["best_val_acc"]
        out.append((f"{r['row']} / {r['mode']}: reaches {target_acc}", r["status"] == "ok" and acc is not None
                    and acc >= target_acc, f"best {acc}, status {r['status']}"))
    base = {r["row"]: r for r in results if r["mode"] == "none"}
    for r in results:
        if r["mode"] == "one_kill" and r["row"] in base:
            ratio = r["wall_s"] / base[r["row"]]["wall_s"]
            out.append((f"{r['row']} / one kill: wall <= {TARGET_SLOWDOWN}x fault-free", ratio <= TARGET_SLOWDOWN,
                        f"{r['wall_s']:.1f} s / {base[r['row']]['wall_s']:.1f} s = {ratio:.2f}x"))
    rec = [x for r in results for x in r["recovery_s"]]
    if rec:
        med = statistics.median(rec)
        out.append((f"median recovery <= {TARGET_RECOVERY_S} s", med <= TARGET_RECOVERY_S,
                    f"{med:.2f} s over {len(rec)} rejoins (min {min(rec):.2f}, max {max(rec):.2f})"))
    return out


def _acc(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def render(results: list[dict], verdicts, settings: dict) -> str:
    lines = [f"# Fault tolerance on the emulated cluster ({settings['hosts']} hosts, {settings['rate_mbit']} Mbit/s)",
             "", f"load average before: {settings['load_before']}, after: {settings['load_after']}; "
             f"torch {settings['torch']}; {settings['epochs']} epochs, target {settings['target_acc']}", "",
             "| row | faults | status | wall (s) | to target (s) | best acc | final acc | kills | restarts | recovery (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    names = {"none": "none", "one_kill": "one kill", "every": f"every {settings['kill_every_s']:g} s"}
    for r in results:
        tt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        lines.append(f"| {r['row']} | {names[r['mode']]} | {r['status']} | {r['wall_s']:.1f} | {tt} | "
                     f"{_acc(r['best_val_acc'])} | {_acc(r['val_acc'])} | {r['kills']} | {sum(r['restarts'])} | "
                     f"{', '.join(f'{x:.2f}' for x in r['recovery_s']) or '-'} |")
    lines += ["", "| target | result | figures |", "|---|---|---|"]
    lines += [f"| {what} | {'PASS' if ok else 'MISS'} | {fig} |" for what, ok, fig in verdicts]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ft_faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"strategies, of {', '.join(ROWS)}")
    p.add_argument("--modes", default=",".join(MODES), help="none, one_kill, every")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--target-acc", type=float, default=0.95)
    p.add_argument("--kill-at-step", type=int, default=100, help="one_kill: worker 1 dies before this step")
    p.add_argument("--kill-every-s", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0, help="the punisher's draw")
    p.add_argument("--max-restarts", type=int, default=10)
    p.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    p.add_argument("--extra", nargs="*", default=[], help="more easgd-train overrides for every run")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "ft_faults")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    modes = [m for m in args.modes.split(",") if m]
    bad = [r for r in rows if r not in ROWS] + [m for m in modes if m not in MODES]
    if bad:
        print(f"bench.ft_faults: unknown {bad[0]!r}: rows are {', '.join(ROWS)}; modes {', '.join(MODES)}",
              file=sys.stderr)
        return 2
    check_privileges()
    install_signal_handlers()  # SIGTERM / SIGINT: the namespaces and every process go
    import torch

    settings = {"hosts": args.hosts, "rate_mbit": args.rate_mbit, "epochs": args.epochs, "target_acc": args.target_acc,
                "kill_every_s": args.kill_every_s, "torch": torch.__version__,
                "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    results = []
    with EmulatedCluster(args.hosts, LinkSpec(args.rate_mbit, 0.1), fork_ranks=True) as cluster:
        for row in rows:
            for mode in modes:
                res = run_row(cluster, row, mode, args.out, args)
                print(json.dumps({k: v for k, v in res.items() if k != "ft"}), flush=True)
                results.append(res)
    settings["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    verdicts = judge(results, args.target_acc)
    text = render(results, verdicts, settings)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ft_faults.json").write_text(json.dumps({"settings": settings, "results": results}, indent=1))
    (args.out / "ft_faults.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
