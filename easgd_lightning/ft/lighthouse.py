"""The torchft lighthouse as a process of its own.

``python -m easgd_lightning.ft.lighthouse [--bind HOST:PORT] [--advertise HOST]
[--min-replicas N] [--join-timeout-s S] [--heartbeat-timeout-s S] [--address-file PATH]``
serves torchft's ``LighthouseServer`` (the quorum decider shipped in torchft's wheel) on
``--bind`` (default ``0.0.0.0:29510``; port 0: the OS picks one), prints the address the
workers give as ``ft.lighthouse`` (``http://ADVERTISE:PORT``; ``--advertise`` defaults to the
bound host, or this machine's hostname when bound to every interface), writes it atomically
to ``--address-file`` if given, and serves until SIGTERM / SIGINT / SIGHUP (with
``--die-with-parent``, also until the process that started it dies: ``PR_SET_PDEATHSIG``).
The quorum options default to the ``ft`` group's (``ft.min_replicas``, ``ft.join_timeout_s``,
``ft.heartbeat_timeout_s``). This is the command a user runs before a torchrun launch
(README "Fault tolerance"); torchft's own ``torchft_lighthouse`` serves the same.

:class:`LighthouseProcess` is the same command started by a launcher (``easgd-train``'s own,
bound on 127.0.0.1; task 0 of a SLURM job, bound on every interface): it waits, bounded,
until the lighthouse answers on its port, and stops it at the end; a lighthouse that dies
mid-run ends the run with an error naming it (the workers could form no quorum without it).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["LighthouseProcess", "answers", "advertised_address", "main"]

#: the port torchft's examples give the lighthouse
DEFAULT_PORT = 29510


def answers(address: str, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``http://host:port``."""
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


class LighthouseProcess:
    """A lighthouse started by the launcher; ``address`` once :meth:`start` returned."""

    def __init__(self, run_dir: Path, min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float,
                 bind: str = "127.0.0.1:0") -> None:
        self.run_dir = Path(run_dir)
        self.args = ["--bind", bind, "--min-replicas", str(int(min_replicas)), "--join-timeout-s", str(join_timeout_s),
                     "--heartbeat-timeout-s", str(heartbeat_timeout_s), "--die-with-parent"]
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.log_path = self.run_dir / "ranks" / "lighthouse.log"

    def start(self, timeout_s: float = 60.0, fork_server=None) -> str:
        """Start it and wait until it answers (at most ``timeout_s``). With ``fork_server``
        (the launcher's, :mod:`easgd_lightning.cli.forkserver`) it is forked from there,
        torch already imported (a fresh interpreter spends ~1.5 s importing it before the
        first worker may start); its own session and its death with the server's as a
        spawned one.

        Raises:
            RuntimeError: it exited or did not answer in time (its log is named).
        """
        addr_file = self.run_dir / "ranks" / "lighthouse.addr"
        addr_file.parent.mkdir(parents=True, exist_ok=True)
        addr_file.unlink(missing_ok=True)
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "warn")
        args = [*self.args, "--address-file", str(addr_file)]
        if fork_server is not None:
            self.proc = fork_server.start([__name__, *args], env, os.getcwd(), [], entry=f"{__name__}:main",
                                          stdout=str(self.log_path), stderr=str(self.log_path))
        else:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", __name__, *args],
                    env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the torchft lighthouse exited with {self.proc.returncode} at start "
                                   f"(see {self.log_path})")
            if addr_file.exists():
                address = addr_file.read_text().strip()
                if address and answers(address):
                    self.address = address
                    return address
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the torchft lighthouse did not answer within {timeout_s:.0f}s (see {self.log_path})")

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; waits until it is gone."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace_s)
        except (ProcessLookupError, PermissionError):
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def advertised_address(bind: str, bound: str, advertise: str | None = None) -> str:
    """``http://HOST:PORT`` the workers reach: HOST is ``advertise``, else the host of
    ``bind`` (this machine's hostname when that is every interface, ``0.0.0.0`` / ``::``);
    PORT is the port of ``bound`` (the server's own address, which has the port the OS picked)."""
    host = advertise or bind.rpartition(":")[0].strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = socket.gethostname()
    port = bound.rstrip("/").rpartition(":")[2]
    return f"http://{host}:{port}"


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m easgd_lightning.ft.lighthouse",
                                description="Serve a torchft lighthouse for ft=torchft runs (README: Fault tolerance).")
    p.add_argument("--bind", default=f"0.0.0.0:{DEFAULT_PORT}", help="HOST:PORT to listen on (port 0: any free one)")
    p.add_argument("--advertise", default=None, help="host name the workers reach it by (default: see the module doc)")
    p.add_argument("--min-replicas", type=int, default=1, help="fewest replica groups a quorum needs (ft.min_replicas)")
    p.add_argument("--join-timeout-s", type=float, default=10.0,
                   help="how long a quorum waits for a live worker that has not asked yet (ft.join_timeout_s)")
    p.add_argument("--heartbeat-timeout-s", type=float, default=2.0,
                   help="a worker silent this long is out of the next quorum (ft.heartbeat_timeout_s)")
    p.add_argument("--address-file", type=Path, default=None, help="write the address here once serving")
    p.add_argument("--die-with-parent", action="store_true", help="stop when the process that started it dies")
    args = p.parse_args(argv)
    if args.min_replicas < 1 or args.join_timeout_s <= 0 or args.heartbeat_timeout_s <= 0:
        p.error("--min-replicas must be >= 1 and the timeouts > 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.die_with_parent:
        _die_with_parent()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: done.set())
    from easgd_lightning.compat.torchft import lighthouse_server_class

    join_ms, heartbeat_ms = int(args.join_timeout_s * 1000), int(args.heartbeat_timeout_s * 1000)
    server = lighthouse_server_class()(bind=args.bind, min_replicas=args.min_replicas, join_timeout_ms=join_ms,
                                       heartbeat_timeout_ms=heartbeat_ms)
    address = advertised_address(args.bind, server.address(), args.advertise)
    if args.address_file is not None:
        tmp = args.address_file.with_name(f".{args.address_file.name}.{os.getpid()}.tmp")
        tmp.write_text(address + "\n")
        os.replace(tmp, args.address_file)
    print(f"lighthouse serving at {address} (min_replicas={args.min_replicas}, join_timeout_ms={join_ms}, "
          f"heartbeat_timeout_ms={heartbeat_ms}); give the workers ft.lighthouse={address.split('://', 1)[1]}",
          flush=True)
    while not done.wait(0.5):
        pass
    server.shutdown()


if __name__ == "__main__":
    main()
