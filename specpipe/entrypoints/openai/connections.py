"""What the server allows a connection before any route runs: a deadline for a request's head,
and a bound on the connections one client address holds open.

uvicorn (0.55) has neither: its keep-alive timer starts only after a response, so a connection
that sends half a request head (or nothing) is held for good, and one address may open as many
as the process has descriptors. Both rules are added to uvicorn's h11 protocol here, the one it
uses when httptools is absent; `http_protocol` gives the class to pass as uvicorn's `http`.
"""

from __future__ import annotations

import asyncio
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 5.0  # from a connection's opening (or a request's first byte) to its complete head
MAX_CONNECTIONS_PER_CLIENT = 256  # open at once from one address (a load test's clients share one)
_BUSY_BODY = b"too many connections from this address"
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


def http_protocol(header_timeout_s: float = HEADER_TIMEOUT_S,
                  max_per_client: Optional[int] = MAX_CONNECTIONS_PER_CLIENT) -> type:
    """uvicorn's h11 protocol with a head deadline and a per-address connection bound."""
    return type("BoundedH11Protocol", (BoundedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "max_per_client": max_per_client})


class BoundedH11Protocol(H11Protocol):
    header_timeout_s: float = HEADER_TIMEOUT_S
    max_per_client: Optional[int] = MAX_CONNECTIONS_PER_CLIENT
    _head_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else None
        if self.max_per_client is not None and host is not None:
            same = sum(1 for c in self.connections if c.client and c.client[0] == host)
            if same > self.max_per_client:
                self.logger.warning("refused a connection from %s: %d open (the bound is %d)",
                                    host, same - 1, self.max_per_client)
                transport.write(BUSY)
                transport.close()
                return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first byte of a request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # its head is in: the route (and the body limit) take it from here

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closed a connection from %s: no complete request head within %g s",
                             self.client[0] if self.client else "?", self.header_timeout_s)
            self.transport.close()
