"""Framed messages between ranks over plain TCP, one connection per pair of ranks.

Why not gloo: its transport hands every message to an event-loop thread, which busy-polls while a
message waits for a lock the sending thread holds; where stages share cores (several stages on
one machine, a laptop) that thread was seen taking as much CPU as the stages' compute and
doubling pp's time per token (in a noisy spell of a 2-core VM; at parity when it was quiet:
docs/history.md, Part 2, §14). Here the thread that sends or receives does the system call
itself, and a waiting receiver sleeps in the kernel.

On the wire each message is a header (tag, payload bytes, due time), its payload and a MAC over
both and the link's sequence number (channel.py: forged, altered, replayed, reordered or dropped
frames are refused, naming the peer and its address). Messages
between two ranks arrive in the order they were sent; a receive for one tag stores the messages
of other tags it reads on the way (the driver's link to stage 1 carries control and rows).

Set-up (`connect`): each rank listens on a free port (`addresses`: the address it publishes and
the one it listens on), publishes it in the rendezvous store, connects to every lower rank and
accepts every higher one; each connection proves the pipeline's key in a handshake of its own, so
strangers at the port delay no real rank (acceptor.py).
"""

from __future__ import annotations

import collections
import os
import queue
import socket
import struct
import time
from typing import Optional

from specpipe.distributed.acceptor import Acceptor
from specpipe.distributed.channel import ENCRYPTED, LINK, BadFrame, Channel, ChannelError, introduce

HEADER = struct.Struct("<iqq")  # tag, payload bytes, due time (time.time_ns; 0: no emulation)
STASH_LIMIT = 64  # messages of one tag kept while a receive waits for another (a step needs 2-3)
DEFAULT_LIMIT = 64 << 20  # the largest payload of a tag without a limit of its own


class SocketError(RuntimeError):
    """A peer closed its connection, a receive timed out, or a message was not what was expected."""


class MalformedFrame(SocketError):
    """A frame no SpecPipe rank sends (a failed MAC, an unknown tag, an impossible length): the
    sender or someone on the way is at fault, not the link's going down."""


class Mesh:
    def __init__(self, rank: int, world_size: int, store, address: str, key: bytes, bind: Optional[str] = None,
                 limits: Optional[dict[int, int]] = None, encrypt: bool = False) -> None:
        """`address`: where the other ranks reach this one; `bind`: the address it listens on
        (default: `address`; "" for every interface); `key`: the pipeline's shared secret, which
        every link proves it holds and every frame carries a MAC of (channel.py); `limits`: the
        tags a message may carry, each with its largest payload (None: any tag, DEFAULT_LIMIT
        bytes); `encrypt`: bodies travel encrypted (--link-encryption; every rank must agree)."""
        if not key:
            raise ValueError("a mesh needs the pipeline's key")
        self.rank, self.world_size, self.store, self.address = rank, world_size, store, address
        self.key, self.limits = key, limits
        self.purpose = LINK | (ENCRYPTED if encrypt else 0)
        self.bind = address if bind is None else bind
        self.peers: dict[int, Channel] = {}
        self._stash: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._broken: dict[int, SocketError] = {}  # peer -> why its stream can no longer be read in step

    def connect(self, timeout_s: float) -> None:
        listener = socket.create_server((self.bind, 0), backlog=128)  # room for strangers beside the ranks
        admitted: queue.Queue[Channel] = queue.Queue()
        higher = lambda r: self.rank < r < self.world_size  # noqa: E731  (the ranks that connect to us)
        acceptor = Acceptor(listener, self.key, self.purpose, self.rank, higher, admitted.put, name=f"rank {self.rank} links")
        try:
            self.store.set(f"sock/{self.rank}", f"{self.address}:{listener.getsockname()[1]}")
            for peer in range(self.rank):  # the store waits until each lower rank has published
                where = self.store.get(f"sock/{peer}").decode()
                host, port = where.rsplit(":", 1)
                s = socket.create_connection((host, int(port)), timeout=timeout_s)
                try:
                    self.peers[peer] = introduce(s, self.key, self.purpose, self.rank, peer)
                except (OSError, ChannelError) as e:
                    s.close()
                    raise SocketError(f"rank {peer} at {where} refused this rank's link ({e or type(e).__name__}): "
                                      "do both hold the same key, and agree on --link-encryption?") from None
            deadline = time.monotonic() + timeout_s
            while len(self.peers) < self.world_size - 1:
                try:
                    ch = admitted.get(timeout=max(deadline - time.monotonic(), 1e-3))
                except queue.Empty:
                    missing = [r for r in range(self.world_size) if r != self.rank and r not in self.peers]
                    raise socket.timeout(f"ranks {missing} did not connect within {timeout_s:g} s "
                                         f"({acceptor.refused} other connections refused)") from None
                if ch.peer in self.peers:
                    ch.close()  # a second proof for a rank already here: keep the first
                else:
                    self.peers[ch.peer] = ch
        finally:
            acceptor.close()
            while not admitted.empty():  # admitted after the last rank arrived: nobody's
                ch = admitted.get()
                if self.peers.get(ch.peer) is not ch:
                    ch.close()

    def where(self, peer: int) -> str:
        """A peer as errors name it: its rank and address."""
        ch = self.peers.get(peer)
        return f"rank {peer} ({ch.where})" if ch is not None else f"rank {peer}"

    def send(self, dst: int, tag: int, due_ns: int, payload, timeout_s: Optional[float] = None) -> None:
        """Send `payload` (bytes or a buffer); blocks only while the peer's socket buffer is full."""
        if dst in self._broken:  # a message may have gone out in part: the stream is out of step
            raise self._broken[dst]
        try:
            self.peers[dst].send_frame(HEADER.pack(tag, memoryview(payload).nbytes, due_ns), payload, timeout_s)
        except OSError as e:  # socket.timeout included
            self._broken[dst] = SocketError(f"a send to {self.where(dst)} failed ({e or type(e).__name__})")
            raise self._broken[dst] from None

    def recv(self, src: int, tag: int, into: Optional[memoryview] = None,
             timeout_s: Optional[float] = None) -> tuple[int, memoryview]:
        """The next message with `tag` from `src`: (due time, payload). With `into`, the payload is
        read into that buffer, which must be its exact size. Its MAC is checked before it is
        returned."""
        stashed = self._stash.get((src, tag))
        if stashed:
            due, data = stashed.popleft()
            return due, _deliver(data, into, self.where(src), tag)
        if src in self._broken:
            raise self._broken[src]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        ch = self.peers[src]
        try:
            while True:
                header = bytes(ch.read_header(HEADER.size, deadline))
                got, n, due = HEADER.unpack(header)
                if got == tag and into is not None:
                    if n != into.nbytes:
                        raise MalformedFrame(f"{self.where(src)} sent {n} bytes with tag {tag}, "
                                             f"{into.nbytes} were expected")
                    ch.read_body(header, into, deadline)
                    return due, into
                self._check_frame(src, got, n)  # before a byte is allocated for it
                data = memoryview(bytearray(n))
                ch.read_body(header, data, deadline)
                if got == tag:
                    return due, data
                stash = self._stash[(src, got)]
                if len(stash) >= STASH_LIMIT:
                    raise MalformedFrame(f"{self.where(src)} sent more than {STASH_LIMIT} messages with tag {got} unread")
                stash.append((due, data))
        except socket.timeout:
            err = SocketError(f"no message from {self.where(src)} within {timeout_s:g} s")
        except BadFrame as e:
            err = MalformedFrame(str(e))
        except MalformedFrame as e:
            err = e
        except (OSError, ChannelError) as e:
            err = SocketError(f"the connection to {self.where(src)} failed ({e})")
        self._broken[src] = err  # a message may have been read in part: the stream is out of step
        raise err

    def _check_frame(self, src: int, tag: int, n: int) -> None:
        limit = DEFAULT_LIMIT if self.limits is None else self.limits.get(tag)
        if limit is None:
            raise MalformedFrame(f"{self.where(src)} sent a message with unknown tag {tag}")
        if not 0 <= n <= limit:
            raise MalformedFrame(f"{self.where(src)} sent a message of {n} bytes with tag {tag} (at most {limit})")

    def close(self) -> None:
        for ch in self.peers.values():
            ch.close()
        self.peers.clear()


def _deliver(data: memoryview, into: Optional[memoryview], who: str, tag: int) -> memoryview:
    if into is None:
        return data
    if data.nbytes != into.nbytes:
        raise MalformedFrame(f"{who} sent {data.nbytes} bytes with tag {tag}, {into.nbytes} were expected")
    into[:] = data
    return into


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
