"""A chat answer in the pieces the other dialects' events are made of (Anthropic's Messages,
OpenAI's Responses): reasoning, content, the tool calls once complete, then the end.

    RequestStream --Deltas--> reasoning.py (split off <think>) --> tools (held while it may be a call)
                  --> Piece("reasoning" | "content" | "calls" | "end" | "error")

The rules are chat's (serving.py): text streams as content while it cannot be the start of a
call; calls are known only when the answer is complete. The whole-answer form is `finished`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Optional

from specpipe.engine.async_engine import RequestStream
from specpipe.entrypoints.openai.serving import (ApiError, _answer, _drain, _failure, _free_text_end,
                                                 _split_reasoning)
from specpipe.entrypoints.openai.tools import ToolCall


@dataclass
class Piece:
    kind: str  # "reasoning" | "content" | "calls" | "end" | "error"
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish: Optional[str] = None  # "stop", "length" or "tool_calls" (end)
    error: Optional[ApiError] = None  # (error)


@dataclass
class Answer:
    reasoning: Optional[str]
    content: Optional[str]
    calls: list[ToolCall]
    finish: str  # "stop", "length" or "tool_calls"


async def finished(stream: RequestStream) -> Answer:
    """The whole answer once the request is done (ApiError if it failed)."""
    s = await _drain(stream)
    reasoning, text = _split_reasoning(s)
    content, calls = _answer(s, text)
    return Answer(reasoning, content, calls, "tool_calls" if calls else s.finish_reason)


async def pieces(stream: RequestStream) -> AsyncIterator[Piece]:
    """The answer as it comes. However the iteration ends, the request is cancelled."""
    splitter = getattr(stream, "reasoning", None)
    tools = bool(getattr(stream, "tool_funcs", None))
    answer, sent = "", 0  # the answer less its reasoning; how much of it went out as content
    try:
        async for d in stream:
            if d.finish_reason in ("error", "abort"):
                yield Piece("error", error=_failure(stream))
                return
            reasoning, text = splitter.feed(d.text, d.finish_reason is not None) if splitter else ("", d.text)
            if reasoning:
                yield Piece("reasoning", reasoning)
            answer += text
            safe = _free_text_end(answer, stream.fenced_calls) if tools else len(answer)
            if safe > sent:
                yield Piece("content", answer[sent:safe])
                sent = safe
        _, calls = _answer(stream, answer)
        if not calls and answer[sent:]:
            yield Piece("content", answer[sent:])
        if calls:
            yield Piece("calls", calls=calls)
        yield Piece("end", finish="tool_calls" if calls else stream.finish_reason)
    finally:
        stream.cancel()


def stop_string(stream: RequestStream) -> Optional[str]:
    """The stop string that ended the request, if one did."""
    output = getattr(stream.req, "output", None)
    return getattr(output, "stop_string", None)
