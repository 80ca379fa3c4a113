"""Issue 62 items 2-4 through a live server (the app on uvicorn in a thread, two in-process stages,
specpipe-db with an n-gram source) and the official `openai` client:
  * n = 3: three samples, each equal to the same request sent alone with seed + i, whole and
    streamed (chunks carry their `index`), the later samples reading the prompt from the cache;
  * penalties, logit_bias and min_p reach the engine: the server's answer equals plain `pp`'s;
  * echo with logprobs: the prompt's tokens and their log-probabilities (the first null), equal to
    a single forward's log_softmax; max_tokens 0 with echo; vLLM's prompt_logprobs.
"""

from __future__ import annotations

import pytest

from specpipe.entrypoints.openai.api_server import ServerOptions
from specpipe.sampling import SamplingParams

import live_app

NAME = "tiny"
# Longer than two KV blocks (16 tokens each), so the later samples can read it from the cache.
PROMPT = "the cat sat on the mat and the dog sat on the log, and then the cat saw the dog and ran far away home"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return live_app.tiny_llama(tiny_model_dir)


@pytest.fixture(scope="module")
def server(model):
    with live_app.serving(model, ServerOptions()) as s:
        yield s


@pytest.fixture(scope="module")
def alone(model):
    """Plain decoding in this process, one request at a time: what the server must give."""
    engine = live_app.plain_engine(model)

    def run(prompt, **sampling):
        return engine.generate(prompt, SamplingParams(**sampling), chat=False)

    yield run
    engine.close()


def test_n_samples_each_equal_alone_with_its_derived_seed(server, alone):
    out = server.client().completions.create(model=NAME, prompt=PROMPT, n=3, seed=100, temperature=1.0,
                                             max_tokens=8)
    assert [c.index for c in out.choices] == [0, 1, 2]
    want = [alone(PROMPT, temperature=1.0, seed=100 + i, max_tokens=8).text for i in range(3)]
    assert [c.text for c in out.choices] == want
    assert len(set(want)) > 1  # different seeds, different samples
    assert out.usage.completion_tokens == 24
    assert out.usage.prompt_tokens_details.cached_tokens >= 16  # a later sample read the prompt's blocks


def test_n_streamed_chunks_carry_their_index(server, alone):
    chunks = list(server.client().completions.create(model=NAME, prompt=PROMPT, n=3, seed=7, temperature=1.0,
                                                     max_tokens=6, stream=True, stream_options={"include_usage": True}))
    texts = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [alone(PROMPT, temperature=1.0, seed=7 + i, max_tokens=6).text for i in range(3)]
    assert chunks[-1].usage.completion_tokens == 18


def test_several_prompts_each_as_if_sent_alone(server, alone):
    """A list of prompts (lm-evaluation-harness's batch_size > 1): prompt j's sample i is choice
    j * n + i, equal to prompt j sent alone with seed + i; usage sums the prompts; streamed too."""
    prompts = [[5, 17, 42, 99, 7], [130, 64, 12, 250, 33, 8, 9]]  # a list of texts works too (the schema)
    out = server.client().completions.create(model=NAME, prompt=prompts, n=2, seed=50, temperature=1.0, max_tokens=6)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    want = [alone(q, temperature=1.0, seed=50 + i, max_tokens=6).text for q in prompts for i in range(2)]
    assert [c.text for c in out.choices] == want
    assert out.usage.prompt_tokens == 12
    assert out.usage.completion_tokens == 24
    streamed = [""] * 4
    for c in server.client().completions.create(model=NAME, prompt=prompts, n=2, seed=50, temperature=1.0,
                                                max_tokens=6, stream=True):
        for choice in c.choices:
            streamed[choice.index] += choice.text
    assert streamed == want
    r = server.post("/v1/completions", json={"model": NAME, "prompt": [[1, 2]] * 33, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = server.post("/v1/completions", json={"model": NAME, "prompt": [[1, 2]] * 5, "n": 16, "max_tokens": 1})
    assert r.status_code == 400 and "choices" in r.json()["error"]["message"]


def test_chat_n_whole_and_streamed(server):
    client, messages = server.client(), [{"role": "user", "content": "the cat"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, n=2, seed=3, temperature=1.0, max_tokens=5)
    assert [c.index for c in whole.choices] == [0, 1]
    streamed = ["", ""]
    for c in client.chat.completions.create(model=NAME, messages=messages, n=2, seed=3, temperature=1.0,
                                            max_tokens=5, stream=True):
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [c.message.content for c in whole.choices]
    one = client.chat.completions.create(model=NAME, messages=messages, seed=4, temperature=1.0, max_tokens=5)
    assert one.choices[0].message.content == whole.choices[1].message.content


def test_penalties_reach_the_engine(server, alone):
    sampling = dict(presence_penalty=1.2, frequency_penalty=0.7, seed=5, temperature=0.7, max_tokens=10)
    out = server.client().completions.create(model=NAME, prompt="a b c a b c a b", logit_bias={"17": 5.0},
                                             extra_body={"repetition_penalty": 1.4, "min_p": 0.05}, **sampling)
    want = alone("a b c a b c a b", logit_bias=((17, 5.0),), repetition_penalty=1.4, min_p=0.05, **sampling)
    assert out.choices[0].text == want.text
    plain = alone("a b c a b c a b", seed=5, temperature=0.7, max_tokens=10)
    assert want.token_ids != plain.token_ids  # they change the output


@pytest.mark.parametrize("body, param", [
    ({"n": 17}, "n"), ({"presence_penalty": 2.5}, "presence_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
])
def test_bad_values_are_400s_naming_the_field(server, body, param):
    r = server.post("/v1/completions", json={"model": NAME, "prompt": "hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param, r.json()


@pytest.fixture(scope="module")
def forward(model):
    return live_app.float32_log_softmax(model)


def test_echo_with_logprobs_gives_the_prompts_as_a_single_forward(server, forward):
    ids = [5, 17, 42, 99, 7, 7, 130, 64, 12, 250, 33]  # token ids, as lm-evaluation-harness sends them
    out = server.client().completions.create(model=NAME, prompt=ids, echo=True, logprobs=2, max_tokens=3,
                                             temperature=0)
    lps, n = out.choices[0].logprobs, len(ids)
    assert len(lps.tokens) == n + 3 and lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    lp = forward(ids)
    for i in range(1, n):
        assert lps.token_logprobs[i] == pytest.approx(float(lp[i - 1, ids[i]]), abs=1e-4)
        assert len(lps.top_logprobs[i]) >= 2
    plain = server.client().completions.create(model=NAME, prompt=ids, logprobs=2, max_tokens=3, temperature=0)
    echo = server.client().completions.create(model=NAME, prompt=ids, echo=True, max_tokens=0).choices[0].text
    assert echo and out.choices[0].text == echo + plain.choices[0].text
    assert lps.token_logprobs[n:] == plain.choices[0].logprobs.token_logprobs  # the output's are unchanged


def test_echo_max_tokens_0_is_the_prompt_alone(server, forward):
    ids = [9, 8, 7, 6, 5, 4, 3]
    r = server.post("/v1/completions", json={"model": NAME, "prompt": ids, "echo": True, "logprobs": 0,
                                             "max_tokens": 0}).json()
    choice = r["choices"][0]
    assert r["usage"]["completion_tokens"] == 0 and len(choice["logprobs"]["token_logprobs"]) == len(ids)
    lp = forward(ids)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx([float(lp[i - 1, ids[i]]) for i in range(1, 7)],
                                                                     abs=1e-4)
    streamed = list(server.client().completions.create(model=NAME, prompt=ids, echo=True, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice["text"]
    assert server.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 0}).status_code == 400


def test_vllms_prompt_logprobs(server, forward):
    ids = [11, 22, 33, 44, 55]
    r = server.post("/v1/completions", json={"model": NAME, "prompt": ids, "prompt_logprobs": 1, "max_tokens": 2}).json()
    got = r["choices"][0]["prompt_logprobs"]
    lp = forward(ids)
    assert got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        assert got[i][str(ids[i])]["logprob"] == pytest.approx(float(lp[i - 1, ids[i]]), abs=1e-4)
        top = int(lp[i - 1].argmax())
        assert got[i][str(top)]["rank"] == 1
    chat = server.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                                     "prompt_logprobs": 0, "max_tokens": 2}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
