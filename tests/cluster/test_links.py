"""cluster/links.py: a link's round trip and rate between two endpoints, on loopback; a connection
without the probe's token is dropped before it is served."""

from __future__ import annotations

import socket
import struct

import pytest

from specpipe.cluster.links import ProbeServer, measure


def test_a_link_is_measured_in_well_under_a_second():
    import time

    server = ProbeServer("127.0.0.1")
    try:
        t0 = time.perf_counter()
        rtt_ms, rate = measure(server.address, server.port, server.token)
        assert time.perf_counter() - t0 < 2.0
        assert 0 < rtt_ms < 100 and rate > 10e6  # loopback: far above 10 MB/s on any machine
    finally:
        server.close()


def test_a_stranger_without_the_token_is_not_served():
    server = ProbeServer("127.0.0.1")
    try:
        with socket.create_connection((server.address, server.port), timeout=5) as s:
            s.sendall(bytes(16) + b"p" + struct.pack("!Q", 4) + b"ping")
            try:
                answer = s.recv(16)
            except ConnectionResetError:  # closed with our request unread: a reset
                answer = b""
            assert answer == b""  # closed without an answer
        with pytest.raises((ConnectionError, OSError)):
            measure(server.address, server.port, bytes(16))
    finally:
        server.close()
