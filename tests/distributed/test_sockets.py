"""The ranks' TCP links (distributed/sockets.py): messages of each tag arrive in order, whatever
other tags are read on the way; a receive into a buffer checks the size; a silent or departed
peer is an error naming it, never a hang."""

from __future__ import annotations

import threading

import pytest

from specpipe.distributed.sockets import Mesh, SocketError, addresses
from specpipe.distributed.store import open_store

KEY = b"k" * 32


@pytest.fixture
def meshes():
    """Three connected ranks in this process (the connections are real loopback TCP)."""
    first = open_store(0, 3, "127.0.0.1", 0, KEY, timeout_s=30)
    stores = [first] + [open_store(r, 3, "127.0.0.1", first.port, KEY, timeout_s=30) for r in (1, 2)]
    out = [Mesh(r, 3, stores[r], "127.0.0.1", KEY) for r in range(3)]
    threads = [threading.Thread(target=m.connect, args=(30.0,)) for m in out]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    yield out
    for m in out:
        m.close()
    for st in reversed(stores):
        st.close()


def test_every_pair_is_connected(meshes):
    assert [sorted(m.peers) for m in meshes] == [[1, 2], [0, 2], [0, 1]]


def test_tags_are_kept_apart_and_in_order(meshes):
    a, b, _ = meshes
    big = bytes(range(256)) * 1024  # past the one-write size
    a.send(1, 1, 11, b"control-1")
    a.send(1, 2, 0, big)
    a.send(1, 1, 12, b"control-2")
    a.send(1, 2, 0, b"rows-2")
    assert b.recv(0, 2) == (0, memoryview(big))  # the first control message is stored on the way
    assert bytes(b.recv(0, 1)[1]) == b"control-1"
    assert b.recv(0, 1)[0] == 12
    into = memoryview(bytearray(6))
    assert bytes(b.recv(0, 2, into)[1]) == b"rows-2"
    assert bytes(into) == b"rows-2"


def test_a_buffer_of_the_wrong_size_is_an_error(meshes):
    a, b, _ = meshes
    a.send(1, 3, 0, b"12345678")
    with pytest.raises(SocketError, match="8 bytes with tag 3, 4 were expected"):
        b.recv(0, 3, memoryview(bytearray(4)))


def test_a_silent_peer_times_out_and_names_itself(meshes):
    _, b, _ = meshes
    with pytest.raises(SocketError, match=r"no message from rank 2 \(127.0.0.1:\d+\) within"):
        b.recv(2, 1, timeout_s=0.2)
    with pytest.raises(SocketError, match="rank 2"):  # the stream may be out of step: stays failed
        b.recv(2, 1, timeout_s=5)


def test_a_departed_peer_is_an_error(meshes):
    a, b, c = meshes
    c.close()
    with pytest.raises(SocketError, match="closed"):
        b.recv(2, 1, timeout_s=5)
    a.send(1, 1, 0, b"still here")  # the others' links are unaffected
    assert bytes(b.recv(0, 1, timeout_s=5)[1]) == b"still here"


def test_where_a_rank_listens(monkeypatch):
    """(published, listened on). The multi-host test over network namespaces runs the default
    path of the other ranks (the address that routes to the master)."""
    monkeypatch.delenv("SPECPIPE_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert addresses("127.0.0.1", 2) == addresses("localhost", 0) == ("127.0.0.1", "127.0.0.1")
    # The others reach rank 0 where they reach its store; on its own host the name may be loopback.
    assert addresses("10.1.2.3", 0) == ("10.1.2.3", "")
    monkeypatch.setenv("SPECPIPE_SOCKET_IFNAME", "lo")
    assert addresses("10.1.2.3", 0) == addresses("10.1.2.3", 1) == ("127.0.0.1", "127.0.0.1")
    monkeypatch.setenv("SPECPIPE_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(SocketError, match="no-such-if0"):
        addresses("10.1.2.3", 1)
