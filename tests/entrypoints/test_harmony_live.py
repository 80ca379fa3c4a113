"""Harmony through the live chat endpoint (the official openai client), over the tiny model with a
gpt-oss tokenizer and template (harmony_model.py). The model is made to write Harmony channels with
a Lark grammar (guided_grammar: the markup is special tokens, which a regex cannot name); the
answer's analysis comes back as reasoning_content, its final channel as content, a commentary call
as tool_calls, whole and streamed; the call goes round (the assistant's reasoning and call and
the tool's result rendered into the next prompt as the template asks); a forced call and a JSON
schema constrain the call or the final channel, not the reasoning; reasoning_effort reaches the
template."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from harmony_model import harmony_model
from live_app import KEY, NAME, LiveServer, engine_of
from specpipe.entrypoints.openai.harmony import template_messages
from specpipe.entrypoints.openai.protocol import ChatCompletionRequest

ANALYSIS = '<|channel|> "analysis" <|message|> R <|end|> <|start|> "assistant" '
FINAL = "%llguidance {}\nstart: " + ANALYSIS + '<|channel|> "final" <|message|> C\nR: /[a-z ]{4,12}/\nC: /[a-z]{2,6}/\n'
CALL = ("%llguidance {}\nstart: " + ANALYSIS + '<|channel|> "commentary to=functions.get_weather " <|constrain|> '
        '"json" <|message|> ARGS\nR: /[a-z ]{4,12}/\nARGS: /\\{"city":"(Paris|Rome)"\\}/\n')
WEATHER = {"type": "object", "required": ["city"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "maxLength": 8}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "weather in paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    engine = engine_of(harmony_model(tiny_model_dir, tmp_path_factory.mktemp("harmony")))
    s = LiveServer(engine)
    s.engine = engine
    yield s
    s.stop()
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _ask(client, grammar=None, messages=ASK, **kw):
    extra = {"guided_grammar": grammar} if grammar else {}
    return client.chat.completions.create(model=NAME, messages=messages, max_tokens=120, temperature=0,
                                          extra_body={**extra, **kw.pop("extra_body", {})}, **kw)


def _streamed(chunks):
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for c in delta.tool_calls or []:
            calls[c.index] = (c.function.name, json.loads(c.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    assert "<|" not in reasoning + content
    return reasoning, content, calls, finish


def test_analysis_is_reasoning_and_final_is_content(client):
    for kw in ({}, {"tools": TOOLS}):  # the plain stream and the tool stream read the channels alike
        choice = _ask(client, FINAL, **kw).choices[0]
        msg = choice.message
        assert choice.finish_reason == "stop" and msg.content and msg.reasoning_content, msg
        assert "<|" not in msg.content + msg.reasoning_content and msg.content.isalpha() and not msg.tool_calls
        assert _streamed(_ask(client, FINAL, stream=True, **kw)) == (msg.reasoning_content, msg.content, {}, "stop")


def test_a_call_comes_back_and_goes_round(client, server):
    whole = _ask(client, CALL, tools=TOOLS).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
    (call,) = whole.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Rome")
    reasoning, content, calls, finish = _streamed(_ask(client, CALL, tools=TOOLS, stream=True))
    assert (reasoning, content, calls, finish) == (whole.message.reasoning_content, "", {0: ("get_weather", args)},
                                                   "tool_calls")
    # the next turn: the assistant's reasoning and call, and the tool's result, in the template's places
    turn = [*ASK, {"role": "assistant", "content": None, "reasoning_content": whole.message.reasoning_content,
                   "tool_calls": [call.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    second = _ask(client, FINAL, messages=turn, tools=TOOLS)
    assert second.choices[0].message.content
    body = ChatCompletionRequest(model=NAME, messages=turn, tools=TOOLS)
    text = _template(server).apply_chat_template(template_messages(body.conversation()), tools=TOOLS)
    assert (f"<|channel|>analysis<|message|>{whole.message.reasoning_content}<|end|>"
            f"<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            f'{json.dumps(args)}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary'
            '<|message|>"sunny"<|end|><|start|>assistant') in text
    assert second.usage.prompt_tokens == len(_template(server).encode(text, add_special_tokens=False))


def _template(server):
    return server.engine.tokenizer


def test_forced_call_and_json_schema_hold_the_answer_not_the_reasoning(client, server):
    end = _template(server).token_to_id("<|end|>")
    bias = {str(end): 100}  # the reasoning may be any length: make the tiny model end it soon
    forced = _ask(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  logit_bias=bias).choices[0]
    assert forced.finish_reason == "tool_calls", forced
    (call,) = forced.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    answer = _ask(client, logit_bias=bias, response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}).choices[0]
    assert answer.finish_reason == "stop", answer
    jsonschema.validate(json.loads(answer.message.content), schema)


def test_reasoning_effort_reaches_the_template(client):
    low = _ask(client, FINAL, reasoning_effort="low").usage.prompt_tokens
    high = _ask(client, FINAL, reasoning_effort="high").usage.prompt_tokens
    by_kwargs = _ask(client, FINAL, extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}}).usage
    assert high == low + 1 == by_kwargs.prompt_tokens  # "high" is one byte-level token longer than "low"
    effort = [client.responses.create(model=NAME, input=ASK[0]["content"], max_output_tokens=4, temperature=0,
                                      reasoning={"effort": e}).usage.input_tokens for e in ("low", "high")]
    assert effort == [low, high]  # the Responses API's reasoning.effort is the same field
