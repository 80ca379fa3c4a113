"""Accepting authenticated channels on a listening socket so that strangers cannot stall anyone.

The accept loop runs on a thread of its own and hands each new connection's handshake
(channel.admit) to a short-lived thread, so a connection that sends nothing, or half a hello, or
a wrong proof, costs the real peers no time: it is dropped at its own deadline while they are
admitted beside it. (The listener used to take strangers one at a time and give each 5 s, the
peer's own timeout: four idle connections made a local start-up give up, "do both hold the same
key?", naming no one.) At most PER_SOURCE handshakes from one address and MAX_PENDING in all are
in progress; more are closed at once. Refusals are logged with the address, at most one line per
address every LOG_EVERY_S seconds (with a count), so a flood cannot fill a disk.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from typing import Callable, Optional

from specpipe.distributed.channel import HANDSHAKE_S, Channel, ChannelError, admit

PER_SOURCE = 16  # room for every rank of a pipeline on one host, with clones of the store
MAX_PENDING = 128
LOG_EVERY_S = 10.0

log = logging.getLogger("specpipe.security")


class Acceptor:
    def __init__(self, listener: socket.socket, key: bytes, purpose: int, me: int,
                 allowed: Callable[[int], bool], on_channel: Callable[[Channel], None], name: str,
                 handshake_s: float = HANDSHAKE_S) -> None:
        """`allowed(rank)`: whether a connecting rank may join; `on_channel` gets each admitted
        channel (from a handshake thread); `name`: what this listener is, for the log."""
        self.listener, self.key, self.purpose, self.me = listener, key, purpose, me
        self.allowed, self.on_channel, self.name, self.handshake_s = allowed, on_channel, name, handshake_s
        self._lock = threading.Lock()
        self._pending: collections.Counter[str] = collections.Counter()
        self._logged: dict[str, tuple[float, int]] = {}  # address -> (last line, refusals since)
        self._closed = threading.Event()
        self.refused = 0
        self._thread = threading.Thread(target=self._loop, name=f"specpipe-accept-{name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        self.listener.settimeout(0.2)  # to notice close()
        while not self._closed.is_set():
            try:
                s, addr = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # the listener was closed
            host = addr[0]
            with self._lock:
                crowded = self._pending[host] >= PER_SOURCE or sum(self._pending.values()) >= MAX_PENDING
                if not crowded:
                    self._pending[host] += 1
            if crowded:
                self._refuse(s, host, "too many handshakes in progress from it")
                continue
            threading.Thread(target=self._handshake, args=(s, host), daemon=True,
                             name=f"specpipe-handshake-{self.name}").start()

    def _handshake(self, s: socket.socket, host: str) -> None:
        try:
            channel = admit(s, self.key, self.purpose, self.me, self.allowed, self.handshake_s)
        except (OSError, ChannelError) as e:  # socket.timeout included
            self._refuse(s, host, str(e) or type(e).__name__)
            return
        finally:
            with self._lock:
                self._pending[host] -= 1
                if self._pending[host] <= 0:
                    del self._pending[host]
        if self._closed.is_set():
            channel.close()
        else:
            self.on_channel(channel)

    def _refuse(self, s: socket.socket, host: str, why: str) -> None:
        try:
            s.close()
        except OSError:
            pass
        now = time.monotonic()
        with self._lock:
            self.refused += 1
            last, count = self._logged.get(host, (-LOG_EVERY_S, 0))
            if now - last < LOG_EVERY_S:
                self._logged[host] = (last, count + 1)
                return
            self._logged[host] = (now, 0)
        more = f" ({count} more refused since the last line)" if count else ""
        log.warning("%s: refused a connection from %s: %s%s", self.name, host, why, more)

    def close(self) -> None:
        self._closed.set()
        try:
            self.listener.close()
        except OSError:
            pass
        self._thread.join(timeout=1.0)


__all__ = ["Acceptor", "PER_SOURCE", "MAX_PENDING"]
