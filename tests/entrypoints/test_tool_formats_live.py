"""The families' tool-call formats through the live chat endpoint (the official openai client):
the tiny model is made to write a DeepSeek V3.1, GLM-4.5 or MiniMax-M2 call (a regex constraint), with
tool_choice auto; the call comes back in tool_calls, streamed and not, and nothing of the
call's markup leaks into the streamed content."""

from __future__ import annotations

import json

import openai
import pytest

from live_app import KEY, NAME

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
WRITTEN = {
    "deepseek_v31": 'ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>\\{"city": "(Paris|Rome)", '
                    '"days": [1-9]\\}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "glm45": "ok\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>(Paris|Rome)</arg_value>\n"
             "<arg_key>days</arg_key>\n<arg_value>[1-9]</arg_value>\n</tool_call>",
    "minimax_m2": 'ok\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">(Paris|Rome)</parameter>\n'
                  '<parameter name="days">[1-9]</parameter>\n</invoke>\n</minimax:tool_call>',
}


@pytest.fixture(scope="module")
def client(thinking_server):
    return openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.mark.parametrize("family", sorted(WRITTEN))
def test_a_family_call_comes_back_as_tool_calls(client, family):
    ask = dict(model=NAME, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, temperature=0,
               max_tokens=200, extra_body={"guided_regex": WRITTEN[family]})
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Rome") and isinstance(args["days"], int)
    assert whole.message.content == "ok"
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **ask):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            calls[c.index] = (c.function.name, json.loads(c.function.arguments))
        finish = chunk.choices[0].finish_reason or finish
    assert content.strip() == "ok" and "<" not in content
    assert calls == {0: ("get_weather", args)} and finish == "tool_calls"
