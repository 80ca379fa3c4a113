"""The Anthropic and Responses dialects' answers and event streams built from a recorded answer
that reasons and then calls a tool in GLM-4.5's format (the live tests' tiny model cannot be made
to reason through those APIs), fed in awkward pieces. Every answer and event must validate as
the official clients' own types, and the events must build the same answer as the whole form."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import anthropic
import openai
import pytest
from pydantic import TypeAdapter

from specpipe.engine.async_engine import Delta
from specpipe.entrypoints.openai.anthropic_api import AnthropicServing, MessagesRequest
from specpipe.entrypoints.openai.reasoning import ReasoningSplitter
from specpipe.entrypoints.openai.responses_api import ResponsesRequest, ResponsesServing

ANSWER = ("<think>The user wants the weather.</think>\n\nLet me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
          "<arg_value>Paris</arg_value>\n</tool_call>")
FUNCS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}


class RecordedStream:
    """A RequestStream's surface, replaying `text` in pieces of `size` characters."""

    def __init__(self, text: str, size: int) -> None:
        self.pieces = [text[i:i + size] for i in range(0, len(text), size)]
        self.text, self.token_ids, self.finish_reason, self.error = "", [], None, None
        self.req = SimpleNamespace(prompt_ids=[1, 2, 3], stats=SimpleNamespace(cached_tokens=0),
                                   output=SimpleNamespace(stop_string=None))
        self.reasoning, self.tool_funcs, self.fenced_calls = ReasoningSplitter(), FUNCS, True

    def __aiter__(self):
        return self._replay()

    async def _replay(self):
        for i, piece in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            self.text, self.token_ids = self.text + piece, self.token_ids + [i]
            self.finish_reason = "stop" if last else None
            yield Delta(piece, [i], self.finish_reason)

    def cancel(self) -> None:
        pass


def _events(gen) -> list[tuple[str, dict]]:
    async def collect():
        return [e async for e in gen]

    out = []
    for raw in asyncio.run(collect()):
        name, data = raw.strip().split("\n", 1)
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_anthropic_thinking_text_and_tool_use(size):
    body = MessagesRequest(model="m", max_tokens=64, messages=[{"role": "user", "content": "weather?"}])
    serving = AnthropicServing(None)
    whole = asyncio.run(serving.whole(body, RecordedStream(ANSWER, size)))
    msg = anthropic.types.Message.model_validate(whole)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "The user wants the weather." and msg.content[1].text == "Let me check."
    assert (msg.content[2].name, msg.content[2].input, msg.stop_reason) == ("get_weather", {"city": "Paris"}, "tool_use")
    events = _events(serving.events(body, RecordedStream(ANSWER, size)))
    adapter = TypeAdapter(anthropic.types.RawMessageStreamEvent)
    for name, data in events:
        assert adapter.validate_python(data).type == name
    blocks: dict[int, dict] = {}
    for name, data in events:
        if name == "content_block_start":
            blocks[data["index"]] = dict(data["content_block"], partial="")
        elif name == "content_block_delta":
            d = data["delta"]
            blocks[data["index"]]["partial"] += d.get("thinking", d.get("text", d.get("partial_json", "")))
    assert [(b["type"], b["partial"]) for b in blocks.values()] == [
        ("thinking", "The user wants the weather."), ("text", "Let me check.\n"), ("tool_use", '{"city": "Paris"}')]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_responses_reasoning_message_and_function_call(size):
    body = ResponsesRequest(model="m", input="weather?")
    serving = ResponsesServing(None)
    whole = openai.types.responses.Response.model_validate(asyncio.run(serving.whole(body, RecordedStream(ANSWER, size))))
    assert [o.type for o in whole.output] == ["reasoning", "message", "function_call"]
    assert whole.output[0].content[0].text == "The user wants the weather." and whole.output_text == "Let me check."
    assert (whole.output[2].name, json.loads(whole.output[2].arguments)) == ("get_weather", {"city": "Paris"})
    events = _events(serving.events(body, RecordedStream(ANSWER, size)))
    adapter = TypeAdapter(openai.types.responses.ResponseStreamEvent)
    for name, data in events:
        assert adapter.validate_python(data).type == name
    reasoning = "".join(d["delta"] for n, d in events if n == "response.reasoning_text.delta")
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert (reasoning, text) == ("The user wants the weather.", "Let me check.\n")
    final = openai.types.responses.Response.model_validate(events[-1][1]["response"])
    assert events[-1][0] == "response.completed" and [o.type for o in final.output] == [o.type for o in whole.output]
    assert final.output[2].arguments == whole.output[2].arguments
