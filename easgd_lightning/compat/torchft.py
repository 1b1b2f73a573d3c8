"""Every private name of torchft (0.2) the project reads, in one place.

``ft/worker.py`` records, per quorum, its id and the workers in it; torchft's ``Manager``
keeps the id in ``_quorum_id`` and hands the quorum's ranks to its reconfigurable process
group, which keeps them in ``_global_ranks`` (ranks from the replica ids' trailing digits:
our replica ids are ``r%05d`` of the worker rank). The lighthouse server class lives in the
compiled ``torchft._torchft`` (what the ``torchft_lighthouse`` command runs).
The lighthouse's dashboard (``GET /status``, an HTML page torchft renders) lists every
replica group that heartbeats, with the class ``old`` once the lighthouse's heartbeat timeout
has passed; :func:`live_replicas` reads it (the start barrier under an external launcher,
``ft/worker.py``). torchft's ``HTTPTransport`` (live state to a joiner) addresses itself by
``socket.gethostname()`` and keeps its server in ``_server``: :func:`http_transport` gives it
the worker's advertised host instead. The Manager's quorum runs on an executor thread whose
future is ``_quorum_future`` (:func:`quorum_pending`: still inside a call to the lighthouse,
which the interpreter's exit would wait for). ``tests/unit/compat/test_compat_torchft.py`` checks these against the installed torchft.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["quorum_id", "quorum_ranks", "quorum_pending", "lighthouse_server_class", "live_replicas", "pending_quorum_requests",
           "parse_heartbeats", "http_transport"]

#: one heartbeat on the dashboard: ``<li class="heartbeat [old]"> r00001:UUID: seen 0.02s ago``
_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*(\S+?): seen ')


def quorum_id(manager: Any) -> int | None:
    """The id of the manager's current quorum (None before the first)."""
    return getattr(manager, "_quorum_id", None)


def quorum_ranks(manager: Any) -> list[int]:
    """The global ranks of the manager's current quorum (sorted; [] when unknown)."""
    ranks = getattr(getattr(manager, "_pg", None), "_global_ranks", None)
    return sorted(int(r) for r in ranks) if ranks else []


def quorum_pending(manager: Any) -> bool:
    """True while the manager's last quorum request has not completed (its thread is inside a
    call to the lighthouse, which returns after ``quorum_timeout`` when the lighthouse is gone)."""
    future = getattr(manager, "_quorum_future", None)
    return future is not None and not future.done()


def lighthouse_server_class() -> type:
    """torchft's ``LighthouseServer`` (bind, min_replicas, join_timeout_ms, quorum_tick_ms,
    heartbeat_timeout_ms)."""
    from torchft._torchft import LighthouseServer

    return LighthouseServer


def parse_heartbeats(page: str) -> dict[str, bool] | None:
    """{replica id (without torchft's ``:uuid`` suffix): heartbeating now} from the
    dashboard's ``/status`` page; None when the page has no heartbeat list (torchft changed it)."""
    if "Heartbeats" not in page:
        return None
    live: dict[str, bool] = {}
    for old, replica in _HEARTBEAT.findall(page):
        name = replica.split(":", 1)[0]
        live[name] = live.get(name, False) or not old
    return live


def _status_page(address: str, timeout: float) -> str | None:
    """The lighthouse dashboard's ``/status`` page at ``http://host:port``; None when unread."""
    import urllib.request

    try:
        with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=timeout) as resp:
            return resp.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None


def live_replicas(address: str, timeout: float = 2.0) -> set[str] | None:
    """Replica ids whose heartbeat the lighthouse at ``http://host:port`` holds fresh now;
    None when the dashboard cannot be read or parsed."""
    page = _status_page(address, timeout)
    beats = None if page is None else parse_heartbeats(page)
    return None if beats is None else {r for r, live in beats.items() if live}


def pending_quorum_requests(address: str, timeout: float = 2.0) -> int | None:
    """How many replicas have asked the lighthouse for the next quorum (its "Next quorum
    status" line, ``[k/n participants healthy]``); None when the page cannot be read or has
    no such line."""
    import re

    page = _status_page(address, timeout)
    line = next((ln for ln in (page or "").splitlines() if "Next quorum status" in ln), "")
    found = re.search(r"\[(\d+)/\d+ participants healthy\]", line)
    return int(found.group(1)) if found else None


def http_transport(timeout: Any, host: str) -> Any:
    """torchft's ``HTTPTransport`` (no chunking, as the Manager's default) whose address names
    ``host``: the one peers reach this worker at (hosts that share a name, or whose name
    resolves to another network than the collectives')."""
    from torchft.checkpointing import HTTPTransport

    class _AdvertisedHTTPTransport(HTTPTransport):
        def address(self) -> str:
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

    return _AdvertisedHTTPTransport(timeout=timeout, num_chunks=0)
