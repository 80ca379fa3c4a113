"""Issue 62's API surface, in process (the app on a real uvicorn in a thread, two in-process
stages, specpipe-db with an n-gram source), with the official `openai` client where it speaks it:

  * /tokenize and /detokenize in vLLM's shapes (prompt or chat messages; the ids round-trip);
  * /v1/models lists every --served-model-name, each with vLLM's fields, and each is served;
  * stop strings: many of them work (the old limit was 4); every refusal names its real cause;
  * tool_choice auto: a call written as a ```json fenced block is a tool call, streamed and not
    (the tiny model is made to write one with a regex constraint); --strict-tool-calls keeps it text.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from specpipe.config import EngineConfig
from specpipe.engine.engine import Engine
from specpipe.entrypoints.openai.api_server import ServerOptions
from specpipe.entrypoints.openai.tools import parse_tool_calls

import live_app

NAMES = ("tiny", "tiny-alias")
KEY = live_app.KEY


class LiveServer(live_app.LiveServer):
    """build_app on uvicorn in a background thread, on a free loopback port, serving NAMES."""

    def __init__(self, engine: Engine, options: ServerOptions) -> None:
        super().__init__(engine, options, NAMES)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def post(self, path: str, key: str = KEY, **kw) -> httpx.Response:
        return httpx.post(self.url + path, headers={"Authorization": f"Bearer {key}"}, timeout=120, **kw)


def _engine(tiny_model_dir) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model_dir("llama", num_hidden_layers=2, max_position_embeddings=1024)),
                               mode="specpipe-db", draft="ngram", stages=2, transport="inproc", kv_memory="8MiB",
                               max_context=1024))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    e = _engine(tiny_model_dir)
    yield e
    e.close()


@pytest.fixture(scope="module")
def alone(tiny_model_dir):
    """The same engine again, for reference runs: the server's engine core owns its stages, and a
    second core on them would reuse its request ids (which the stages now refuse)."""
    e = _engine(tiny_model_dir)
    yield e
    e.close()


@pytest.fixture(scope="module")
def server(engine):
    s = LiveServer(engine, ServerOptions(api_keys=(KEY,)))
    yield s
    s.stop()


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# -- /tokenize, /detokenize ------------------------------------------------------------------------

def test_tokenize_and_detokenize_in_vllms_shapes(server, engine):
    text = "the cat sat on the mat"
    r = server.post("/tokenize", json={"model": NAMES[0], "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == engine.tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == engine.max_context
    assert "token_strs" not in body
    strs = server.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert "".join(strs) == text
    back = server.post("/detokenize", json={"model": NAMES[1], "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}

    messages = [{"role": "user", "content": "hi"}]
    chat = server.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == engine.prompts.encode_chat(messages)  # exactly the prompt a chat request runs
    without = server.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < chat["count"] and chat["tokens"][:without["count"]] == without["tokens"]


def test_tokenize_refusals_name_the_cause(server, engine):
    assert error_of(server.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]}),
                    400)["param"] == "prompt"
    assert error_of(server.post("/tokenize", json={"model": "other", "prompt": "a"}), 404)["code"] == "model_not_found"
    e = error_of(server.post("/detokenize", json={"tokens": [engine.prompts.vocab_size]}), 400)
    assert e["param"] == "tokens" and "vocabulary" in e["message"]
    assert error_of(server.post("/detokenize", key="wrong", json={"tokens": [1]}), 401)["code"] == "invalid_api_key"


# -- /v1/models and served names -----------------------------------------------------------------------

def test_models_lists_every_served_name_and_each_is_served(server, engine):
    client = server.client()
    cards = client.models.list().data
    assert [c.id for c in cards] == list(NAMES)
    for c in cards:
        d = c.model_dump()
        assert d["object"] == "model" and d["owned_by"] == "specpipe" and isinstance(d["created"], int)
        assert d["root"] == str(engine.model_path) and d["max_model_len"] == engine.max_context
    for name in NAMES:  # each name works, and the response names the model as the request did
        r = client.completions.create(model=name, prompt="hello", max_tokens=2, temperature=0)
        assert r.model == name
    with pytest.raises(openai.NotFoundError, match="tiny-alias"):
        client.completions.create(model="nope", prompt="hello", max_tokens=2)


# -- stop strings -------------------------------------------------------------------------------------

def test_many_stop_strings_work(server):
    client = server.client()
    free = client.completions.create(model=NAMES[0], prompt="the cat sat", max_tokens=24, temperature=0).choices[0]
    text = free.text
    assert len(text) > 4
    stop = text[3:5]  # a stop string the greedy output holds: the answer ends just before it
    stops = [f"never-{i}" for i in range(40)] + [stop]
    r = client.completions.create(model=NAMES[0], prompt="the cat sat", max_tokens=24, temperature=0, stop=stops)
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=NAMES[0], prompt="the cat sat", max_tokens=24, temperature=0,
                                       stop=stops, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


@pytest.mark.parametrize("stop, says", [
    ([1, "a"], "stop[0] must be a string"),
    (["a", ""], "stop[1] is empty"),
    (["s" * 1025], "stop[0] has 1025 characters"),
    (["s"] * 1025, "1025 stop strings"),
    (["s" * 1000] * 17, "17000 characters in all"),
])
def test_stop_refusals_name_the_real_cause(server, stop, says):
    e = error_of(server.post("/v1/completions", json={"model": NAMES[0], "prompt": "a", "stop": stop}), 400)
    assert e["param"] == "stop" and says in e["message"] and "constrained-str" not in e["message"], e


# -- fenced tool calls ----------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FENCED = 'Let me check.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'
FENCED_REGEX = r'Let me check\.\n```json\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n```'


def test_fenced_call_parsing():
    funcs = {"get_weather": {}}
    content, calls = parse_tool_calls(FENCED + "\nDone.", funcs)
    assert content == "Let me check.\n\nDone." and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    code = "```python\nprint(1)\n```"
    assert parse_tool_calls(code, funcs) == (code, [])  # code stays content
    other = FENCED.replace("get_weather", "get_time")  # not an offered function
    assert parse_tool_calls(other, funcs) == (other, [])
    assert parse_tool_calls(FENCED, funcs, fenced=False) == (FENCED, [])  # strict


def _ask_fenced(client, **kw):
    # The regex makes the tiny model write exactly the fenced call; tool_choice auto reads it.
    return client.chat.completions.create(
        model=NAMES[0], messages=[{"role": "user", "content": "weather in Paris?"}], tools=[WEATHER],
        tool_choice="auto", max_tokens=256, temperature=0, extra_body={"guided_regex": FENCED_REGEX}, **kw)


def test_fenced_call_is_a_tool_call(server):
    client = server.client()
    whole = _ask_fenced(client)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(_ask_fenced(client, stream=True, logprobs=True))
    lps = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert len(lps) == whole.usage.completion_tokens  # a held-back stream still brings every token's logprob
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me check.\n" and [t.function.name for t in calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_strict_tool_calls_keep_a_fenced_block_as_text(engine):
    s = LiveServer(engine, ServerOptions(api_keys=(KEY,), fenced_tool_calls=False))
    try:
        choice = _ask_fenced(s.client()).choices[0]
        assert choice.message.content == FENCED and not choice.message.tool_calls
        assert choice.finish_reason == "stop"
    finally:
        s.stop()


# -- logprobs ---------------------------------------------------------------------------------------

def offline(engine, prompt_ids, **kw):
    """The same request run alone by the engine (its own pp-free path: the same mode and stages)."""
    from specpipe.sampling import SamplingParams

    req = engine.prompts.make_request(prompt_ids, SamplingParams(**kw))
    engine.run([req])
    return req


@pytest.mark.parametrize("sampled", [False, True])
def test_completion_logprobs_streamed_and_not(server, engine, alone, sampled):
    client = server.client()
    kw = dict(temperature=0.8, top_p=0.9, seed=7) if sampled else dict(temperature=0)
    r = client.completions.create(model=NAMES[0], prompt="the cat sat on the", max_tokens=10, logprobs=3, **kw)
    lp = r.choices[0].logprobs
    ref = offline(alone, engine.tokenizer.encode("the cat sat on the"), max_tokens=10, logprobs=3, **kw)
    assert lp.token_logprobs == [x.logprob for x in ref.output_logprobs]
    assert lp.tokens == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in ref.output_ids]
    # (the tokens' texts need not join to the text: a byte of a character alone decodes to U+FFFD)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for top, x in zip(lp.top_logprobs, ref.output_logprobs):
        assert 1 <= len(top) <= 4 and max(top.values()) == x.top_logprobs[0]  # texts may coincide

    chunks = list(client.completions.create(model=NAMES[0], prompt="the cat sat on the", max_tokens=10, logprobs=3,
                                            stream=True, **kw))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    plain = client.completions.create(model=NAMES[0], prompt="the cat sat on the", max_tokens=10, **kw)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == r.choices[0].text


def test_chat_logprobs_streamed_and_not(server, engine, alone):
    client = server.client()
    messages = [{"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=4)
    content = r.choices[0].logprobs.content
    ref = offline(alone, engine.prompts.encode_chat(messages), max_tokens=8, logprobs=4)
    assert [c.logprob for c in content] == [x.logprob for x in ref.output_logprobs]
    for c, x in zip(content, ref.output_logprobs):
        assert [t.logprob for t in c.top_logprobs] == list(x.top_logprobs)
        assert c.bytes == list(c.token.encode()) and c.top_logprobs[0].logprob == c.logprob  # greedy: the top one
    chunks = list(client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=4, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    only = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=8, temperature=0, logprobs=True)
    assert [c.logprob for c in only.choices[0].logprobs.content] == [c.logprob for c in content]
    assert all(c.top_logprobs == [] for c in only.choices[0].logprobs.content)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
])
def test_logprobs_refusals(server, path, body, param):
    assert error_of(server.post(path, json={"model": NAMES[0], **body}), 400)["param"] == param
