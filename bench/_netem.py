"""Network emulation for ``bench/cluster.py``: hosts as Linux network namespaces behind a
bridge, links shaped with ``tc`` (token bucket + netem delay), and the clean-up of
everything it creates (``finally``, signal handlers, ``atexit``, ``--cleanup-stale``)."""

from __future__ import annotations

import atexit
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from bench._scenarios import REPO
from easgd_lightning.utils.procs import pid_alive, stop_signals_held
from easgd_lightning.utils.rank_env import clean_env

PREFIX = "easgd-bench"

#: the entry of a rank forked with ``fork_ranks`` (bench/_forked_rank.py)
FORKED_RANK_ENTRY = "bench._forked_rank:main"


_CAP_SYS_ADMIN = 21


_CAP_NET_ADMIN = 12


_CMD_TIMEOUT_S = 30.0

#: the links' frame size by default: Ethernet's standard payload
ETHERNET_MTU = 1500

#: jumbo frames, the frame size of HPC and data-centre fabrics for bulk traffic
JUMBO_MTU = 9000

#: the nice value of each training process's main thread with ``compute_nice`` on
COMPUTE_NICE = 10


class ClusterUnavailable(RuntimeError):
    """The emulated network cannot be built on this machine (exit code 2)."""


@dataclass(frozen=True)
class LinkSpec:
    """One emulated link: rate in Mbit/s (10^6 bit/s) and one-way latency in ms."""

    rate_mbit: float
    latency_ms: float

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"--rate-mbit must be > 0, got {self.rate_mbit}")
        if self.latency_ms < 0:
            raise ValueError(f"--latency-ms must be >= 0, got {self.latency_ms}")


def tbf_params(rate_mbit: float, mtu: int = ETHERNET_MTU) -> dict[str, int]:
    """Token-bucket parameters for ``tc qdisc ... tbf`` at a given rate.

    The bucket holds 2 ms of traffic (at least two full frames), so the shaper neither
    starves at high rates (where the kernel timer granularity matters) nor lets a long
    burst through at low rates. The queue holds 100 ms of traffic and at least 2 MiB, more
    than Linux lets one local TCP socket park in a qdisc (``tcp_limit_output_bytes``,
    1 MiB), so senders are paced by back-pressure rather than by drops (drops at low rates
    cost 10-15% of the throughput through retransmission time-outs).

    Args:
        rate_mbit: link rate in Mbit/s.
        mtu: frame payload size in bytes.

    Returns:
        ``{"rate_kbit": ..., "burst_bytes": ..., "limit_bytes": ...}``.
    """
    rate_bytes_per_s = rate_mbit * 1e6 / 8.0
    burst = max(2 * (mtu + 100), int(rate_bytes_per_s * 0.002))
    limit = max(2 * 1024 * 1024, int(rate_bytes_per_s * 0.1)) + burst
    return {
        "rate_kbit": max(1, round(rate_mbit * 1000)),
        "burst_bytes": burst,
        "limit_bytes": limit,
    }


def _effective_caps() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def check_privileges() -> None:
    """Fail early, with the reason, when namespaces cannot be built here.

    Raises:
        ClusterUnavailable: not Linux, ``ip``/``tc`` missing, or neither root nor
            CAP_NET_ADMIN + CAP_SYS_ADMIN (``ip netns add`` needs both).
    """
    if platform.system() != "Linux":
        raise ClusterUnavailable(f"needs Linux network namespaces; this is {platform.system()}")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ClusterUnavailable(f"'{tool}' (iproute2) not found on PATH; install iproute2")
    caps = _effective_caps()
    if not (caps >> _CAP_NET_ADMIN & 1 and caps >> _CAP_SYS_ADMIN & 1):
        raise ClusterUnavailable(
            "needs root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces; "
            "run it as root, e.g. `sudo .venv/bin/python -m bench.cluster ...`"
        )


def _list_netns() -> list[str]:
    out = subprocess.run(
        ["ip", "netns", "list"], check=False, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S
    )
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def cleanup_stale(dry_run: bool = False) -> list[str]:
    """Delete ``easgd-bench-<pid>-*`` namespaces whose creating process is gone.

    Only namespaces made by this script (its name prefix) whose ``<pid>`` is no longer
    alive are touched: a run that was SIGKILLed cannot clean up after itself.

    Args:
        dry_run: only list them.

    Returns:
        The stale namespace names.
    """
    stale = []
    for name in _list_netns():
        m = re.fullmatch(rf"{PREFIX}-(\d+)-(?:br|\d+)", name)
        if m and not pid_alive(int(m.group(1))):
            stale.append(name)
    if not dry_run:
        for name in stale:
            _kill_netns_pids(name)
            subprocess.run(
                ["ip", "netns", "del", name], check=False, capture_output=True, timeout=30
            )
    return stale


def _kill_netns_pids(ns: str) -> None:
    """SIGKILL whatever still runs inside a namespace this script created."""
    out = subprocess.run(
        ["ip", "netns", "pids", ns],
        check=False,
        capture_output=True,
        text=True,
        timeout=_CMD_TIMEOUT_S,
    )
    for tok in out.stdout.split():
        if tok.isdigit() and int(tok) != os.getpid():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


_LIVE: list[EmulatedCluster] = []


def cleanup_all() -> None:
    for cluster in list(_LIVE):  # noqa: PERF101 - down() removes from _LIVE
        cluster.down()


class Interrupted(BaseException):
    """Raised from a signal handler so ``finally`` blocks run."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def _on_signal(signum: int, _frame: object) -> None:
    # Ignore repeats while cleaning up; the first one unwinds the stack.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    raise Interrupted(signum)


def install_signal_handlers() -> None:
    """Route SIGINT/SIGTERM/SIGHUP through ``finally`` blocks; clean up at exit too."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    atexit.register(cleanup_all)


class EmulatedCluster:
    """N hosts in network namespaces behind one bridge, each link shaped with ``tc``.

    Use as a context manager; :meth:`down` is idempotent and also runs from ``atexit``.

    Args:
        workers: number of hosts.
        link: rate and latency of every host's link.
        subnet: first three octets of the private /24 (hosts get .1, .2, ...).
        run_id: name prefix of everything created (default ``easgd-bench-<pid>``).
        procs_per_host: training processes each host runs (ranks ``host * procs_per_host +
            local``, torchrun's layout). Processes of one host reach each other on the
            host's own addresses, which Linux routes over the namespace's loopback: their
            traffic is not shaped; traffic between hosts crosses the shaped link.
        mtu: the frame payload of every link (the hosts' ports, the bridge's ports and the
            bridge): the kernel's work per byte moved falls with it, and on this machine
            every emulated host's kernel shares the same cores as the training (on a real
            cluster each host's kernel and NIC do that work on their own);
            ``JUMBO_MTU`` cuts it about threefold (``bench/README.md``).
        compute_nice: the nice value :meth:`comm_first` gives each training process's
            main thread (0: leave every thread alone).
        fork_ranks: start each ``easgd-train`` rank forked from a fork server of its host
            (``easgd_lightning/cli/forkserver.py``, started inside the host's namespace, which
            has imported the command's modules once) instead of as a fresh interpreter: the
            same ``main()``, argv, environment and namespace, seconds of imports less per
            rank; its exit is the fork server's (atexit handlers, then ``os._exit``), not an
            interpreter's shutdown. Other commands are always started fresh.
    """

    host_ifname = "eth0"

    def __init__(
        self,
        workers: int,
        link: LinkSpec,
        subnet: str = "10.77.0",
        run_id: str | None = None,
        procs_per_host: int = 1,
        fork_ranks: bool = False,
        mtu: int = ETHERNET_MTU,
        compute_nice: int = 0,
    ) -> None:
        if not 68 <= mtu <= 65535:
            raise ValueError(f"--mtu must be in 68..65535 bytes, got {mtu}")
        if not 0 <= compute_nice <= 19:
            raise ValueError(f"--compute-nice must be in 0..19, got {compute_nice}")
        self.mtu, self.compute_nice = mtu, compute_nice
        if not 1 <= workers <= 250:
            raise ValueError(f"--workers must be in 1..250, got {workers}")
        if not 1 <= procs_per_host <= 64:
            raise ValueError(f"--procs-per-host must be in 1..64, got {procs_per_host}")
        self.procs_per_host = procs_per_host
        if not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"--subnet must be a private 10.x.y prefix, got {subnet}")
        self.workers = workers
        self.link = link
        self.subnet = subnet
        self.run_id = run_id or f"{PREFIX}-{os.getpid()}"
        self.bridge_ns = f"{self.run_id}-br"
        self.hosts = [f"{self.run_id}-{i}" for i in range(workers)]
        self.latency_emulated = False
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self.fork_ranks = fork_ranks
        self._servers: list = []  # with fork_ranks: one fork server per host (forkserver.ForkServer)
        self._server_popens: list[subprocess.Popen] = []
        self._preload: list[str] = []
        self._down = False
        self._warned = False

    # -- addressing
    def addr(self, rank: int) -> str:
        """Private address of host ``rank``."""
        return f"{self.subnet}.{rank + 1}"

    @property
    def world_size(self) -> int:
        """Training processes on the whole cluster."""
        return self.workers * self.procs_per_host

    def host_of(self, rank: int) -> int:
        """The host that runs global rank ``rank``."""
        return rank // self.procs_per_host

    @staticmethod
    def port_ifname(rank: int) -> str:
        """Name of host ``rank``'s port on the bridge (inside the bridge namespace)."""
        return f"port{rank}"

    # -- commands
    @staticmethod
    def _run(cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run one ``ip``/``tc`` command (space-separated; our names contain no spaces)."""
        proc = subprocess.run(
            cmd.split(), check=False, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"`{cmd}` failed: {proc.stderr.strip()}")
        return proc

    def _add_netns(self, name: str) -> None:
        proc = self._run(f"ip netns add {name}", check=False)
        if proc.returncode != 0:
            raise ClusterUnavailable(
                f"`ip netns add {name}` failed: {proc.stderr.strip()} "
                "(network namespaces are not permitted here: needs root or CAP_NET_ADMIN + "
                "CAP_SYS_ADMIN, and a kernel/container that allows them)"
            )
        self._namespaces.append(name)

    # -- lifecycle
    def __enter__(self) -> Self:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Create the namespaces, bridge, veth pairs, addresses and shaping."""
        _LIVE.append(self)
        self._add_netns(self.bridge_ns)
        br, eth = self.bridge_ns, self.host_ifname
        self._run(f"ip -n {br} link add br0 type bridge")
        self._run(f"ip -n {br} link set br0 mtu {self.mtu}")
        self._run(f"ip -n {br} link set br0 up")
        self._run(f"ip -n {br} link set lo up")
        for i, ns in enumerate(self.hosts):
            self._add_netns(ns)
            port = self.port_ifname(i)
            # Both ends are created inside our namespaces: the host's namespace never sees them.
            self._run(f"ip -n {br} link add {port} type veth peer name {eth} netns {ns}")
            self._run(f"ip -n {br} link set {port} mtu {self.mtu}")
            self._run(f"ip -n {ns} link set {eth} mtu {self.mtu}")
            self._run(f"ip -n {br} link set {port} master br0")
            self._run(f"ip -n {br} link set {port} up")
            self._run(f"ip -n {ns} addr add {self.addr(i)}/24 dev {eth}")
            self._run(f"ip -n {ns} link set {eth} up")
            self._run(f"ip -n {ns} link set lo up")
        self.shape(self.link)

    def shape(self, link: LinkSpec) -> None:
        """(Re)apply rate and latency to every link; can be called between runs."""
        self.link = link
        p = tbf_params(link.rate_mbit, self.mtu)
        tbf = f"tbf rate {p['rate_kbit']}kbit burst {p['burst_bytes']} limit {p['limit_bytes']}"
        delay = f"netem delay {link.latency_ms * 1000:.0f}us limit 100000"
        br, eth = self.bridge_ns, self.host_ifname
        emulated = True
        for i, ns in enumerate(self.hosts):
            port = self.port_ifname(i)
            # Upload: host eth0 -> token bucket -> netem delay (when the kernel has netem).
            self._run(f"tc -n {ns} qdisc del dev {eth} root", check=False)
            self._run(f"tc -n {ns} qdisc add dev {eth} root handle 1: {tbf}")
            if link.latency_ms > 0:
                proc = self._run(
                    f"tc -n {ns} qdisc add dev {eth} parent 1:1 handle 10: {delay}", check=False
                )
                emulated = emulated and proc.returncode == 0
            # Download: bridge port -> token bucket (a switch port's egress).
            self._run(f"tc -n {br} qdisc del dev {port} root", check=False)
            self._run(f"tc -n {br} qdisc add dev {port} root handle 1: {tbf}")
        self.latency_emulated = emulated and link.latency_ms > 0
        if link.latency_ms > 0 and not emulated and not self._warned:
            self._warned = True
            print(
                f"[cluster] WARNING: latency {link.latency_ms} ms NOT emulated: the kernel has "
                "no sch_netem (tc qdisc netem); links are rate-shaped only.",
                file=sys.stderr,
                flush=True,
            )

    def comm_first(self, procs: Sequence) -> None:
        """Let no host's communication wait behind another host's compute on the shared cores:
        each process's main thread (the training loop: forward, backward, the optimizer, the
        codecs) at nice ``compute_nice``, its other threads (gloo's work and I/O threads, the
        heartbeat) at 0 -- threads the main thread starts inherit its nice, so this runs
        again at every poll of the harness. On a cluster each host's network threads run on
        its own cores; here all hosts share two, and the scheduler would otherwise queue a
        ring's next hop behind up to four ranks' matrix products. A thread or process gone
        meanwhile is skipped."""
        if not self.compute_nice:
            return
        for proc in procs:
            try:
                threads = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
            except OSError:
                continue
            for tid in threads:
                want = self.compute_nice if tid == proc.pid else 0
                try:
                    if os.getpriority(os.PRIO_PROCESS, tid) != want:
                        os.setpriority(os.PRIO_PROCESS, tid, want)
                except OSError:
                    pass

    def describe(self) -> dict:
        """The link as recorded in the results."""
        p = tbf_params(self.link.rate_mbit, self.mtu)
        return {
            "rate_mbit": self.link.rate_mbit,
            "latency_ms": self.link.latency_ms,
            "latency_emulated": self.latency_emulated,
            "shaping": "tbf on host egress and on bridge-port egress (full duplex)"
            + (", netem delay on host egress" if self.latency_emulated else ""),
            "tbf": p,
            "mtu": self.mtu,
            "compute_nice": self.compute_nice,
            "subnet": f"{self.subnet}.0/24",
            "procs_per_host": self.procs_per_host,
        }

    def spawn(
        self, rank: int, cmd: Sequence[str], env: dict[str, str], log: Path
    ) -> subprocess.Popen:
        """Start ``cmd`` inside host ``rank``'s namespace (a host index; callers that run
        several processes per host pass :meth:`host_of` their rank), output to ``log``.

        Each process gets its own session so that :meth:`down` can kill its whole group.
        """
        log.parent.mkdir(parents=True, exist_ok=True)
        if self.fork_ranks and Path(cmd[0]).name == "easgd-train":
            return self._fork(rank, cmd, env, log)
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.hosts[rank], *cmd],
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )
        self._procs.append(proc)
        return proc

    def _fork(self, host: int, cmd: Sequence[str], env: dict[str, str], log: Path):
        """``cmd`` (``easgd-train ARGS``) forked from host ``host``'s fork server, with
        ``env`` and ``argv`` = ``cmd``, output to ``log``: a ``RankProcess`` (``pid``,
        ``poll``, ``wait``, ``kill`` of ``subprocess.Popen``), in a session of its own."""
        if not self._servers:
            self._start_servers()
        proc = self._servers[host].start(
            list(cmd), env, str(REPO), self._preload, entry=FORKED_RANK_ENTRY,
            stdout=str(log), stderr=str(log),
        )
        self._procs.append(proc)
        return proc

    def _start_servers(self) -> None:
        """One fork server per host, in the host's namespace (``ip netns exec`` execs it,
        so it is this process's child; it ends when this process closes its pipe or dies).
        All are started before this process imports the client side (the package, hence
        Lightning: seconds), so the imports run side by side."""
        env = clean_env(repo=REPO)  # the checkout first: its package and bench (the ranks' entry)
        pipes = []
        for ns in self.hosts:
            req_r, req_w = os.pipe()
            st_r, st_w = os.pipe()
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "easgd_lightning.cli.forkserver",
                 str(req_r), str(st_w), str(os.getpid()), "easgd_lightning.cli.train"],
                pass_fds=(req_r, st_w), env=env, cwd=REPO, stdin=subprocess.DEVNULL,
            )
            os.close(req_r)
            os.close(st_w)
            os.set_blocking(st_r, False)
            self._server_popens.append(proc)
            pipes.append((req_w, st_r))
        from easgd_lightning.cli import forkserver

        self._preload = list(forkserver.WORKER_MODULES)  # what each rank imports (cli/worker.py)
        self._servers = [
            forkserver.ForkServer(proc.pid, req_w, st_r, frozenset(), popen=proc)
            for proc, (req_w, st_r) in zip(self._server_popens, pipes)
        ]

    def _close_servers(self) -> None:
        for server in self._servers:
            server.close()
        for proc in self._server_popens:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self._servers, self._server_popens = [], []

    def kill_procs(self) -> None:
        """SIGTERM every process group started here, then SIGKILL what is left after 5 s."""
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            live = [p for p in self._procs if p.poll() is None]
            for p in live:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + grace
            for p in live:
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._procs = [p for p in self._procs if p.poll() is None]

    def down(self) -> None:
        """Remove everything this cluster created (idempotent).

        SIGINT/SIGTERM/SIGHUP are held back while it runs, so a second Ctrl-C cannot cut
        the clean-up short; every step is attempted even when an earlier one fails.
        """
        if self._down:
            return
        self._down = True
        with stop_signals_held():
            self._tear_down()

    def _tear_down(self) -> None:
        try:
            steps = [self.kill_procs, self._close_servers]
            # Anything that escaped its process group still lives inside our namespaces.
            steps += [lambda ns=ns: _kill_netns_pids(ns) for ns in self._namespaces]
            if self.bridge_ns in self._namespaces:
                steps += [
                    lambda i=i: self._run(
                        f"ip -n {self.bridge_ns} link del {self.port_ifname(i)}", check=False
                    )
                    for i in range(self.workers)
                ]
            steps += [
                lambda ns=ns: self._run(f"ip netns del {ns}", check=False)
                for ns in reversed(self._namespaces)
            ]
            for step in steps:
                try:
                    step()
                except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                    print(f"[cluster] clean-up step failed: {exc}", file=sys.stderr)
            left = [n for n in _list_netns() if n.startswith(self.run_id + "-")]
            if left:
                print(
                    f"[cluster] WARNING: could not delete namespaces {left}; "
                    "run `python -m bench.cluster --cleanup-stale` after this process exits",
                    file=sys.stderr,
                )
            self._namespaces = []
        finally:
            if self in _LIVE:
                _LIVE.remove(self)
