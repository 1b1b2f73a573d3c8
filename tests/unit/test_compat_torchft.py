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
