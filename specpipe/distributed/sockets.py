"""Framed messages between ranks over plain TCP, one connection per pair of ranks.

Why not gloo: its transport hands every message to an event-loop thread, which busy-polls while a
message waits for a lock the sending thread holds; where stages share cores (several stages on
one machine, a laptop) that thread was seen taking as much CPU as the stages' compute and
doubling pp's time per token (in a noisy spell of a 2-core VM; at parity when it was quiet:
docs/history.md, Part 2, §14). Here the thread that sends or receives does the system call
itself, and a waiting receiver sleeps in the kernel.

On the wire each message is a header (tag, payload bytes, due time) and its payload. Messages
between two ranks arrive in the order they were sent; a receive for one tag stores the messages
of other tags it reads on the way (the driver's link to stage 1 carries control and rows).

Set-up (`connect`): each rank listens on a free port (`addresses`: the address it publishes and
the one it listens on), publishes it in the rendezvous store, connects to every lower rank and
accepts every higher one.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import secrets
import socket
import struct
import time
from typing import Optional

HEADER = struct.Struct("<iqq")  # tag, payload bytes, due time (time.time_ns; 0: no emulation)
HELLO = struct.Struct("<i")  # the connecting rank
NONCE_BYTES, MAC_BYTES = 16, 32
HANDSHAKE_S = 5.0  # a connecting peer that has not proved itself by then is dropped
STASH_LIMIT = 64  # messages of one tag kept while a receive waits for another (a step needs 2-3)
DEFAULT_LIMIT = 64 << 20  # the largest payload of a tag without a limit of its own


class SocketError(RuntimeError):
    """A peer closed its connection, a receive timed out, or a message was not what was expected."""


class Mesh:
    def __init__(self, rank: int, world_size: int, store, address: str, bind: Optional[str] = None,
                 key: Optional[bytes] = None, limits: Optional[dict[int, int]] = None) -> None:
        """`address`: where the other ranks reach this one; `bind`: the address it listens on
        (default: `address`; "" for every interface); `key`: the pipeline's shared secret, which
        every link proves it holds before it carries a message (None: links open to whoever
        connects first with a rank); `limits`: the tags a message may carry, each with its largest
        payload (None: any tag, DEFAULT_LIMIT bytes)."""
        self.rank, self.world_size, self.store, self.address = rank, world_size, store, address
        self.key, self.limits = key, limits
        self.bind = address if bind is None else bind
        self.peers: dict[int, socket.socket] = {}
        self._stash: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._broken: dict[int, str] = {}  # peer -> why its stream can no longer be read in step

    def connect(self, timeout_s: float) -> None:
        listener = socket.create_server((self.bind, 0), backlog=128)  # room for strangers beside the ranks
        try:
            self.store.set(f"sock/{self.rank}", f"{self.address}:{listener.getsockname()[1]}")
            for peer in range(self.rank):  # the store waits until each lower rank has published
                host, port = self.store.get(f"sock/{peer}").decode().rsplit(":", 1)
                s = socket.create_connection((host, int(port)), timeout=timeout_s)
                try:
                    self._introduce(s, peer)
                except (OSError, SocketError) as e:
                    s.close()
                    raise SocketError(f"rank {peer} refused this rank's link ({e or type(e).__name__}): "
                                      "do both hold the same key?") from None
                self._add(peer, s)
            deadline = time.monotonic() + timeout_s
            while len(self.peers) < self.world_size - 1:
                listener.settimeout(max(deadline - time.monotonic(), 1e-3))
                s, _ = listener.accept()  # socket.timeout past the deadline: the caller reports it
                peer = self._admit(s)
                if peer is None:
                    s.close()  # a stranger, a wrong key or a rank already here: nothing kept for it
                else:
                    self._add(peer, s)
        finally:
            listener.close()

    # -- the handshake: HELLO + nonce ->; <- nonce + MAC("accept"); MAC("connect") ->
    def _mac(self, label: bytes, theirs: bytes, ours: bytes, lower: int, higher: int) -> bytes:
        return hmac.new(self.key, label + theirs + ours + struct.pack("<ii", lower, higher), hashlib.sha256).digest()

    def _introduce(self, s: socket.socket, peer: int) -> None:
        """The connecting side: say who we are, and prove the key once the acceptor has."""
        s.settimeout(HANDSHAKE_S)
        if self.key is None:
            s.sendall(HELLO.pack(self.rank))
            return
        mine = secrets.token_bytes(NONCE_BYTES)
        s.sendall(HELLO.pack(self.rank) + mine)
        reply = _read_exact(s, NONCE_BYTES + MAC_BYTES, time.monotonic() + HANDSHAKE_S)
        theirs, mac = bytes(reply[:NONCE_BYTES]), bytes(reply[NONCE_BYTES:])
        if not hmac.compare_digest(mac, self._mac(b"accept", mine, theirs, peer, self.rank)):
            raise SocketError("it does not hold the pipeline's key")
        s.sendall(self._mac(b"connect", theirs, mine, peer, self.rank))

    def _admit(self, s: socket.socket) -> Optional[int]:
        """The accepting side: the connecting rank once it has proved the key; None otherwise."""
        deadline = time.monotonic() + HANDSHAKE_S
        try:
            (peer,) = HELLO.unpack(_read_exact(s, HELLO.size, deadline))
            if not self.rank < peer < self.world_size or peer in self.peers:
                return None
            if self.key is None:
                return peer
            theirs = bytes(_read_exact(s, NONCE_BYTES, deadline))
            mine = secrets.token_bytes(NONCE_BYTES)
            s.settimeout(HANDSHAKE_S)
            s.sendall(mine + self._mac(b"accept", theirs, mine, self.rank, peer))
            mac = bytes(_read_exact(s, MAC_BYTES, deadline))
            return peer if hmac.compare_digest(mac, self._mac(b"connect", mine, theirs, self.rank, peer)) else None
        except (OSError, SocketError):
            return None

    def _add(self, peer: int, s: socket.socket) -> None:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(None)
        self.peers[peer] = s

    def send(self, dst: int, tag: int, due_ns: int, payload, timeout_s: Optional[float] = None) -> None:
        """Send `payload` (bytes or a buffer); blocks only while the peer's socket buffer is full."""
        if dst in self._broken:  # a message may have gone out in part: the stream is out of step
            raise SocketError(self._broken[dst])
        s = self.peers[dst]
        data = memoryview(payload).cast("B")
        s.settimeout(timeout_s)
        try:
            if data.nbytes <= 1 << 16:  # small: one write, one packet
                s.sendall(HEADER.pack(tag, data.nbytes, due_ns) + data)
            else:
                s.sendall(HEADER.pack(tag, data.nbytes, due_ns))
                s.sendall(data)
        except OSError as e:  # socket.timeout included
            self._broken[dst] = f"a send to rank {dst} failed ({e or type(e).__name__})"
            raise SocketError(self._broken[dst]) from None

    def recv(self, src: int, tag: int, into: Optional[memoryview] = None,
             timeout_s: Optional[float] = None) -> tuple[int, memoryview]:
        """The next message with `tag` from `src`: (due time, payload). With `into`, the payload is
        read into that buffer, which must be its exact size."""
        stashed = self._stash.get((src, tag))
        if stashed:
            due, data = stashed.popleft()
            return due, _deliver(data, into, src, tag)
        if src in self._broken:
            raise SocketError(self._broken[src])
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        s = self.peers[src]
        try:
            while True:
                got, n, due = HEADER.unpack(_read_exact(s, HEADER.size, deadline))
                if got == tag and into is not None:
                    if n != into.nbytes:
                        raise SocketError(f"rank {src} sent {n} bytes with tag {tag}, {into.nbytes} were expected")
                    _read_into(s, into, deadline)
                    return due, into
                self._check_frame(src, got, n)  # before a byte is allocated for it
                data = memoryview(bytearray(n))
                _read_into(s, data, deadline)
                if got == tag:
                    return due, data
                stash = self._stash[(src, got)]
                if len(stash) >= STASH_LIMIT:
                    raise SocketError(f"rank {src} sent more than {STASH_LIMIT} messages with tag {got} unread")
                stash.append((due, data))
        except socket.timeout:
            why = f"no message from rank {src} within {timeout_s:g} s"
        except OSError as e:
            why = f"the connection to rank {src} failed ({e})"
        except SocketError as e:
            why = str(e)
        self._broken[src] = why  # a message may have been read in part: the stream is out of step
        raise SocketError(why)

    def _check_frame(self, src: int, tag: int, n: int) -> None:
        limit = DEFAULT_LIMIT if self.limits is None else self.limits.get(tag)
        if limit is None:
            raise SocketError(f"rank {src} sent a message with unknown tag {tag}")
        if not 0 <= n <= limit:
            raise SocketError(f"rank {src} sent a message of {n} bytes with tag {tag} (at most {limit})")

    def close(self) -> None:
        for s in self.peers.values():
            try:
                s.close()
            except OSError:
                pass
        self.peers.clear()


def _deliver(data: memoryview, into: Optional[memoryview], src: int, tag: int) -> memoryview:
    if into is None:
        return data
    if data.nbytes != into.nbytes:
        raise SocketError(f"rank {src} sent {data.nbytes} bytes with tag {tag}, {into.nbytes} were expected")
    into[:] = data
    return into


def _read_into(s: socket.socket, buf: memoryview, deadline: Optional[float] = None) -> None:
    got = 0
    while got < buf.nbytes:
        s.settimeout(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
        n = s.recv_into(buf[got:])
        if n == 0:
            raise SocketError("connection closed by the peer")
        got += n


def _read_exact(s: socket.socket, n: int, deadline: Optional[float] = None) -> bytearray:
    buf = bytearray(n)
    _read_into(s, memoryview(buf), deadline)
    return buf


def addresses(master_addr: str, rank: int) -> tuple[str, str]:
    """(the address this rank publishes, the one it listens on). SPECPIPE_SOCKET_IFNAME (or, as
    before, GLOO_SOCKET_IFNAME) names the interface for both. Otherwise: a loopback master means a
    single-host job (127.0.0.1); rank 0 runs the store at the master address, so every other rank
    reaches it there (it listens on every interface: on its own host a master host name may
    resolve to a loopback address); any other rank publishes the address its host uses to reach
    the master."""
    name = os.environ.get("SPECPIPE_SOCKET_IFNAME") or os.environ.get("GLOO_SOCKET_IFNAME")
    if name:
        ip = interface_address(name)
        if ip is None:
            raise SocketError(f"network interface {name!r} has no IPv4 address")
        return ip, ip
    try:
        if socket.gethostbyname(master_addr).startswith("127."):
            return "127.0.0.1", "127.0.0.1"
        if rank == 0:
            return master_addr, ""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, 9))  # UDP: no packet is sent, the kernel only picks a route
            ip = s.getsockname()[0]
        return ip, ip
    except OSError as e:
        raise SocketError(f"cannot find the address that reaches {master_addr} ({e})") from None


def interface_address(name: str) -> Optional[str]:
    """Linux: the IPv4 address of the interface `name`, or None."""
    try:
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError):
        return None
