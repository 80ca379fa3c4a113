"""A chat answer in the pieces the other dialects' events are made of (Anthropic's Messages,
OpenAI's Responses): reasoning, content, the tool calls once complete, then the end.

    RequestStream --Deltas--> reasoning.py (split off <think>) --> tools (held while it may be a call)
                  --> Piece("reasoning" | "content" | "calls" | "end" | "error")

The pieces are chat's own (serving.answer_pieces, which chat's tool stream uses too): text
streams as content while it cannot be the start of a call; calls are known only when the answer
is complete. The whole-answer form is `finished`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from specpipe.engine.async_engine import RequestStream
from specpipe.entrypoints.openai.serving import Piece, _answer, _drain, _split_reasoning
from specpipe.entrypoints.openai.serving import answer_pieces as pieces
from specpipe.entrypoints.openai.tools import ToolCall

__all__ = ["Answer", "Piece", "finished", "pieces", "stop_string"]


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


def stop_string(stream: RequestStream) -> Optional[str]:
    """The stop string that ended the request, if one did."""
    output = getattr(stream.req, "output", None)
    return getattr(output, "stop_string", None)
