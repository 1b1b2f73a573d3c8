"""The torchft lighthouse as a process of its own (``ft.lighthouse=null``).

``python -m easgd_lightning.ft.lighthouse ADDRESS_FILE MIN_REPLICAS JOIN_MS HEARTBEAT_MS``
serves torchft's ``LighthouseServer`` (the quorum decider shipped in torchft's wheel),
bound on 127.0.0.1 on a port the OS picks, writes its address (``http://127.0.0.1:PORT``)
atomically to ADDRESS_FILE, and serves until SIGTERM / SIGINT, or until the launcher dies
(``PR_SET_PDEATHSIG``). The launcher (:class:`LighthouseProcess`) starts it, waits, bounded,
until it answers on its port, and stops it at the end; a lighthouse that dies mid-run ends
the run with an error naming it (the workers could form no quorum without it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["LighthouseProcess", "answers", "main"]


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

    def __init__(self, run_dir: Path, min_replicas: int, join_timeout_s: float, heartbeat_timeout_s: float) -> None:
        self.run_dir = Path(run_dir)
        self.args = (int(min_replicas), int(join_timeout_s * 1000), int(heartbeat_timeout_s * 1000))
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None
        self.log_path = self.run_dir / "ranks" / "lighthouse.log"

    def start(self, timeout_s: float = 60.0) -> str:
        """Start it and wait until it answers (at most ``timeout_s``).

        Raises:
            RuntimeError: it exited or did not answer in time (its log is named).
        """
        addr_file = self.run_dir / "ranks" / "lighthouse.addr"
        addr_file.parent.mkdir(parents=True, exist_ok=True)
        addr_file.unlink(missing_ok=True)
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "warn")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "easgd_lightning.ft.lighthouse", str(addr_file), *map(str, self.args)],
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


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4:
        sys.exit("usage: python -m easgd_lightning.ft.lighthouse ADDRESS_FILE MIN_REPLICAS JOIN_MS HEARTBEAT_MS")
    addr_file, min_replicas, join_ms, heartbeat_ms = Path(args[0]), int(args[1]), int(args[2]), int(args[3])
    _die_with_parent()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: done.set())
    from easgd_lightning.compat.torchft import lighthouse_server_class

    server = lighthouse_server_class()(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=join_ms,
                              heartbeat_timeout_ms=heartbeat_ms)
    address = server.address().replace(socket.gethostname(), "127.0.0.1")
    tmp = addr_file.with_name(f".{addr_file.name}.{os.getpid()}.tmp")
    tmp.write_text(address + "\n")
    os.replace(tmp, addr_file)
    print(f"lighthouse serving at {address} (min_replicas={min_replicas}, join_timeout_ms={join_ms}, "
          f"heartbeat_timeout_ms={heartbeat_ms})", flush=True)
    while not done.wait(0.5):
        pass
    server.shutdown()


if __name__ == "__main__":
    main()
