"""Links that let no one in, and frames that cannot hurt a rank (distributed/sockets.py,
channel.py, acceptor.py): every link proves the pipeline's key before it carries a message; a
stranger, a wrong key, garbage or an idle connection at a listening rank is dropped without
delaying the real peer; every frame carries a MAC over a per-link sequence number, so a relay in
the middle can pass frames on but not alter, forge, replay, reorder or drop one unseen; a peer's
frame of a negative or oversized length or an unknown tag is refused, naming the peer, before
anything is allocated; activations of the wrong shape are refused by the stage (wire.py)."""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
import tracemalloc

import pytest
import torch
from proc_helpers import descendants

from specpipe.distributed.channel import HELLO, LINK, MAC_BYTES, MAGIC, NONCE_BYTES, PROOF_BYTES
from specpipe.distributed.sockets import HEADER, MalformedFrame, Mesh, SocketError
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


def connect(keys, store=None, before_peers=None, timeout=30.0, encrypt=(False, False, False, False)):
    """Meshes of len(keys) ranks (rank r with keys[r], encrypting where encrypt[r]);
    `before_peers(store)` runs once rank 0 listens. Returns (meshes, errors per rank)."""
    store = store or DictStore()
    meshes = [Mesh(r, len(keys), store, "127.0.0.1", k, limits=FRAME_LIMITS, encrypt=encrypt[r])
              for r, k in enumerate(keys)]
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
                    s.sendall(HELLO.pack(MAGIC, LINK, 7) + os.urandom(16))  # no such rank
                elif kind == 2:
                    s.sendall(HELLO.pack(MAGIC, LINK, 1) + os.urandom(16))
                    s.recv(48)
                    s.sendall(os.urandom(32))  # a forged proof
                else:
                    s.sendall(HELLO.pack(MAGIC, LINK, 1)[:2])  # half a hello, then gone
        growth = sum(st.size_diff for st in tracemalloc.take_snapshot().compare_to(before, "filename"))
        tracemalloc.stop()
        assert growth < 4 << 20, growth

    meshes, errors = connect([KEY, KEY], before_peers=attack, timeout=60.0)
    try:
        assert not errors and sorted(meshes[0].peers) == [1]
    finally:
        for m in meshes:
            m.close()


def test_idle_strangers_do_not_delay_the_real_peer():
    """Strangers that connect and say nothing (each held the listener for 5 s, one at a time:
    four made a start-up give up) no longer delay the real rank: it is admitted beside them."""
    idle: list[socket.socket] = []
    arrived: dict[str, float] = {}

    def hold(store):
        addr = _address(store)
        idle.extend(socket.create_connection(addr, timeout=5) for _ in range(8))
        arrived["t"] = time.monotonic()

    try:
        meshes, errors = connect([KEY, KEY], before_peers=hold, timeout=20.0)
        took = time.monotonic() - arrived["t"]
        assert not errors and sorted(meshes[0].peers) == [1]
        assert took < 2.0, f"the real peer waited {took:.1f} s behind idle strangers"
    finally:
        for s in idle:
            s.close()
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
    b.peers[0].sock.sendall(HEADER.pack(tag, length, 0))  # a header no SpecPipe rank sends
    with pytest.raises(MalformedFrame, match=rf"rank 1 \(127.0.0.1:\d+\) .*{words}"):
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


def test_a_frame_without_the_right_mac_is_refused_naming_the_peer(pair):
    """A well-formed frame whose MAC is not the link's (written straight onto rank 1's socket, as
    a stranger with a hijacked connection would) is refused; the link stays refused."""
    a, b = pair
    b.send(0, TAG_CONTROL, 0, b"\x01" * 8)
    assert bytes(a.recv(1, TAG_CONTROL, timeout_s=5)[1]) == b"\x01" * 8
    b.peers[0].sock.sendall(HEADER.pack(TAG_CONTROL, 8, 0) + b"\x02" * 8 + os.urandom(MAC_BYTES))
    with pytest.raises(MalformedFrame, match=r"rank 1 \(127.0.0.1:\d+\).*fails its MAC"):
        a.recv(1, TAG_CONTROL, timeout_s=5)
    with pytest.raises(SocketError):
        a.recv(1, TAG_CONTROL, timeout_s=1)


# ---- a relay in the middle -----------------------------------------------------------------------
class Relay:
    """A TCP relay between rank 1 (which connects to it, believing it is rank 0) and rank 0: it
    passes the handshake on untouched, then applies `tamper` to the list of frames rank 1 sends
    (each frame as bytes: header, body, MAC) before passing them on."""

    def __init__(self, target: tuple[str, int], tamper) -> None:
        self.target, self.tamper = target, tamper
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self.listener.getsockname()[1]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        inner, _ = self.listener.accept()
        outer = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(outer, inner), daemon=True).start()  # rank 0 -> rank 1 as is
        outer.sendall(_read(inner, HELLO.size + NONCE_BYTES))  # the acceptor's answer goes back by _pipe
        outer.sendall(_read(inner, PROOF_BYTES))
        frames = []
        while True:
            try:
                header = _read(inner, HEADER.size)
            except OSError:
                break
            _, n, _ = HEADER.unpack(header)
            frames.append(header + _read(inner, n + MAC_BYTES))
            if len(frames) == 3:
                try:
                    for f in self.tamper(frames):
                        outer.sendall(f)
                except OSError:  # the rank dropped the link on a tampered frame, as it should
                    break
                frames = []

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass


def _read(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise OSError("closed")
        buf += chunk
    return buf


def _flip(frames):
    f = bytearray(frames[1])
    f[HEADER.size] ^= 0x80  # the sign of the first value: negated activations, as the probe did
    return [frames[0], bytes(f), frames[2]]


TAMPERING = {
    "none": lambda fs: fs,
    "altered": _flip,
    "replayed": lambda fs: [fs[0], fs[0], fs[1], fs[2]],
    "reordered": lambda fs: [fs[1], fs[0], fs[2]],
    "dropped": lambda fs: [fs[0], fs[2]],
    "forged": lambda fs: [fs[0], HEADER.pack(TAG_CONTROL, 8, 0) + os.urandom(8 + MAC_BYTES), fs[1], fs[2]],
}


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "encrypted"])
@pytest.mark.parametrize("how", list(TAMPERING))
def test_a_relay_in_the_middle_can_pass_frames_on_but_change_none(how, encrypt):
    """Rank 1 is told rank 0 is at the relay's address (the store's `sock/0` rewritten, as the
    probe did when the store was open). Passed on untouched, the three frames arrive; altered,
    replayed, reordered, dropped or with one forged in between, rank 0 refuses the link at the
    first frame that is not the next one rank 1 sealed, naming rank 1."""
    store = DictStore()
    relays = []

    def redirect(store):
        host, port = store.get("sock/0").decode().rsplit(":", 1)
        relay = Relay((host, int(port)), TAMPERING[how])
        relays.append(relay)
        store.values["sock/0"] = relay.address.encode()

    meshes, errors = connect([KEY, KEY], store=store, before_peers=redirect, encrypt=(encrypt, encrypt))
    try:
        assert not errors
        sent = [struct.pack("<q", v) for v in (11, 22, 33)]
        for data in sent:
            meshes[1].send(0, TAG_CONTROL, 0, data)
        got = []
        try:
            for _ in range(3):
                got.append(bytes(meshes[0].recv(1, TAG_CONTROL, timeout_s=5)[1]))
        except MalformedFrame as e:
            assert how != "none" and "rank 1" in str(e) and ("tag" if encrypt else "MAC") in str(e)
        else:
            assert how == "none" and got == sent
        assert all(g == s for g, s in zip(got, sent))  # nothing altered was ever delivered
    finally:
        for m in meshes:
            m.close()


def test_fuzzed_frames_are_all_refused_and_the_next_link_works():
    """Random frames (random tags, lengths, bodies and MACs; mutations of real frames) written onto
    fresh links for a bounded time: every one is refused with a MalformedFrame or SocketError that
    names rank 1, nothing is delivered, nothing hangs, and memory stays flat."""
    rng = random.Random(57)
    deadline = time.monotonic() + 8.0
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    trials = 0
    while time.monotonic() < deadline:
        meshes, errors = connect([KEY, KEY])
        assert not errors
        try:
            a, b = meshes
            real = HEADER.pack(TAG_ROWS, 16, 0) + os.urandom(16)
            kind = rng.randrange(4)
            if kind == 0:  # a random header (tag, length) with random bytes after it
                frame = HEADER.pack(rng.choice([TAG_CONTROL, TAG_ROWS, 5, -1]), rng.randrange(-8, 1 << 12), 0)
                frame += os.urandom(rng.randrange(0, 64))
            elif kind == 1:  # a real-looking frame with a random MAC
                frame = real + os.urandom(MAC_BYTES)
            elif kind == 2:  # a properly sealed frame, then replayed with a bit flipped
                b.send(0, TAG_ROWS, 0, b"\x00" * 16)
                assert bytes(a.recv(1, TAG_ROWS, timeout_s=5)[1]) == b"\x00" * 16
                frame = real + os.urandom(MAC_BYTES)
            else:  # random bytes
                frame = os.urandom(rng.randrange(1, 200))
            b.peers[0].sock.sendall(frame)
            b.peers[0].sock.shutdown(socket.SHUT_WR)
            with pytest.raises(SocketError, match="rank 1"):
                a.recv(1, TAG_ROWS, timeout_s=2)
            trials += 1
        finally:
            for m in meshes:
                m.close()
    growth = sum(st.size_diff for st in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert trials >= 10 and growth < 4 << 20, (trials, growth)


def test_encrypted_links_hide_the_bodies_and_both_ends_must_agree():
    """--link-encryption: a body crosses the wire as ciphertext (a sniffer between the ranks does
    not see it) and arrives intact; a rank that does not encrypt is refused, saying why."""
    seen = []

    class Sniffer(Relay):
        def __init__(self, target):
            super().__init__(target, lambda fs: seen.extend(fs) or fs)

    store = DictStore()

    def redirect(store):
        host, port = store.get("sock/0").decode().rsplit(":", 1)
        store.values["sock/0"] = Sniffer((host, int(port))).address.encode()

    secret = b"the prompt: a secret plan" + b"\0" * 7
    meshes, errors = connect([KEY, KEY], store=store, before_peers=redirect, encrypt=(True, True))
    try:
        assert not errors
        for _ in range(3):
            meshes[1].send(0, TAG_CONTROL, 0, secret)
        assert all(bytes(meshes[0].recv(1, TAG_CONTROL, timeout_s=5)[1]) == secret for _ in range(3))
        assert len(seen) == 3 and not any(b"secret plan" in f for f in seen)
    finally:
        for m in meshes:
            m.close()
    meshes, errors = connect([KEY, KEY], encrypt=(True, False), timeout=8.0)
    try:
        assert 1 in errors and "link-encryption" in str(errors[1]) and 1 not in meshes[0].peers
    finally:
        for m in meshes:
            m.close()


# ---- the key on a local pipeline -------------------------------------------------------------------
def test_local_stages_get_the_key_by_pipe_and_honour_the_key_file(tiny_llama_dir, tmp_path):
    """The key reaches local stage processes on a pipe, never in their environment or command
    line (both readable in /proc by others); --cluster-key-file is the key they use (it was
    ignored for local stages); the rendezvous listens on loopback only."""
    from specpipe.config import EngineConfig
    from specpipe.distributed.store import StoreClient, StoreError
    from specpipe.engine.engine import Engine
    from specpipe.sampling import SamplingParams

    key = os.urandom(32)
    key_file = tmp_path / "key"
    key_file.write_bytes(key)
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), stages=2, kv_memory="1MiB", transport="processes",
                                 cluster_key_file=str(key_file)))
    try:
        assert len(engine.generate([5, 17, 33], SamplingParams(max_tokens=3)).token_ids) == 3
        pipe = engine.pipeline.inner
        stages = descendants(os.getpid())
        assert len(stages) >= 2
        for pid in stages:
            for what in ("environ", "cmdline"):
                seen = open(f"/proc/{pid}/{what}", "rb").read()
                assert key.hex().encode() not in seen.lower() and key not in seen, what
        store = pipe.t.store
        assert store._server._acceptor.listener.getsockname()[0] == "127.0.0.1"
        StoreClient("127.0.0.1", store.port, key, 1, timeout_s=5).close()  # the file's key is the key
        with pytest.raises(StoreError, match="same key"):
            StoreClient("127.0.0.1", store.port, os.urandom(32), 1, timeout_s=5)
    finally:
        engine.close()
