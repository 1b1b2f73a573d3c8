"""A real single-machine SLURM cluster (slurmctld + slurmd + munged) for tests and users.

    python scripts/slurm_local.py                 # start, print how to use it, wait for Ctrl-C
    python scripts/slurm_local.py -- CMD ARGS...  # start, run CMD with SLURM_CONF set, stop
    python scripts/slurm_local.py --install ...   # apt-get install slurm-wlm munge first
    python scripts/slurm_local.py --cleanup-stale # stop clusters whose owner died

Everything lives in one private state directory (``/tmp/easgd-slurm-<pid>-*``): a munge
key and munged on its own socket (``AuthInfo=socket=...``, so a system munged is never
touched), a ``slurm.conf`` for this machine (one node with the CPUs and memory that
``slurmd -C`` reports, one partition), and the daemons' state, spool, logs and pid files,
on free TCP ports. Settings that work in a container without cgroups or systemd:
``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``,
``JobAcctGatherType=jobacct_gather/none``, ``AccountingStorageType=accounting_storage/none``
(no slurmdbd, so ``sacct`` has nothing to say: ``squeue``/``scontrol`` are the job states).

The daemons run in the foreground as children of this process (``-D`` / ``-F``) with
``PR_SET_PDEATHSIG``, so they end with it even when it is SIGKILLed. :meth:`LocalSlurm.down`
cancels every job, waits (bounded) until ``squeue`` is empty, stops the daemons (SIGTERM,
then SIGKILL) and removes the state directory; it runs on exit, on Ctrl-C and on SIGTERM
/ SIGHUP (the command-line entry routes those signals through ``finally``).

The pytest fixture (``tests/e2e/test_slurm.py``) imports this module; it skips with the
reason (:class:`SlurmUnavailable`) where the packages cannot be installed or the daemons
cannot start.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

__all__ = ["SlurmUnavailable", "LocalSlurm", "find_binaries", "install_packages", "main"]

PREFIX = "easgd-slurm"
PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sinfo", "squeue", "sbatch", "srun", "scancel", "scontrol")
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin", "/sbin"])


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the local cluster; the message says why."""


def find_binaries() -> dict[str, str]:
    """Paths of the daemons and client commands, or SlurmUnavailable naming the missing ones."""
    found = {name: shutil.which(name, path=_SEARCH_PATH) for name in (*DAEMONS, *CLIENTS)}
    missing = sorted(name for name, path in found.items() if path is None)
    if missing:
        raise SlurmUnavailable(
            f"{', '.join(missing)} not found (Debian/Ubuntu: apt-get install {' '.join(PACKAGES)})"
        )
    return {name: str(path) for name, path in found.items()}


def install_packages(timeout_s: float = 600.0) -> None:
    """``apt-get install -y slurm-wlm munge`` (after ``apt-get update`` if the first try fails).

    Raises:
        SlurmUnavailable: not root, no apt-get, or the installation failed (its last words).
    """
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"no apt-get to install {' '.join(PACKAGES)}; install them by hand")
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"installing {' '.join(PACKAGES)} needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    last = ""
    for cmds in ([install], [["apt-get", "update", "-q"], install]):
        try:
            for cmd in cmds:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
                last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
                last = f"`{' '.join(cmd)}` exit {proc.returncode}: {last[0]}"
                if proc.returncode != 0:
                    break
            else:
                return
        except subprocess.TimeoutExpired:
            last = f"`apt-get` did not finish within {timeout_s:.0f} s"
    raise SlurmUnavailable(f"could not install {' '.join(PACKAGES)}: {last}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this daemon when the process that started it ends (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def node_line(slurmd: str) -> dict[str, str]:
    """This machine as ``slurmd -C`` sees it: NodeName, CPUs, sockets, cores, threads, RealMemory."""
    out = subprocess.run([slurmd, "-C"], capture_output=True, text=True, timeout=30)
    first = out.stdout.splitlines()[0] if out.stdout else ""
    fields = dict(tok.split("=", 1) for tok in first.split() if "=" in tok)
    if "CPUs" not in fields:
        raise SlurmUnavailable(f"`slurmd -C` did not describe this node: {out.stderr.strip() or out.stdout!r}")
    return fields


class LocalSlurm:
    """One private SLURM cluster on this machine: use as a context manager.

    Args:
        install: apt-get install the packages when they are missing.
        ready_timeout_s: how long :meth:`up` waits for ``sinfo`` to show the node idle.
        kill_wait_s: SLURM's ``KillWait``: seconds between a cancelled job's SIGTERM and SIGKILL.
        log: a callable for progress lines (default: stderr).
    """

    partition = "debug"

    def __init__(self, *, install: bool = False, ready_timeout_s: float = 60.0, kill_wait_s: int = 5,
                 log=None) -> None:
        self.install = install
        self.ready_timeout_s = ready_timeout_s
        self.kill_wait_s = kill_wait_s
        self._log = log or (lambda msg: print(f"[slurm] {msg}", file=sys.stderr, flush=True))
        self.dir: Path | None = None
        self.bins: dict[str, str] = {}
        self.node: dict[str, str] = {}
        self._procs: dict[str, subprocess.Popen] = {}
        self._down = False

    # -- what a client needs
    @property
    def conf(self) -> Path:
        assert self.dir is not None, "the cluster is not up"
        return self.dir / "slurm.conf"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default ``os.environ``) with ``SLURM_CONF`` pointing at this cluster and
        the SLURM commands on ``PATH``."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        bindir = str(Path(self.bins["sinfo"]).parent)
        if bindir not in env.get("PATH", "").split(os.pathsep):
            env["PATH"] = os.pathsep.join(p for p in (env.get("PATH", ""), bindir) if p)
        return env

    def run(self, *cmd: str, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster."""
        proc = subprocess.run(
            [self.bins.get(cmd[0], cmd[0]), *cmd[1:]], env=self.env(), capture_output=True, text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` exit {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def node_state(self) -> str:
        """The node's state as ``sinfo`` shows it (``idle``, ``mix``, ``alloc``, ``down*``, ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%t", check=False)
        return out.stdout.strip() if out.returncode == 0 else f"? ({out.stderr.strip()})"

    def queue(self) -> list[tuple[str, str]]:
        """(job id, state) of every job ``squeue`` still shows."""
        out = self.run("squeue", "-h", "-o", "%i %T")
        return [tuple(line.split(None, 1)) for line in out.stdout.splitlines() if line.strip()]

    # -- lifecycle
    def __enter__(self) -> Self:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Find (or install) the packages, write the configuration, start the daemons and wait
        until the node is idle.

        Raises:
            SlurmUnavailable: packages missing, a daemon would not start, or the node did not
                become idle within ``ready_timeout_s`` (with the daemon's last log line).
        """
        try:
            self.bins = find_binaries()
        except SlurmUnavailable:
            if not self.install:
                raise
            self._log(f"installing {' '.join(PACKAGES)} with apt-get")
            install_packages()
            self.bins = find_binaries()
        if os.geteuid() != 0:
            raise SlurmUnavailable("the local cluster runs slurmd as root (it starts jobs as any user); not root")
        self.node = node_line(self.bins["slurmd"])
        self.dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{os.getpid()}-"))
        os.chmod(self.dir, 0o755)
        _LIVE.append(self)
        self._write_munge_key()
        self._start("munged", [self.bins["munged"], "--foreground", "--force",
                               f"--socket={self.dir / 'munge.socket'}", f"--key-file={self.dir / 'munge.key'}",
                               f"--pid-file={self.dir / 'munged.pid'}", f"--log-file={self.dir / 'munged.log'}",
                               f"--seed-file={self.dir / 'munged.seed'}"])
        self._wait_for(lambda: (self.dir / "munge.socket").exists(), "munged's socket", 15.0, "munged")
        self._write_conf()
        self._start("slurmctld", [self.bins["slurmctld"], "-D", "-i", "-f", str(self.conf)])
        self._start("slurmd", [self.bins["slurmd"], "-D", "-f", str(self.conf), "-N", self.node["NodeName"]])
        started = time.monotonic()
        self._wait_for(lambda: self.node_state() == "idle", "the node idle in sinfo", self.ready_timeout_s,
                       "slurmd")
        self._log(f"cluster up in {time.monotonic() - started:.1f}s: node {self.node['NodeName']} "
                  f"({self.node['CPUs']} CPUs, {self.node.get('RealMemory', '?')} MB) idle; "
                  f"SLURM_CONF={self.conf}")

    def _write_munge_key(self) -> None:
        key = self.dir / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(os.urandom(1024))

    def _write_conf(self) -> None:
        d, n = self.dir, self.node
        name = n["NodeName"]
        memory = n.get("RealMemory", "1")
        hw = " ".join(f"{k}={n[k]}" for k in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket",
                                               "ThreadsPerCore") if k in n)
        (d / "state").mkdir()
        (d / "spool").mkdir()
        text = f"""\
# A single-machine SLURM cluster written by scripts/slurm_local.py (removed when it stops).
ClusterName=easgd
SlurmctldHost={name}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d / 'munge.socket'}
CredType=cred/munge
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'slurmd.log'}
# no cgroups, no systemd, no accounting daemon: works in a container
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
KillWait={self.kill_wait_s}
MinJobAge=300
InactiveLimit=0
SlurmdTimeout=60
SlurmctldTimeout=60
NodeName={name} NodeAddr=127.0.0.1 {hw} RealMemory={memory} State=UNKNOWN
PartitionName={self.partition} Nodes={name} Default=YES MaxTime=INFINITE State=UP
"""
        self.conf.write_text(text)

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / f"{name}.out", "wb")  # noqa: SIM115 - closed with the process
        try:
            self._procs[name] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, "SLURM_CONF": str(self.conf)}, preexec_fn=_die_with_parent,
                start_new_session=True,
            )
        finally:
            log.close()

    def _last_words(self, name: str) -> str:
        lines: list[str] = []
        for path in (self.dir / f"{name}.log", self.dir / f"{name}.out"):
            try:
                lines += [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
            except OSError:
                pass
        errors = [ln for ln in lines if re.search(r"error|fatal", ln, re.I)]
        return (errors or lines or ["(no log)"])[-1].strip()

    def _wait_for(self, ready, what: str, timeout_s: float, daemon: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited ({proc.returncode}) while waiting for {what}: "
                                           f"{self._last_words(name)}")
            if ready():
                return
            time.sleep(0.3)
        raise SlurmUnavailable(f"no {what} within {timeout_s:.0f} s: {daemon}: {self._last_words(daemon)}")

    def cancel_all(self, timeout_s: float = 30.0) -> list[tuple[str, str]]:
        """scancel every job and wait (bounded) until ``squeue`` is empty; returns what was left."""
        if "slurmctld" not in self._procs or self._procs["slurmctld"].poll() is not None:
            return []
        try:
            left = self.queue()
            if left:
                self.run("scancel", "-p", self.partition, check=False)
            deadline = time.monotonic() + timeout_s
            while left and time.monotonic() < deadline:
                time.sleep(0.5)
                left = self.queue()
            return left
        except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
            self._log(f"could not cancel the jobs: {exc}")
            return []

    def down(self) -> None:
        """Cancel the jobs, stop the daemons, remove the state directory (idempotent).

        SIGINT/SIGTERM/SIGHUP are held back while it runs, so a second Ctrl-C cannot cut
        the clean-up short.
        """
        if self._down:
            return
        self._down = True
        held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            left = self.cancel_all(timeout_s=self.kill_wait_s + 25.0)
            if left:
                self._log(f"jobs still in squeue after scancel: {left}")
            for name in reversed(DAEMONS):
                proc = self._procs.get(name)
                if proc is None or proc.poll() is not None:
                    continue
                for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                    try:
                        os.killpg(proc.pid, sig)
                    except (ProcessLookupError, PermissionError):
                        break
                    try:
                        proc.wait(timeout=grace)
                        break
                    except subprocess.TimeoutExpired:
                        continue
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)
        finally:
            if self in _LIVE:
                _LIVE.remove(self)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


_LIVE: list[LocalSlurm] = []


@atexit.register
def _down_all() -> None:
    for cluster in list(_LIVE):
        cluster.down()


def cleanup_stale(dry_run: bool = False) -> list[Path]:
    """Stop the daemons of, and remove, ``/tmp/easgd-slurm-<pid>-*`` whose owner is gone (a
    SIGKILLed owner's daemons end by PR_SET_PDEATHSIG, but their directory stays)."""
    stale = []
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}-*-*"):
        m = re.fullmatch(rf"{PREFIX}-(\d+)-\w+", path.name)
        if not (m and path.is_dir()) or Path(f"/proc/{m.group(1)}").exists():  # owner alive
            continue
        stale.append(path)
        if dry_run:
            continue
        for pidfile in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
            try:
                pid = int((path / pidfile).read_text().split()[0])
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except (OSError, ValueError, IndexError):
                continue
            if str(path).encode() in cmdline:  # still that cluster's daemon, not a reused pid
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(path, ignore_errors=True)
    return stale


class _Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def _on_signal(signum: int, _frame: object) -> None:
    raise _Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Start a single-machine SLURM cluster (munged, slurmctld, slurmd); run a command "
        "against it or wait for Ctrl-C; stop it and remove its state on exit.")
    parser.add_argument("--install", action="store_true", help="apt-get install slurm-wlm munge if missing")
    parser.add_argument("--ready-timeout-s", type=float, default=60.0)
    parser.add_argument("--cleanup-stale", action="store_true", help="stop clusters whose owner died, then exit")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS: run with SLURM_CONF set, then stop")
    args = parser.parse_args(argv)
    if args.cleanup_stale:
        for path in cleanup_stale():
            print(f"removed {path}")
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    try:
        with LocalSlurm(install=args.install, ready_timeout_s=args.ready_timeout_s) as cluster:
            if cmd:
                return subprocess.run(cmd, env=cluster.env()).returncode
            print(f"export SLURM_CONF={cluster.conf}\n(Ctrl-C stops the cluster and removes its state)",
                  flush=True)
            while True:
                time.sleep(3600)
    except SlurmUnavailable as err:
        print(f"slurm_local: {err}", file=sys.stderr)
        return 2
    except _Interrupted as err:
        print(f"slurm_local: {err}; cluster stopped", file=sys.stderr)
        return 128 + err.signum


if __name__ == "__main__":
    raise SystemExit(main())
