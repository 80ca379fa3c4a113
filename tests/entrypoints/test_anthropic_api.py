"""Anthropic's Messages API (`/v1/messages`, anthropic_api.py) with the official `anthropic`
client, on the same engine as chat completions (in process, live uvicorn):

  * a message equals the chat answer to the same conversation (greedy), streamed and not;
  * stop_sequences end it with stop_reason stop_sequence and the string;
  * output_config's JSON schema constrains the text;
  * a tool-use round trip: a forced tool (tool_choice tool) gives a tool_use block that matches
    the schema, streamed and not; its tool_result goes back and the model answers;
  * errors come in Anthropic's shape; the key is read from x-api-key (the client's default) or
    a bearer token, and a wrong one is an authentication_error.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from live_app import KEY, NAME

SYSTEM = "You are terse."
GREEDY = {"temperature": 0}  # the current client no longer takes it as an argument
ASK = [{"role": "user", "content": "the cat sat on the"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                            "required": ["city"]}}


@pytest.fixture(scope="module")
def server(thinking_server):
    return thinking_server


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _chat(server, **kw):
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    return oa.chat.completions.create(model=NAME, extra_body=GREEDY, **kw)


def test_a_message_is_the_chat_answer_streamed_and_not(server, client):
    msg = client.messages.create(model=NAME, system=SYSTEM, messages=ASK, max_tokens=12, extra_body=GREEDY)
    chat = _chat(server, messages=[{"role": "system", "content": SYSTEM}, *ASK], max_tokens=12)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == NAME
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                 chat.usage.completion_tokens)
    kinds = []
    with client.messages.stream(model=NAME, system=SYSTEM, messages=ASK, max_tokens=12, extra_body=GREEDY) as s:
        for event in s:
            kinds.append(event.type)
        final = s.get_final_message()
    assert final.content[0].text == msg.content[0].text and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)


def test_stop_sequences(client):
    text = client.messages.create(model=NAME, messages=ASK, max_tokens=16, extra_body=GREEDY).content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text  # the tiny model writes something to cut
    msg = client.messages.create(model=NAME, messages=ASK, max_tokens=16, extra_body=GREEDY,
                                 stop_sequences=[stop, "zzzz"])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]


def test_tool_use_round_trip(server, client):
    msg = client.messages.create(model=NAME, messages=[{"role": "user", "content": "weather in Paris?"}],
                                 max_tokens=120, extra_body=GREEDY, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "tool_use", msg
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Paris", "Rome") and use.id.startswith("toolu_")
    with client.messages.stream(model=NAME, messages=[{"role": "user", "content": "weather in Paris?"}],
                                max_tokens=120, extra_body=GREEDY, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:
        streamed = s.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(use.name, use.input)]
    assert streamed.stop_reason == "tool_use"
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"},
                                            {"type": "text", "text": "so?"}]}]
    answer = client.messages.create(model=NAME, messages=history, max_tokens=8, extra_body=GREEDY, tools=[WEATHER],
                                    tool_choice={"type": "none"})
    assert answer.stop_reason in ("end_turn", "max_tokens") and [b.type for b in answer.content] == ["text"]
    # The same conversation in chat's terms: the call as tool_calls, its result as a tool message.
    chat = _chat(server, max_tokens=8, messages=[
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"}, {"role": "user", "content": "so?"}])
    assert answer.content[0].text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


def test_output_config_json_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    msg = client.messages.create(model=NAME, messages=ASK, max_tokens=20, extra_body=GREEDY,
                                 output_config={"format": {"type": "json_schema", "schema": schema}})
    assert isinstance(json.loads(msg.content[0].text)["n"], int), msg


def test_thinking_disabled_reaches_the_template(client):
    on = client.messages.create(model=NAME, messages=ASK, max_tokens=2,
                                thinking={"type": "enabled", "budget_tokens": 1024})
    off = client.messages.create(model=NAME, messages=ASK, max_tokens=2, thinking={"type": "disabled"})
    assert off.usage.input_tokens > on.usage.input_tokens  # the template wrote an empty <think></think>


def test_errors_have_anthropics_shape_and_the_key_is_checked(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=NAME, messages=ASK, max_tokens=0)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="nope", messages=ASK, max_tokens=4)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):  # images are not served
        client.messages.create(model=NAME, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=NAME, messages=ASK, max_tokens=4)
    assert e.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=NAME, messages=ASK, max_tokens=2).usage.output_tokens >= 1
    r = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": KEY}, content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_count_tokens_is_the_prompt_a_message_would_have(client):
    kw = dict(model=NAME, system=SYSTEM, messages=ASK, tools=[WEATHER])
    counted = client.messages.count_tokens(**kw).input_tokens
    sent = client.messages.create(max_tokens=2, extra_body=GREEDY, **kw).usage.input_tokens
    assert counted == sent > client.messages.count_tokens(model=NAME, messages=ASK).input_tokens
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=ASK)
