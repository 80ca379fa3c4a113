"""Anthropic's Messages API (`POST /v1/messages`) on the chat engine: the body becomes a chat
completion request (same template, sampling, constraints, tool parsing), the answer becomes
Anthropic's message or its event stream.

    system, messages (text, tool_use, tool_result blocks), tools, tool_choice
        --to_chat--> ChatCompletionRequest --OpenAIServing.chat_stream--> RequestStream
        --answer_stream--> {"type": "message", "content": [thinking, text, tool_use blocks]}
                           or message_start, content_block_start/delta/stop, message_delta, message_stop

Mapping: tool_choice auto/any/tool/none = chat's auto/required/{function}/none; output_config's
format (a JSON schema) = response_format json_schema; thinking enabled/disabled = the template's
enable_thinking (chat_template_kwargs); stop_reason is end_turn, max_tokens, stop_sequence (with
the string) or tool_use; reasoning (<think>) comes as a thinking block with an empty signature.
Errors have Anthropic's shape `{"type": "error", "error": {"type": ..., "message": ...}}`.
`/v1/messages/count_tokens` counts the prompt's tokens as the template renders them.
Not served: images and documents (a 400), Anthropic's built-in tools (a 400: no input_schema),
prompt caching (cache_control is ignored), thinking budgets and effort (ignored). The current
`anthropic` client no longer sends temperature / top_p / top_k as arguments; they are read from
the body when given (extra_body).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from specpipe.engine.async_engine import RequestStream
from specpipe.entrypoints.openai import protocol as p
from specpipe.entrypoints.openai.answer_stream import finished, pieces, stop_string
from specpipe.entrypoints.openai.serving import ApiError, OpenAIServing
from specpipe.sampling import MAX_TOKENS, MAX_TOP_K

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Body):  # an earlier answer's reasoning, sent back: not shown to the template
    type: Literal["thinking", "redacted_thinking"]


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: Optional[StrictBool] = None


Block = Annotated[Union[TextBlock, ThinkingBlock, ToolUseBlock, ToolResultBlock], Field(discriminator="type")]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class Tool(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    input_schema: dict


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None


class JsonOutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Body):
    format: Optional[JsonOutputFormat] = None  # effort: ignored


class MessagesRequest(_Body):
    model: str = Field(max_length=256)
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: Optional[Annotated[list[p.StopString], Field(max_length=p.MAX_STOP_STRINGS)]] = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_K)
    stream: StrictBool = False
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    output_config: Optional[OutputConfig] = None
    thinking: Optional[dict] = None  # {"type": "disabled"}: the template's enable_thinking false


class CountTokensRequest(MessagesRequest):
    max_tokens: Optional[int] = Field(default=None, ge=1, le=MAX_TOKENS)  # not needed to count


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.body.error.message}}


def to_chat(body: MessagesRequest) -> p.ChatCompletionRequest:
    """The same request as a chat completion (ApiError 400 where that refuses it)."""
    messages: list[dict] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system)})
    for m in body.messages:
        messages += _chat_messages(m)
    chat: dict[str, Any] = dict(model=body.model, messages=messages, max_tokens=body.max_tokens,
                                temperature=body.temperature, stop=body.stop_sequences or None)
    if body.top_p is not None:
        chat["top_p"] = body.top_p
    if body.top_k is not None:
        chat["top_k"] = body.top_k
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in body.tools]
    if body.tool_choice is not None:
        c = body.tool_choice
        if c.type == "tool" and not c.name:
            raise ApiError(400, "tool_choice of type tool needs a name", param="tool_choice")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            c.type, {"type": "function", "function": {"name": c.name}})
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    thinking = (body.thinking or {}).get("type")
    if thinking in ("enabled", "adaptive", "disabled"):
        chat["chat_template_kwargs"] = {"enable_thinking": thinking != "disabled"}
    try:
        return p.ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        raise ApiError(400, _first_error(e)) from None


def _chat_messages(m: Message) -> list[dict]:
    """One Anthropic message as chat messages: a user's tool results become tool messages (first,
    as they answer the calls just made), an assistant's tool_use blocks its tool_calls."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
    out: list[dict] = []
    if m.role == "user":
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                            "content": b.content if isinstance(b.content, str) else _text(b.content or [])})
        if text or not out:
            out.append({"role": "user", "content": text})
        return out
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in m.content if isinstance(b, ToolUseBlock)]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


def _text(v: Union[str, list[TextBlock]]) -> str:
    return v if isinstance(v, str) else "".join(b.text for b in v)


def _first_error(e: ValidationError) -> str:
    first = e.errors()[0]
    loc = ".".join(str(x) for x in first.get("loc", ()))
    return f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")


class AnthropicServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def start(self, body: MessagesRequest, client: Optional[str]) -> RequestStream:
        """Queue a request (ApiError for anything refused)."""
        return await self.serving.chat_stream(to_chat(body), client)

    async def count_tokens(self, body: CountTokensRequest) -> dict:
        """`/v1/messages/count_tokens`: the prompt's tokens as the template renders them."""
        return {"input_tokens": await self.serving.count_chat_tokens(to_chat(body))}

    async def whole(self, body: MessagesRequest, stream: RequestStream) -> dict:
        a = await finished(stream)
        content: list[dict] = []
        if a.reasoning is not None:
            content.append({"type": "thinking", "thinking": a.reasoning, "signature": ""})
        if a.content:
            content.append({"type": "text", "text": a.content})
        content += [{"type": "tool_use", "id": _tool_id(), "name": c.name, "input": json.loads(c.arguments)}
                    for c in a.calls]
        return {**_message(stream, body.model), "content": content,
                "stop_reason": _stop_reason(a.finish, stream), "stop_sequence": stop_string(stream),
                "usage": _usage(stream, len(stream.token_ids))}

    async def events(self, body: MessagesRequest, stream: RequestStream) -> AsyncIterator[str]:
        """Anthropic's event stream: message_start, then each content block (start, deltas,
        stop), message_delta with the stop reason and usage, message_stop."""
        yield _event("message_start", {"type": "message_start", "message": {
            **_message(stream, body.model), "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": _usage(stream, 0)}})
        index, open_kind = -1, None  # the content block open now: "thinking" or "text"

        def close():
            return _event("content_block_stop", {"type": "content_block_stop", "index": index})

        async for piece in pieces(stream):
            if piece.kind in ("reasoning", "content"):
                kind = "thinking" if piece.kind == "reasoning" else "text"
                if open_kind != kind:
                    if open_kind is not None:
                        yield close()
                    index, open_kind = index + 1, kind
                    block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                        {"type": "text", "text": ""}
                    yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": block})
                delta = {"type": "thinking_delta", "thinking": piece.text} if kind == "thinking" else \
                    {"type": "text_delta", "text": piece.text}
                yield _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
            elif piece.kind == "calls":
                if open_kind is not None:
                    yield close()
                    open_kind = None
                for call in piece.calls:
                    index += 1
                    block = {"type": "tool_use", "id": _tool_id(), "name": call.name, "input": {}}
                    yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                         "content_block": block})
                    yield _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                        "type": "input_json_delta", "partial_json": call.arguments}})
                    yield close()
            elif piece.kind == "error":
                yield _event("error", error_body(piece.error))
                return
            else:  # end
                if open_kind is not None:
                    yield close()
                yield _event("message_delta", {"type": "message_delta", "delta": {
                    "stop_reason": _stop_reason(piece.finish, stream), "stop_sequence": stop_string(stream)},
                    "usage": {"output_tokens": len(stream.token_ids)}})
                yield _event("message_stop", {"type": "message_stop"})


def _message(stream: RequestStream, model: str) -> dict:
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model}


def _usage(stream: RequestStream, output_tokens: int) -> dict:
    prompt = len(stream.req.prompt_ids)
    return {"input_tokens": prompt, "output_tokens": output_tokens,
            "cache_read_input_tokens": min(prompt, stream.req.stats.cached_tokens)}


def _stop_reason(finish: Optional[str], stream: RequestStream) -> str:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    return "stop_sequence" if stop_string(stream) is not None else "end_turn"


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"
