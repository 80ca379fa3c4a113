"""What the network between two nodes costs, measured in well under a second per pair: the round
trip of a small message and the rate of a few megabytes, over a plain TCP connection between the
node agents (and the driver), as the pipeline's own links (distributed/sockets.py) will carry
its frames.

    probe server (on the far end): accepts a connection that opens with the token the driver
        gave it, then answers each request:  b"p" + 8-byte length + payload -> the payload back
                                             b"s" + 8-byte length + payload -> b"k" once read
    measure(address, port, token): PINGS round trips of a 64-byte ping (median), then a 256 KiB
        push; when that took under 30 ms, a 4 MiB push for a figure the buffers do not flatter.

Why a token: the server listens on the node's address for the few seconds of planning; anyone
else who connects without the token is dropped at once, so nobody can use it as an echo service
or hold it busy. Why not Ray's object transfers: they go through the object store and its own
channels, which are not the pipeline's path between the two hosts.
"""

from __future__ import annotations

import secrets
import socket
import statistics
import struct
import threading
import time

PINGS = 7
SMALL_PUSH = 256 << 10
BIG_PUSH = 4 << 20
MAX_PUSH = 16 << 20  # what the server reads at most in one request
TIMEOUT_S = 10.0  # a pair that cannot push 4 MiB in this is measured as what it managed


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(min(n - len(buf), 1 << 20))
        if not part:
            raise ConnectionError("the link probe's peer closed the connection")
        buf += part
    return bytes(buf)


class ProbeServer:
    """The far end of measure(): serves on (`address`, a free port) until close()."""

    def __init__(self, address: str) -> None:
        self.token = secrets.token_bytes(16)
        self.sock = socket.create_server((address, 0))
        self.address, self.port = address, self.sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="link-probe", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(TIMEOUT_S)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if not secrets.compare_digest(_recv_exact(conn, len(self.token)), self.token):
                    return
                while True:
                    head = conn.recv(9, socket.MSG_WAITALL)
                    if len(head) != 9:
                        return
                    op, n = head[:1], struct.unpack("!Q", head[1:])[0]
                    if op not in (b"p", b"s") or n > MAX_PUSH:
                        return
                    if op == b"p":
                        conn.sendall(_recv_exact(conn, n))
                    else:
                        left = n
                        while left:
                            got = conn.recv(min(left, 1 << 20))
                            if not got:
                                return
                            left -= len(got)
                        conn.sendall(b"k")
            except OSError:
                return

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.close()
        except OSError:
            pass


def measure(address: str, port: int, token: bytes) -> tuple[float, float]:
    """(round trip in ms, bytes per second) from here to the ProbeServer at address:port."""
    with socket.create_connection((address, port), timeout=TIMEOUT_S) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(token)
        ping = b"p" + struct.pack("!Q", 64) + bytes(64)
        rtts = []
        for _ in range(PINGS):
            t0 = time.perf_counter()
            s.sendall(ping)
            _recv_exact(s, 64)
            rtts.append((time.perf_counter() - t0) * 1e3)
        rate = 0.0
        for size in (SMALL_PUSH, BIG_PUSH):
            t0 = time.perf_counter()
            s.sendall(b"s" + struct.pack("!Q", size))
            s.sendall(bytes(size))
            _recv_exact(s, 1)
            took = time.perf_counter() - t0
            rate = size / max(1e-9, took)
            if took > 0.03:  # long enough to be the link's rate, not the socket buffers'
                break
        return statistics.median(rtts), rate
