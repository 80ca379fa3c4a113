"""OpenAI's Responses API (`POST /v1/responses`) on the chat engine: the body becomes a chat
completion request (same template, sampling, constraints, tool parsing), the answer becomes a
Response object (output items) or its event stream.

    input (text, or message / function_call / function_call_output items), instructions, tools,
    tool_choice, text.format --to_chat--> ChatCompletionRequest --chat_stream--> RequestStream
        --answer_stream--> output: [reasoning] [message (output_text)] [function_call ...]

Events: response.created, response.in_progress, then per output item output_item.added,
content_part.added, output_text.delta / reasoning_text.delta (function_call_arguments.delta
for a call), their .done, output_item.done; last response.completed (response.incomplete when
max_output_tokens cut it). Errors have OpenAI's shape. The server keeps no responses, so
`previous_response_id` is refused (send the whole conversation as input); `store` is ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, AsyncIterator, Literal, Optional, Union

from pydantic import Field, StrictBool, ValidationError

from specpipe.engine.async_engine import RequestStream
from specpipe.entrypoints.openai import protocol as p
from specpipe.entrypoints.openai.answer_stream import Answer, finished, pieces
from specpipe.entrypoints.openai.serving import ApiError, OpenAIServing
from specpipe.sampling import MAX_TOKENS


class InputText(p.OpenAIModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(p.OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[str, list[InputText]]


class FunctionCallItem(p.OpenAIModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(p.OpenAIModel):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[InputText]]


class ReasoningItem(p.OpenAIModel):  # an earlier answer's reasoning, sent back: not shown to the template
    type: Literal["reasoning"]


Item = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]


class FunctionTool(p.OpenAIModel):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict] = None
    strict: Optional[StrictBool] = None


class FunctionChoice(p.OpenAIModel):
    type: Literal["function"]
    name: str


class TextFormat(p.OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(default=None, max_length=64)
    schema_: Optional[dict] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None
    description: Optional[str] = None


class TextConfig(p.OpenAIModel):
    format: Optional[TextFormat] = None


class ReasoningConfig(p.OpenAIModel):
    effort: Optional[Literal["low", "medium", "high"]] = None  # the chat's reasoning_effort (gpt-oss reads it)


class ResponsesRequest(p.OpenAIModel):
    model: str = Field(max_length=256)
    input: Union[Annotated[str, Field(min_length=1)], Annotated[list[Item], Field(min_length=1, json_schema_extra={
        "contains": {"not": {"required": ["type"], "properties": {"type": {"const": "reasoning"}}}}})]]
    instructions: Optional[str] = None
    tools: Optional[Annotated[list[FunctionTool], Field(max_length=p.MAX_TOOLS)]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], FunctionChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    text: Optional[TextConfig] = None
    max_output_tokens: Optional[p.Num(int, ge=1, le=MAX_TOKENS)] = None
    temperature: p.Num(float, ge=0.0, le=2.0) = 1.0
    top_p: p.Num(float, gt=0.0, le=1.0) = 1.0
    stream: StrictBool = False
    store: Optional[StrictBool] = None  # ignored: nothing is kept
    previous_response_id: Optional[str] = p.Only(None, {"enum": [None]})  # refused: nothing is kept
    metadata: Optional[dict[str, str]] = None  # returned as given
    reasoning: Optional[ReasoningConfig] = None


def to_chat(body: ResponsesRequest) -> p.ChatCompletionRequest:
    if body.previous_response_id is not None:
        raise ApiError(400, "previous_response_id is not supported: this server keeps no responses; send the "
                            "whole conversation as input", param="previous_response_id", code="unsupported_parameter")
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    for item in [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):  # calls in a row belong to one assistant turn
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    if not messages:
        raise ApiError(400, "input holds nothing but reasoning items", param="input")
    chat: dict[str, Any] = dict(model=body.model, messages=messages, temperature=body.temperature, top_p=body.top_p,
                                max_tokens=body.max_output_tokens, parallel_tool_calls=body.parallel_tool_calls,
                                reasoning_effort=body.reasoning.effort if body.reasoning else None)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in body.tools]
    if isinstance(body.tool_choice, FunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise ApiError(400, "text.format json_schema needs a schema", param="text.format.schema")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    try:
        return p.ChatCompletionRequest.model_validate(chat)
    except ValidationError as e:
        first = e.errors()[0]
        raise ApiError(400, f"{'.'.join(map(str, first.get('loc', ())))}: {first.get('msg')}") from None


def _text(v: Union[str, list[InputText]]) -> str:
    return v if isinstance(v, str) else "".join(part.text for part in v)


class ResponsesServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def start(self, body: ResponsesRequest, client: Optional[str]) -> RequestStream:
        return await self.serving.chat_stream(to_chat(body), client)

    async def whole(self, body: ResponsesRequest, stream: RequestStream) -> dict:
        a = await finished(stream)
        return _response(body, stream, _items(a), a.finish)

    async def events(self, body: ResponsesRequest, stream: RequestStream) -> AsyncIterator[str]:
        out = _Events(body, stream)
        yield out.event("response.created", response=_response(body, stream, [], None))
        yield out.event("response.in_progress", response=_response(body, stream, [], None))
        async for piece in pieces(stream):
            if piece.kind in ("reasoning", "content"):
                for e in out.text(piece.kind, piece.text):
                    yield e
            elif piece.kind == "calls":
                for e in out.close():
                    yield e
                for call in piece.calls:
                    for e in out.call(call):
                        yield e
            elif piece.kind == "error":
                err = piece.error.body.error
                yield out.event("error", code=err.code, message=err.message, param=err.param)
                return
            else:
                for e in out.close():
                    yield e
                final = _response(body, stream, out.items, piece.finish)
                yield out.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                                response=final)


class _Events:
    """The stream's events, numbered, and the output items they build."""

    def __init__(self, body: ResponsesRequest, stream: RequestStream) -> None:
        self.seq = 0
        self.items: list[dict] = []  # done
        self.open: Optional[dict] = None  # the reasoning or message item being written

    def event(self, kind: str, **data) -> str:
        data = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def text(self, kind: str, text: str):
        item_kind = "reasoning" if kind == "reasoning" else "message"
        if self.open is None or self.open["type"] != item_kind:
            yield from self.close()
            self.open = _reasoning_item("") if item_kind == "reasoning" else _message_item("")
            self.open["status"] = "in_progress"
            where = dict(output_index=len(self.items))
            yield self.event("response.output_item.added", item=self.open, **where)
            part = self.open["content"][0]
            yield self.event("response.content_part.added", item_id=self.open["id"], content_index=0,
                             part=part, **where)
        part = self.open["content"][0]
        part["text"] += text
        where = dict(item_id=self.open["id"], output_index=len(self.items), content_index=0)
        if item_kind == "reasoning":
            yield self.event("response.reasoning_text.delta", delta=text, **where)
        else:
            yield self.event("response.output_text.delta", delta=text, logprobs=[], **where)

    def close(self):
        if self.open is None:
            return
        item, self.open = self.open, None
        item["status"] = "completed"
        part = item["content"][0]
        where = dict(item_id=item["id"], output_index=len(self.items), content_index=0)
        if item["type"] == "reasoning":
            yield self.event("response.reasoning_text.done", text=part["text"], **where)
        else:
            yield self.event("response.output_text.done", text=part["text"], logprobs=[], **where)
        yield self.event("response.content_part.done", part=part, **where)
        yield self.event("response.output_item.done", item=item, output_index=len(self.items))
        self.items.append(item)

    def call(self, call):
        item = _call_item(call)
        where = dict(output_index=len(self.items))
        yield self.event("response.output_item.added", item={**item, "arguments": "", "status": "in_progress"}, **where)
        yield self.event("response.function_call_arguments.delta", item_id=item["id"], delta=call.arguments, **where)
        yield self.event("response.function_call_arguments.done", item_id=item["id"], name=call.name,
                         arguments=call.arguments, **where)
        yield self.event("response.output_item.done", item=item, **where)
        self.items.append(item)


def _items(a: Answer) -> list[dict]:
    out = [_reasoning_item(a.reasoning)] if a.reasoning is not None else []
    if a.content:
        out.append(_message_item(a.content))
    return out + [_call_item(c) for c in a.calls]


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _message_item(text: str) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}


def _response(body: ResponsesRequest, stream: RequestStream, output: list[dict], finish: Optional[str]) -> dict:
    """The Response object; `finish` None while it is being written."""
    status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
    prompt, made = len(stream.req.prompt_ids), len(stream.token_ids)
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else \
        {"type": "text"}
    return {
        "id": getattr(stream, "response_id", None) or _name(stream), "object": "response",
        "created_at": getattr(stream, "response_created", None) or time.time(), "status": status,
        "model": body.model, "output": output, "instructions": body.instructions, "metadata": body.metadata or {},
        "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionChoice)
        else body.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
        "text": {"format": fmt},
        "usage": None if finish is None else {
            "input_tokens": prompt, "output_tokens": made, "total_tokens": prompt + made,
            "input_tokens_details": {"cached_tokens": min(prompt, stream.req.stats.cached_tokens),
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}},
    }


def _name(stream: RequestStream) -> str:
    """One id and creation time for all of a response's events."""
    stream.response_id, stream.response_created = f"resp_{uuid.uuid4().hex}", time.time()
    return stream.response_id
