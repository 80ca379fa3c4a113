"""`n` > 1: a request's n samples, each a request of its own in the engine.

Seeds: sample i of a request with `seed` s is sampled with seed s + i, so sample i equals the same
request sent alone with n = 1 and seed s + i; without a seed each sample draws a random seed of its
own (SamplingParams.resolved). Greedy samples are all the same, as in vLLM.

Prefill: sample 0 is added first and the others once it has given its first token. By then its
prompt's full blocks have joined the prefix cache (engine/prefix_sharing.py), so the other
samples read them instead of computing the prompt again (only its last, partial block is
recomputed). Their usage reports them in `prompt_tokens_details.cached_tokens`.

best_of (completions): best_of samples are made the same way (sample i with seed + i), each with
its tokens' log-probabilities; the whole response keeps the n with the highest sum of them
(serving._best). Over n it is not streamed.

Responses: whole ones list the n choices with their `index`; streamed ones interleave the samples'
chunks as they come, each choice with its `index`, then one usage chunk (when asked) and [DONE].
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Callable, Optional

from specpipe.engine.async_engine import Delta, RequestStream


def sample_seed(seed: Optional[int], i: int) -> Optional[int]:
    """Sample i's seed: seed + i (None: each sample draws its own)."""
    return None if seed is None else seed + i


class Primed:
    """A RequestStream whose first Delta was already read (sample 0, while the others waited for
    its prefill): iterating gives that Delta again first, then the rest; everything else is the
    stream's."""

    def __init__(self, stream: RequestStream, first: Delta) -> None:
        self._stream, self._first = stream, first

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def __setattr__(self, name: str, value) -> None:
        if name in ("_stream", "_first"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._stream, name, value)

    def __aiter__(self) -> "Primed":
        return self

    async def __anext__(self) -> Delta:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._stream.__anext__()


class Samples:
    """The n streams of one request; `cancel()` cancels them all (as RequestStream's does one)."""

    def __init__(self, streams: list) -> None:
        self.streams = streams

    @property
    def model(self) -> str:
        return self.streams[0].model

    def cancel(self) -> None:
        for s in self.streams:
            s.cancel()


async def add_samples(n: int, add: Callable[[int], "asyncio.Future"]) -> Samples:
    """`add(i)` adds sample i and returns its stream. Sample 0 first, the others after its first
    token (see the module); if adding one fails, those added are cancelled and the error raised."""
    first = await add(0)
    try:
        delta = await first.__anext__()
    except BaseException:
        first.cancel()
        raise
    streams = [Primed(first, delta)]
    try:
        for i in range(1, n):
            streams.append(await add(i))
    except BaseException:
        Samples(streams).cancel()
        raise
    return Samples(streams)


def _indexed(event: str, index: int) -> str:
    """One server-sent event of a sample's stream with its choices' `index` set."""
    if not event.startswith("data: {"):
        return event
    body = json.loads(event[len("data: "):])
    for choice in body.get("choices") or ():
        choice["index"] = index
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def merged_events(samples: Samples, events: list[AsyncIterator[str]],
                        usage_event: Optional[Callable[[], str]] = None) -> AsyncIterator[str]:
    """The samples' event streams (each made without usage) as one: their chunks as they come,
    each with its index, then `usage_event()` (when given) once all are done, then [DONE]. An
    error event from one sample ends the whole stream."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[str]) -> None:
        try:
            async for event in gen:
                await queue.put((i, event))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, gen)) for i, gen in enumerate(events)]
    try:
        running = len(tasks)
        while running:
            i, event = await queue.get()
            if event is None:
                running -= 1
            elif event == "data: [DONE]\n\n":
                continue
            elif event.startswith('data: {"error"'):
                yield event
                break
            else:
                yield _indexed(event, i)
        else:
            if usage_event:
                yield usage_event()
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        samples.cancel()
