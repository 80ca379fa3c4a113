"""The pipeline's rendezvous: a key-value store that only holders of the pipeline's key can reach.

The ranks publish here their link addresses, readiness, errors and heartbeats (transport.py,
ranks.py); NCCL's group, where activations go over it, exchanges its ids here too. The driver
(rank 0) runs the server, on loopback for local stages, on the master address under torchrun,
on its node's address under Ray; every other rank is a client. torch's TCPStore, which it
replaces, let anyone who reached its port read and write every key: forge `failed/1` (blame the
wrong stage), write `error/1` into each new store during restarts (the server gave up after
three), rewrite a stage's address to put a relay in the middle, or store 32 × 8 MiB values.

Every connection is a channel.py channel (handshake proving the key, then a MAC on every
frame), accepted without delaying anyone (acceptor.py). On top of that:
- a rank may write the keys of its own rank only (`failed/2` by rank 2 or the driver), so a
  stage cannot blame another;
- keys, values, the number of keys and the bytes held are bounded (LIMITS), a request beyond
  them is refused with a reason, and nothing is allocated for a frame before its header is checked.

Wire: a request is REQ (op, key bytes, value bytes, argument) + key + value; a reply is REP
(status, value bytes, integer result) + value; both framed and sealed by the channel.
"""

from __future__ import annotations

import datetime
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from specpipe.distributed.acceptor import Acceptor
from specpipe.distributed.channel import STORE, BadFrame, Channel, ChannelError, introduce

REQ = struct.Struct("<BHIq")  # op, key bytes, value bytes, argument (timeout ms, or add's delta)
REP = struct.Struct("<BIq")  # status, value bytes, integer result
SET, GET, CHECK, ADD, DELETE, COMPARE_SET, NUM_KEYS, WAIT = range(1, 9)
OK, MISSING, DENIED, FULL = range(4)
# Keys named after the rank that writes them (ranks.py, transport.py, worker/stage_main.py).
RANK_KEYS = frozenset({"sock", "ready", "error", "failed", "lost", "bad", "heartbeat"})


@dataclass(frozen=True)
class Limits:
    key_bytes: int = 512
    value_bytes: int = 1 << 20  # a readiness line, an error, an address, NCCL's 128-byte id
    keys: int = 4096
    total_bytes: int = 16 << 20


LIMITS = Limits()


class StoreError(RuntimeError):
    """The store refused a request, the key did not appear in time, or the server is gone."""


class StoreServer:
    """The store's data and the threads serving its connections (one per connection)."""

    def __init__(self, key: bytes, world_size: int, bind: str, port: int = 0, limits: Limits = LIMITS) -> None:
        self.world_size, self.limits = world_size, limits
        self._values: dict[str, bytes] = {}
        self._bytes = 0
        self._cond = threading.Condition()
        self._channels: list[Channel] = []
        listener = socket.create_server((bind, port), backlog=128)
        self.port = listener.getsockname()[1]
        self._acceptor = Acceptor(listener, key, STORE, 0, lambda r: 0 <= r < world_size, self._serve_async,
                                  name=f"store :{self.port}")

    def _serve_async(self, ch: Channel) -> None:
        with self._cond:
            self._channels.append(ch)
        threading.Thread(target=self._serve, args=(ch,), name="specpipe-store-conn", daemon=True).start()

    def _serve(self, ch: Channel) -> None:
        limit = self.limits.key_bytes + self.limits.value_bytes + 8
        try:
            while True:
                header = bytes(ch.read_header(REQ.size, None))
                op, nkey, nval, arg = REQ.unpack(header)
                if nkey > self.limits.key_bytes or nkey + nval > limit:
                    raise BadFrame(f"rank {ch.peer} ({ch.where}) sent a store request of {nkey + nval} bytes")
                body = memoryview(bytearray(nkey + nval))
                ch.read_body(header, body, None)
                key, value = bytes(body[:nkey]).decode(errors="replace"), bytes(body[nkey:])
                status, out, result = self._apply(ch.peer, op, key, value, arg)
                ch.send_frame(REP.pack(status, len(out), result), out)
        except (OSError, ChannelError):
            pass  # the client went, or broke the protocol: its connection only
        finally:
            ch.close()
            with self._cond:
                if ch in self._channels:
                    self._channels.remove(ch)

    def _apply(self, rank: int, op: int, key: str, value: bytes, arg: int) -> tuple[int, bytes, int]:
        with self._cond:
            if op == SET:
                return self._set(rank, key, value)
            if op == GET:
                found = self._cond.wait_for(lambda: key in self._values, timeout=max(arg, 0) / 1000)
                return (OK, self._values[key], 0) if found else (MISSING, b"", 0)
            if op in (CHECK, WAIT):
                keys = value.decode(errors="replace").split("\0") if value else []
                ready = lambda: all(k in self._values for k in keys)  # noqa: E731
                done = ready() if op == CHECK else self._cond.wait_for(ready, timeout=max(arg, 0) / 1000)
                return OK, b"", int(done)
            if op == ADD:
                now = int(self._values.get(key, b"0") or 0) + arg
                status, _, _ = self._set(rank, key, str(now).encode())
                return status, b"", now
            if op == COMPARE_SET:
                n = int.from_bytes(value[:4], "little")
                expected, desired = value[4:4 + n], value[4 + n:]
                current = self._values.get(key)
                if (current is None and expected == b"") or current == expected:
                    status, _, _ = self._set(rank, key, desired)
                    return status, desired, 0
                return OK, expected if current is None else current, 0
            if op == DELETE:
                if not self._may_write(rank, key):
                    return DENIED, b"", 0
                old = self._values.pop(key, None)
                self._bytes -= 0 if old is None else len(old)
                return OK, b"", int(old is not None)
            if op == NUM_KEYS:
                return OK, b"", len(self._values)
            return DENIED, b"unknown operation", 0

    def _set(self, rank: int, key: str, value: bytes) -> tuple[int, bytes, int]:
        lim = self.limits
        if not self._may_write(rank, key):
            return DENIED, f"rank {rank} may not write {key!r}".encode(), 0
        old = self._values.get(key)
        grown = self._bytes + len(value) - (0 if old is None else len(old))
        if len(value) > lim.value_bytes or grown > lim.total_bytes or (old is None and len(self._values) >= lim.keys):
            return FULL, f"store full: {len(self._values)} keys, {self._bytes} bytes".encode(), 0
        self._values[key], self._bytes = value, grown
        self._cond.notify_all()
        return OK, b"", 0

    @staticmethod
    def _may_write(rank: int, key: str) -> bool:
        """`failed/2` and the like are rank 2's (or the driver's) to write, no one else's."""
        head, _, tail = key.rpartition("/")
        if rank == 0 or head not in RANK_KEYS or not tail.isdigit():
            return True
        return tail == str(rank)

    def close(self) -> None:
        self._acceptor.close()
        with self._cond:
            channels, self._channels = list(self._channels), []
        for ch in channels:
            ch.close()


class StoreClient(dist.Store):
    """A rank's connection to the store. A `torch.distributed.Store`, so NCCL's group can be
    built on it (through a PrefixStore); `get` waits for the key as TCPStore's does."""

    def __init__(self, host: str, port: int, key: bytes, rank: int, timeout_s: float = 300.0,
                 server: Optional[StoreServer] = None) -> None:
        super().__init__()
        self.host, self.port, self.rank, self.timeout_s = host, port, rank, timeout_s
        self._key, self._server = key, server
        self._lock = threading.Lock()
        self._ch = self._connect()

    def _connect(self) -> Channel:
        """The server may not listen yet (a torchrun stage starts before the driver): retry."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                s = socket.create_connection((self.host, self.port), timeout=min(5.0, self.timeout_s))
            except OSError as e:
                if time.monotonic() > deadline:
                    raise StoreError(f"cannot reach the rendezvous at {self.host}:{self.port} ({e})") from None
                time.sleep(0.2)
                continue
            try:
                return introduce(s, self._key, STORE, self.rank, 0)
            except (OSError, ChannelError) as e:
                s.close()
                raise StoreError(f"the rendezvous at {self.host}:{self.port} refused this rank "
                                 f"({e or type(e).__name__}): do all ranks hold the same key?") from None

    def _call(self, op: int, key: str = "", value: bytes = b"", arg: int = 0) -> tuple[bytes, int]:
        kb = key.encode()
        if len(kb) > LIMITS.key_bytes or len(value) > LIMITS.value_bytes:
            raise StoreError(f"a key of {len(kb)} bytes or a value of {len(value)} is over the store's limits")
        with self._lock:
            if self._ch is None:
                raise StoreError("the store connection is closed")
            try:
                self._ch.send_frame(REQ.pack(op, len(kb), len(value), arg), kb + value, timeout_s=30.0)
                header = bytes(self._ch.read_header(REP.size, None))
                status, n, result = REP.unpack(header)
                if n > LIMITS.value_bytes + 1024:
                    raise BadFrame(f"the rendezvous sent a reply of {n} bytes")
                body = memoryview(bytearray(n))
                self._ch.read_body(header, body, time.monotonic() + 30.0)
            except (OSError, ChannelError) as e:
                self._ch.close()
                self._ch = None
                raise StoreError(f"the rendezvous at {self.host}:{self.port} is gone ({e or type(e).__name__})") from None
        if status == MISSING:
            raise StoreError(f"rendezvous: no {key!r} within {arg / 1000:.0f} s")
        if status != OK:
            raise StoreError(f"rendezvous refused to write {key!r}: {bytes(body).decode(errors='replace')}")
        return bytes(body), result

    # -- the torch.distributed.Store interface (and what the transport uses) ----------------------
    def set(self, key: str, value) -> None:
        self._call(SET, key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self._call(GET, key, arg=round(self.timeout_s * 1000))[0]

    def check(self, keys: list[str]) -> bool:
        return bool(self._call(CHECK, value="\0".join(keys).encode())[1])

    def wait(self, keys: list[str], timeout: Optional[datetime.timedelta] = None) -> None:
        seconds = self.timeout_s if timeout is None else timeout.total_seconds()
        if not self._call(WAIT, value="\0".join(keys).encode(), arg=round(seconds * 1000))[1]:
            raise StoreError(f"rendezvous: {keys} not set within {seconds:.0f} s")

    def add(self, key: str, amount: int) -> int:
        return self._call(ADD, key, arg=amount)[1]

    def compare_set(self, key: str, expected, desired) -> bytes:
        e = expected.encode() if isinstance(expected, str) else bytes(expected)
        d = desired.encode() if isinstance(desired, str) else bytes(desired)
        return self._call(COMPARE_SET, key, len(e).to_bytes(4, "little") + e + d)[0]

    def delete_key(self, key: str) -> bool:
        return bool(self._call(DELETE, key)[1])

    def num_keys(self) -> int:
        return self._call(NUM_KEYS)[1]

    def clone(self) -> "StoreClient":
        """A connection of its own (the heartbeat thread's)."""
        return StoreClient(self.host, self.port, self._key, self.rank, self.timeout_s)

    def close(self) -> None:
        with self._lock:
            if self._ch is not None:
                self._ch.close()
                self._ch = None
        if self._server is not None:
            self._server.close()
            self._server = None


def open_store(rank: int, world_size: int, host: str, port: int, key: bytes, timeout_s: float = 300.0,
               bind: Optional[str] = None) -> StoreClient:
    """Rank 0: start the server (listening on `bind`, default `host`; port 0 picks one) and
    connect to it; any other rank: connect to the server at host:port."""
    if rank != 0:
        return StoreClient(host, port, key, rank, timeout_s)
    bind = host if bind is None else bind
    server = StoreServer(key, world_size, bind, port)
    return StoreClient(bind or "127.0.0.1", server.port, key, 0, timeout_s, server=server)


__all__ = ["StoreServer", "StoreClient", "StoreError", "open_store", "Limits", "LIMITS"]
