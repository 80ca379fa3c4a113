"""The rendezvous store (distributed/store.py): only key holders reach it, each rank writes only
its own rank's keys, and what it holds is bounded; it is a torch.distributed Store (NCCL's group
is built on it). Each test here failed on torch's TCPStore, which the store replaced: anyone
could read and write every key of it."""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
import tracemalloc

import pytest
import torch
import torch.distributed as dist

from specpipe.distributed.channel import HELLO, MAGIC, STORE
from specpipe.distributed.store import Limits, StoreClient, StoreError, StoreServer, open_store

KEY = b"s" * 32


@pytest.fixture
def driver():
    store = open_store(0, 3, "127.0.0.1", 0, KEY, timeout_s=5)
    yield store
    store.close()


def test_only_key_holders_reach_the_store(driver):
    driver.set("sock/0", "127.0.0.1:1234")
    with pytest.raises(StoreError, match="same key"):
        StoreClient("127.0.0.1", driver.port, b"x" * 32, 1, timeout_s=5)
    with socket.create_connection(("127.0.0.1", driver.port)) as s:  # a keyless client asking for a key
        s.sendall(HELLO.pack(MAGIC, STORE, 1) + os.urandom(16))
        s.settimeout(5)
        s.recv(48)
        s.sendall(b"\x00" * 32)
        assert s.recv(1) == b""  # dropped, nothing read or written
    stage = StoreClient("127.0.0.1", driver.port, KEY, 1, timeout_s=5)
    assert stage.get("sock/0") == b"127.0.0.1:1234"
    stage.close()


def test_a_rank_writes_only_its_own_rank_keys(driver):
    two = StoreClient("127.0.0.1", driver.port, KEY, 2, timeout_s=5)
    try:
        two.set("failed/2", "its own failure")
        for forged in ("failed/1", "error/1", "sock/1", "heartbeat/1", "ready/1", "bad/1"):
            with pytest.raises(StoreError, match="may not write"):
                two.set(forged, "blame someone else")
        assert not driver.check(["failed/1"]) and driver.get("failed/2") == b"its own failure"
        driver.set("failed/1", "the driver may")  # the driver writes any key
        two.add("pg/counter", 1)  # keys of no rank (NCCL's) are anyone's
    finally:
        two.close()


def test_what_the_store_holds_is_bounded():
    server = StoreServer(KEY, 2, "127.0.0.1", limits=Limits(value_bytes=1 << 10, keys=8, total_bytes=4 << 10))
    client = StoreClient("127.0.0.1", server.port, KEY, 1, timeout_s=5)
    try:
        with pytest.raises(StoreError):  # over a value's limit: the frame is refused, the client dropped
            client.set("big", b"x" * 2048)
        client = StoreClient("127.0.0.1", server.port, KEY, 1, timeout_s=5)
        for i in range(3):
            client.set(f"k{i}", b"x" * 1000)
        with pytest.raises(StoreError, match="store full"):
            client.set("k3", b"x" * 1500)  # past the bytes held
        for i in range(3, 8):
            client.set(f"k{i}", b"")
        with pytest.raises(StoreError, match="store full"):
            client.set("one-too-many", b"")
        client.set("k0", b"y")  # replacing a value is always room
        assert client.get("k0") == b"y"
    finally:
        client.close()
        server.close()


def test_an_oversized_request_drops_the_connection_before_allocating(driver):
    """A key holder's frame header announcing 4 GB is refused before anything is allocated: the
    connection goes, the store stays."""
    from specpipe.distributed.store import REQ

    stage = StoreClient("127.0.0.1", driver.port, KEY, 1, timeout_s=5)
    tracemalloc.start()
    stage._ch.sock.sendall(REQ.pack(1, 4, (1 << 32) - 1, 0))
    stage._ch.sock.settimeout(5)
    assert stage._ch.sock.recv(1) == b""  # the server closed it
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 << 20
    driver.set("still", "serving")
    assert driver.get("still") == b"serving"


def test_get_waits_for_the_key_and_times_out_naming_it(driver):
    stage = StoreClient("127.0.0.1", driver.port, KEY, 1, timeout_s=0.5)
    threading.Timer(0.1, driver.set, args=("ready/1", "x")).start()
    assert stage.get("ready/1") == b"x"
    with pytest.raises(StoreError, match="no 'never'"):
        stage.get("never")
    stage.close()


def test_idle_strangers_do_not_delay_a_rank(driver):
    idle = [socket.create_connection(("127.0.0.1", driver.port)) for _ in range(12)]
    try:
        t0 = time.monotonic()
        stage = StoreClient("127.0.0.1", driver.port, KEY, 1, timeout_s=5)
        stage.set("ready/1", "ok")
        assert time.monotonic() - t0 < 2.0
        stage.close()
    finally:
        for s in idle:
            s.close()


def test_local_rendezvous_listens_on_loopback_only(driver):
    server = driver._server
    assert server is not None and server._acceptor.listener.getsockname()[0] == "127.0.0.1"


def test_it_is_a_torch_distributed_store():
    """NCCL's group is built on the store through a PrefixStore (transport.py); gloo's here, the
    same calls."""
    store = open_store(0, 1, "127.0.0.1", 0, KEY, timeout_s=20)
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=20))
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        assert store.compare_set("cas", "", "a") == b"a" and store.compare_set("cas", "b", "c") == b"a"
        assert store.delete_key("cas") and store.num_keys() >= 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        store.close()
