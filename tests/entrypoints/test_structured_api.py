"""Structured output and tool calling through `specpipe serve` (SmolLM2, two stage processes,
specpipe-db with the n-gram draft, so the token masks cross the wire) and the `openai` client:

  * response_format json_schema / json_object on chat, guided_json / guided_regex / guided_grammar
    on completions: every output matches its constraint, and equals offline pp's tokens;
  * a forced tool call (named function, required) comes back as message.tool_calls, streamed and
    not, with arguments that validate against the function's parameters;
  * bad schemas, regexes, grammars, tools and tool_choice get a 400 naming the field;
  * a client that leaves a constrained stream frees the request's KV at every stage.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grammar"))
from constraints import ARRAYS, DATE, NESTED, SUM_GBNF, check_output  # noqa: E402
from test_openai_server import KEY, KV, NAME, Server, wait_kv_back  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "additionalProperties": False,
    "properties": {"zone": {"type": "string", "maxLength": 12}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2):
    from specpipe.loader.default_model import default_model_path

    s = Server(default_model_path(), "--stages", "2", "--mode", "specpipe-db", "--draft", "ngram", "--tree-width",
               "4", "--kv-memory", "64MiB", "--max-context", "1024", "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_response_format_json_schema_and_object(client):
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Give a person's name and address as JSON."}],
        temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": NESTED, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), NESTED)
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "A JSON object, please."}],
                                       temperature=0, max_tokens=64, response_format={"type": "json_object"})
    text = r.choices[0].message.content  # free strings: SmolLM2 may run to max_tokens inside one
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_guided_extras_on_completions_equal_offline_pp(client, smollm2):
    from specpipe import LLM, SamplingParams
    from specpipe.grammar import StructuredOutput

    cases = [("arrays", {"guided_json": ARRAYS}, StructuredOutput(json_schema=ARRAYS)),
             ("regex", {"guided_regex": DATE}, StructuredOutput(regex=DATE)),
             ("grammar", {"guided_grammar": SUM_GBNF}, StructuredOutput(grammar=SUM_GBNF))]
    prompt = "Answer: "
    got = []
    for name, extra, _ in cases:
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=48, temperature=0, extra_body=extra)
        check_output(name, r.choices[0].text)
        got.append(r.choices[0].text)
    with LLM(transport="inproc") as llm:
        ref = llm.generate([prompt] * 3, [SamplingParams(max_tokens=48, structured=c) for *_, c in cases],
                           use_tqdm=False, chat=False)
    assert [o.text for o in ref] == got


def _check_call(call, name="get_weather", params=WEATHER):
    assert call.type == "function" and call.function.name == name and call.id
    jsonschema.validate(json.loads(call.function.arguments), params["function"]["parameters"])


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_call(client, choice):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER, TIME], tool_choice=choice,
                                       temperature=0, max_tokens=64)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    _check_call(call, call.function.name, WEATHER if call.function.name == "get_weather" else TIME)


def test_forced_tool_call_streamed(client):
    with client.beta.chat.completions.stream(model=NAME, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=64,
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}}
                                             ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    c = final.choices[0]
    assert c.finish_reason == "tool_calls"
    _check_call(c.message.tool_calls[0])
    # the raw chunks, too: one tool_calls delta carrying index, id, name and arguments
    chunks = list(client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], temperature=0,
                                                 max_tokens=64, tool_choice="required", stream=True))
    deltas = [tc for ch in chunks for choice in ch.choices for tc in (choice.delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_gives_text(client):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=[WEATHER], tool_choice="none", temperature=0,
                                       max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


BAD = [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                  "schema": {"type": "objectx"}}}}, "response_format", "objectx"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ("/v1/completions", {"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ("/v1/completions", {"guided_grammar": "root ::= undefined_rule"}, "guided_grammar", "undefined_rule"),
    ("/v1/completions", {"guided_regex": "a", "guided_json": {"type": "object"}}, "guided_regex", "one output"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.0.function.name", "required"),
    ("/v1/chat/completions", {"tools": [WEATHER, WEATHER]}, "tools", "used twice"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "no tools"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters":
                                         {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
                              "tool_choice": "required"}, "tool_choice", "nonsense"),
]


@pytest.mark.parametrize("path,extra,param,words", BAD)
def test_bad_constraints_are_400_naming_the_field(server, path, extra, param, words):
    body = {"model": NAME, "max_tokens": 4, **extra}
    body.update({"messages": ASK} if "chat" in path else {"prompt": "hi"})
    r = server.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_disconnect_mid_constrained_stream_frees_the_kv(server):
    before = server.metrics()
    body = {"model": NAME, "prompt": "Count:", "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True, "guided_regex": "([0-9]+ )+"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(10)]
        assert any(line.startswith("data: {") for line in got)
        during = server.metrics()
        deadline = time.monotonic() + 10
        while not all(during[k] > before[k] for k in KV):
            assert time.monotonic() < deadline
            time.sleep(0.2)
            during = server.metrics()
    wait_kv_back(server, before, KV)


def test_ended_request_frees_its_matcher(smollm2):
    from specpipe.engine.prompts import PromptProcessor
    from specpipe.grammar import StructuredOutput
    from specpipe.loader.default_model import default_model_path
    from specpipe.sampling import SamplingParams
    from specpipe.tokenizer.tokenizer import Tokenizer

    pp = PromptProcessor(Tokenizer.from_path(default_model_path()), 49152, 1024)
    for end in ("abort", "keep", "complete"):
        req = pp.make_request([1, 2, 3], SamplingParams(max_tokens=8, structured=StructuredOutput(regex="ab")))
        assert req.grammar is not None and not req.grammar.closed
        if end == "abort":
            req.end("abort")
        elif end == "keep":
            req.keep(0)
        else:
            for t in pp.tokenizer.encode("ab", add_special_tokens=False):
                req.append(t)
            assert req.finish_reason == "stop"
        assert req.grammar.closed, end


def test_auto_tools_stream_equals_whole_answer(client):
    """tool_choice auto: whatever the model writes (text or a call), streamed content plus
    assembled calls equal the whole response's, and text streams in more than one piece when
    it holds no call."""
    kw = dict(model=NAME, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=40)
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert (whole.message.content or "") == content
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []] == \
        [(c.function.name, c.function.arguments) for c in calls]
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    if not calls and len(content) > 20:
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1


def test_a_second_turn_with_the_call_and_its_result(client):
    """The assistant's call and the tool's answer go back through the template (SmolLM2's
    cannot render tools: they ride in a system message) and the model answers."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=8)
    assert r.choices[0].message.content


@pytest.mark.parametrize("extra", [{"tool_choice": {"type": "function", "function": "get_weather"}},
                                   {"tool_choice": "sometimes"},
                                   {"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]}])
def test_malformed_tool_fields_are_400(server, extra):
    body = {"model": NAME, "max_tokens": 4, "messages": ASK, "tools": [WEATHER], **extra}
    r = server.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
