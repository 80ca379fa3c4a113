"""What the server checks before a route runs: the API key, and the size of the request body.

Both answer with OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Optional, Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY_BYTES = 1 << 20  # see docs/serving.md (Limits): a full context of text is far smaller
# A refused body is still read (and dropped) up to this much before the 413 goes out: a client
# still sending when the server closes gets a reset, not the 413. Beyond it, answer and close.
DRAIN_MAX_BYTES = 64 << 20
# ... at this pace at most, over all refused bodies together: reading them takes the event loop
# that serves every stream, and a client posting 8 MB bodies in a loop made other streams pause
# 20x their usual gap (benchmarks/isolation.py) until the draining was paced.
DRAIN_BYTES_PER_S = 32 << 20


def error_body(message: str, type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def key_index(authorization: str, keys: Sequence[str]) -> Optional[int]:
    """Which of `keys` the Authorization header carries (None: none of them). Every key is
    compared, in constant time, so the answer's timing says nothing about the keys."""
    found = None
    for i, key in enumerate(keys):
        if secrets.compare_digest(authorization.encode(), f"Bearer {key}".encode()):
            found = i
    return found


async def send_json(send: Send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


class BodyLimit:
    """Refuses a request body over `limit` bytes with 413 before any of it is parsed: at once when
    Content-Length says so, else as soon as the bytes received pass the limit. The body is read
    here, whole, and handed on to the route (it would be read whole there anyway)."""

    def __init__(self, app: ASGIApp, limit: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app, self.limit = app, limit
        self._drained_until = 0.0  # when the refused bytes read so far have been paid for (monotonic)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(receive, send)  # parses nothing, keeps nothing
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before it finished sending: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                return await self._refuse(receive, send, more=message.get("more_body", False))
            chunks.append(body)
            if not message.get("more_body", False):
                break
        first: Optional[Message] = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal first
            if first is not None:
                message, first = first, None
                return message
            return await receive()  # after the body: the disconnect, when the client leaves

        await self.app(scope, replay, send)

    async def _refuse(self, receive: Receive, send: Send, more: bool = True) -> None:
        drained = 0
        while more and drained <= DRAIN_MAX_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            n = len(message.get("body", b""))
            drained += n
            more = message.get("more_body", False)
            await self._pace(n)
        await send_json(send, 413, error_body(
            f"the request body is over this server's limit of {self.limit} bytes (--max-body-bytes)",
            code="request_too_large"))

    async def _pace(self, n: int) -> None:
        """Wait until `n` more refused bytes fit the shared drain pace (DRAIN_BYTES_PER_S)."""
        now = time.monotonic()
        self._drained_until = max(now, self._drained_until) + n / DRAIN_BYTES_PER_S
        if self._drained_until > now:
            await asyncio.sleep(self._drained_until - now)
