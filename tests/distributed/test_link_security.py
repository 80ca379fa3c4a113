"""Links that let no one in, and frames that cannot hurt a rank (distributed/sockets.py):
every link proves the pipeline's key before it carries a message; a stranger, a wrong key or
garbage at a listening rank is dropped and the real peer still connects; a peer's frame of a
negative or oversized length or an unknown tag is refused, naming the peer, before anything is
allocated; activations of the wrong shape are refused by the stage (wire.py)."""

from __future__ import annotations

import os
import socket
import struct
import threading
import tracemalloc

import pytest
import torch

from specpipe.distributed.sockets import HEADER, HELLO, Mesh, SocketError
from specpipe.distributed.transport import FRAME_LIMITS, TAG_CONTROL, TAG_ROWS
from specpipe.distributed.wire import WireError, decode_rows_header, encode_rows
from specpipe.messages import NO_PARENT, Rows

KEY = b"k" * 32


class DictStore:
    """The store interface the mesh uses, in memory, with a blocking get."""

    def __init__(self) -> None:
        self.values, self.cond = {}, threading.Condition()

    def set(self, key, value):
        with self.cond:
            self.values[key] = value.encode() if isinstance(value, str) else value
            self.cond.notify_all()

    def get(self, key):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.values, timeout=30), key
            return self.values[key]


def connect(keys, store=None, before_peers=None, timeout=30.0):
    """Meshes of len(keys) ranks (rank r with keys[r]); `before_peers(store)` runs once rank 0
    listens. Returns (meshes, errors per rank)."""
    store = store or DictStore()
    meshes = [Mesh(r, len(keys), store, "127.0.0.1", key=k, limits=FRAME_LIMITS) for r, k in enumerate(keys)]
    errors: dict[int, BaseException] = {}

    def run(r):
        try:
            meshes[r].connect(timeout)
        except BaseException as e:  # noqa: BLE001
            errors[r] = e

    first = threading.Thread(target=run, args=(0,))
    first.start()
    if before_peers is not None:
        before_peers(store)
    others = [threading.Thread(target=run, args=(r,)) for r in range(1, len(keys))]
    for th in others:
        th.start()
    for th in [first, *others]:
        th.join(timeout + 10)
    return meshes, errors


def test_a_keyed_mesh_connects_and_carries_messages():
    meshes, errors = connect([KEY] * 3)
    try:
        assert not errors and [sorted(m.peers) for m in meshes] == [[1, 2], [0, 2], [0, 1]]
        meshes[2].send(0, TAG_CONTROL, 0, b"\x01" * 8)
        assert bytes(meshes[0].recv(2, TAG_CONTROL, timeout_s=5)[1]) == b"\x01" * 8
    finally:
        for m in meshes:
            m.close()


def test_a_wrong_key_is_refused():
    meshes, errors = connect([KEY, b"x" * 32], timeout=8.0)
    try:
        assert 1 in errors and "key" in str(errors[1]) and 1 not in meshes[0].peers
    finally:
        for m in meshes:
            m.close()


def _address(store) -> tuple[str, int]:
    host, port = store.get("sock/0").decode().rsplit(":", 1)
    return host, int(port)


def test_strangers_garbage_and_impostors_are_dropped_and_the_real_peer_still_connects():
    """1,000 connections before the real rank 1: random bytes, a rank out of range, the right
    rank with a wrong answer, half a hello. Each is dropped; nothing hangs; memory stays flat."""

    def attack(store):
        addr = _address(store)
        rng = [os.urandom(n) for n in (1, 3, 20, 64)]
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for i in range(1000):
            with socket.create_connection(addr, timeout=5) as s:
                kind = i % 4
                if kind == 0:
                    s.sendall(rng[i % len(rng)])
                elif kind == 1:
                    s.sendall(HELLO.pack(7) + os.urandom(16))  # no such rank
                elif kind == 2:
                    s.sendall(HELLO.pack(1) + os.urandom(16))
                    s.recv(48)
                    s.sendall(os.urandom(32))  # a forged proof
                else:
                    s.sendall(HELLO.pack(1)[:2])  # half a hello, then gone
        growth = sum(st.size_diff for st in tracemalloc.take_snapshot().compare_to(before, "filename"))
        tracemalloc.stop()
        assert growth < 4 << 20, growth

    meshes, errors = connect([KEY, KEY], before_peers=attack, timeout=60.0)
    try:
        assert not errors and sorted(meshes[0].peers) == [1]
    finally:
        for m in meshes:
            m.close()


@pytest.fixture
def pair():
    meshes, errors = connect([KEY, KEY])
    assert not errors
    yield meshes
    for m in meshes:
        m.close()


@pytest.mark.parametrize("tag,length,words", [
    (TAG_CONTROL, -5, "-5 bytes"),
    (TAG_CONTROL, 1 << 40, "at most"),
    (99, 8, "unknown tag 99"),
])
def test_a_bad_frame_is_refused_naming_the_peer_before_any_allocation(pair, tag, length, words):
    a, b = pair
    b.peers[0].sendall(HEADER.pack(tag, length, 0))  # a header no SpecPipe rank sends
    with pytest.raises(SocketError, match=rf"rank 1 .*{words}"):
        a.recv(1, TAG_CONTROL, timeout_s=5)
    with pytest.raises(SocketError):  # the peer is broken from now on
        a.recv(1, TAG_CONTROL, timeout_s=1)


def test_the_stash_of_unread_tags_is_bounded(pair):
    a, b = pair
    for _ in range(100):
        b.send(0, TAG_ROWS, 0, b"\x00" * 8)
    with pytest.raises(SocketError, match="unread"):
        a.recv(1, TAG_CONTROL, timeout_s=5)


def rows_header(width: int, n: int = 2) -> list[int]:
    rows = Rows(1, list(range(n)), [NO_PARENT] + list(range(n - 1)), list(range(n)), torch.zeros(n, width))
    return encode_rows([rows])[0]


def test_activation_shapes_are_checked_against_the_model():
    assert decode_rows_header(rows_header(64), hidden=64, max_rows=8)[0][1] == (2, 64)
    with pytest.raises(WireError, match="hidden size is 64"):
        decode_rows_header(rows_header(1 << 20), hidden=64, max_rows=8)
    with pytest.raises(WireError, match="at most 8"):
        decode_rows_header(rows_header(64, n=9), hidden=64, max_rows=8)
    one_d_floats = rows_header(64)[:-4] + [1, 1, 2]  # float32, 1-D, 2 values: only token ids are 1-D
    with pytest.raises(WireError, match="1-D"):
        decode_rows_header(one_d_floats, hidden=64, max_rows=8)
