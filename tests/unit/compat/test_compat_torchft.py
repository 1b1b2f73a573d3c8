"""The private torchft names ``compat/torchft.py`` reads exist in the installed torchft."""

from __future__ import annotations

import inspect
import socket

import pytest

torchft = pytest.importorskip("torchft")


def test_manager_and_process_group_keep_what_we_read() -> None:
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    assert "self._quorum_id" in inspect.getsource(Manager.__init__)
    assert "self._global_ranks" in inspect.getsource(ProcessGroupGloo.configure)
    pg = ProcessGroupGloo()
    assert pg._global_ranks is None  # set by configure()


def test_quorum_ranks_and_id_from_objects() -> None:
    from types import SimpleNamespace

    from easgd_lightning.compat.torchft import quorum_id, quorum_ranks

    m = SimpleNamespace(_quorum_id=7, _pg=SimpleNamespace(_global_ranks=[2, 0]))
    assert quorum_id(m) == 7 and quorum_ranks(m) == [0, 2]
    assert quorum_ranks(SimpleNamespace()) == [] and quorum_id(SimpleNamespace()) is None


def test_lighthouse_server_class_serves() -> None:
    from easgd_lightning.compat.torchft import lighthouse_server_class
    from easgd_lightning.ft.lighthouse import answers

    server = lighthouse_server_class()(bind="127.0.0.1:0", min_replicas=1)
    try:
        assert answers(server.address().replace(socket.gethostname(), "127.0.0.1"))
    finally:
        server.shutdown()


def test_live_replicas_from_a_real_lighthouse() -> None:
    """The dashboard of a real lighthouse lists the heartbeating replica groups (ids without
    torchft's ``:uuid``); one silent past the heartbeat timeout is no longer live."""
    import time
    from datetime import timedelta

    from torchft._torchft import LighthouseClient

    from easgd_lightning.compat.torchft import lighthouse_server_class, live_replicas

    server = lighthouse_server_class()(bind="127.0.0.1:0", min_replicas=1, heartbeat_timeout_ms=1500)
    try:
        address = server.address().replace(socket.gethostname(), "127.0.0.1")
        client = LighthouseClient(address, timedelta(seconds=5))
        assert live_replicas(address) == set()
        client.heartbeat("r00000:0f3c")
        client.heartbeat("r00002:77aa")
        assert live_replicas(address) == {"r00000", "r00002"}
        time.sleep(1.8)  # past the timeout (1.5 s: wide enough for a loaded machine's first checks)
        client.heartbeat("r00002:77aa")
        assert live_replicas(address) == {"r00002"}
    finally:
        server.shutdown()
    # nothing answers: no barrier, not an error (torchft's shutdown returns before its HTTP
    # listener has closed: it answered once right after it, so this waits for that, bounded)
    deadline = time.monotonic() + 10.0
    while (found := live_replicas(address, timeout=0.5)) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert found is None


def test_pending_quorum_requests_from_a_real_lighthouse() -> None:
    """The dashboard's next-quorum line counts the replicas that asked and wait: none, then
    the one whose request is still open (min_replicas 2: it cannot be granted)."""
    import threading
    import time
    from datetime import timedelta

    from torchft._torchft import LighthouseClient

    from easgd_lightning.compat.torchft import lighthouse_server_class, pending_quorum_requests

    server = lighthouse_server_class()(bind="127.0.0.1:0", min_replicas=2, heartbeat_timeout_ms=5000)
    try:
        address = server.address().replace(socket.gethostname(), "127.0.0.1")
        assert pending_quorum_requests(address) == 0
        client = LighthouseClient(address, timedelta(seconds=5))
        failed: list[BaseException] = []

        def ask() -> None:
            try:
                client.quorum(replica_id="r00001:ab", timeout=timedelta(seconds=3))
            except Exception as err:  # the timeout of a quorum that cannot form: expected
                failed.append(err)

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        deadline = time.monotonic() + 2.5
        while pending_quorum_requests(address) != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pending_quorum_requests(address) == 1
        asker.join(10)
        assert failed  # it never got a quorum
    finally:
        server.shutdown()


def test_http_transport_advertises_the_given_host() -> None:
    """The live-state transport names the advertised host and its own port, and serves there."""
    from datetime import timedelta

    from easgd_lightning.compat.torchft import http_transport

    transport = http_transport(timedelta(seconds=5), "127.0.0.1")
    try:
        address = transport.address()
        port = transport._server.socket.getsockname()[1]
        assert address == f"http://127.0.0.1:{port}/checkpoint/"
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        transport.shutdown(wait=False)
