"""OpenAI's Responses API (`/v1/responses`, responses_api.py) with the official `openai` client, on
the same engine as chat completions (in process, live uvicorn):

  * text input and item input with instructions give the chat answer to the same conversation
    (greedy), whole and streamed (deltas join to the text; numbered events, completed last);
  * function tools: a forced call is a function_call item (streamed and not), and its
    function_call_output goes back as a tool message;
  * text.format json_schema constrains the text; previous_response_id is refused (nothing is kept).
"""

from __future__ import annotations

import json

import openai
import pytest

from live_app import KEY, NAME

ASK = "the cat sat on the"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}

NUMBER = {"format": {"type": "json_schema", "name": "num", "strict": True, "schema": {
    "type": "object", "properties": {"n": {"type": "integer", "maximum": 999}}, "required": ["n"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(thinking_server):
    return openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=NAME, messages=messages, temperature=0, **kw)


def test_text_and_items_give_the_chat_answer(client):
    r = client.responses.create(model=NAME, input=ASK, max_output_tokens=12, temperature=0)
    chat = _chat(client, [{"role": "user", "content": ASK}], max_tokens=12)
    assert r.object == "response" and r.output_text == chat.choices[0].message.content
    assert r.status == {"length": "incomplete", "stop": "completed"}[chat.choices[0].finish_reason]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    r = client.responses.create(model=NAME, instructions="Be terse.", max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]}])
    chat = _chat(client, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": ASK}], max_tokens=12)
    assert r.output_text == chat.choices[0].message.content


def test_streamed_events_build_the_same_response(client):
    whole = client.responses.create(model=NAME, input=ASK, max_output_tokens=12, temperature=0)
    events = list(client.responses.create(model=NAME, input=ASK, max_output_tokens=12, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    kinds = {e.type for e in events}
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.done",
            "response.output_item.done"} <= kinds
    # The client's stream helper wants response.completed (a cut answer ends in response.incomplete,
    # as OpenAI's does): a JSON schema makes the answer end by itself.
    done = dict(model=NAME, input=ASK, max_output_tokens=40, temperature=0, text=NUMBER)
    with client.responses.stream(**done) as s:
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text == client.responses.create(**done).output_text


def test_function_call_round_trip(client):
    ask = [{"role": "user", "content": "weather in Paris?"}]
    forced = dict(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                  max_output_tokens=120)
    r = client.responses.create(model=NAME, input=ask, **forced)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    events = list(client.responses.create(model=NAME, input=ask, stream=True, **forced))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [json.loads(call.arguments)]
    follow = client.responses.create(model=NAME, temperature=0, max_output_tokens=8, tools=[WEATHER], input=[
        *ask, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    chat = _chat(client, [*ask, {"role": "assistant", "content": "", "tool_calls": [{
        "id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}], max_tokens=8,
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}])
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == (chat.choices[0].message.content or "")


def test_text_format_json_schema_and_refusals(client):
    r = client.responses.create(model=NAME, input=ASK, max_output_tokens=40, temperature=0, text=NUMBER)
    assert isinstance(json.loads(r.output_text)["n"], int)
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model=NAME, input=ASK, previous_response_id="resp_1")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input=ASK)
