"""best_of on /v1/completions through a live server (the app on uvicorn in a thread, two in-process
stages, specpipe-db with an n-gram source) and the official `openai` client: best_of samples, each
seeded as n's are (seed + i), of which the n with the highest cumulative log-probability come back,
best first, each equal to its sample decoded alone by plain `pp`; refused when streamed over n,
below n, over n's limit, and on chat."""

from __future__ import annotations

import httpx
import pytest

from specpipe.entrypoints.openai.api_server import ServerOptions
from specpipe.sampling import SamplingParams

import live_app

NAME = "tiny"
PROMPT = "the cat sat on the mat and the dog sat on the log"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return live_app.tiny_llama(tiny_model_dir)


@pytest.fixture(scope="module")
def server(model):
    with live_app.serving(model, ServerOptions()) as s:
        yield s


@pytest.fixture(scope="module")
def alone(model):
    """Plain decoding in this process, one request at a time, with each token's log-probability:
    (text, cumulative log-probability) of a sample sent alone."""
    engine = live_app.plain_engine(model)

    def run(prompt, **sampling):
        out = engine.generate(prompt, SamplingParams(logprobs=0, **sampling), chat=False, ignore_eos=True)
        return out.text, sum(lp.logprob for lp in out.logprobs)

    yield run
    engine.close()


def post(server, path: str, body: dict) -> httpx.Response:
    return server.post(path, json={"model": NAME, **body})


def top(samples: list[tuple[str, float]], n: int) -> list[tuple[str, float]]:
    return sorted(samples, key=lambda s: s[1], reverse=True)[:n]


def test_best_of_returns_the_top_n_by_cumulative_logprob(server, alone):
    seed, best_of, n = 100, 5, 2
    samples = [alone(PROMPT, temperature=1.0, seed=seed + i, max_tokens=8) for i in range(best_of)]
    want = top(samples, n)
    # the test means something only if ranking picks other samples than the first n
    assert [t for t, _ in want] != [t for t, _ in samples[:n]]
    out = server.client().completions.create(model=NAME, prompt=PROMPT, n=n, best_of=best_of, seed=seed,
                                            temperature=1.0, max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [t for t, _ in want]
    assert all(c.logprobs is None for c in out.choices)  # computed to rank, shown only when asked
    assert out.usage.completion_tokens == best_of * 8  # every sample was generated
    # asked for: each choice's own token log-probabilities, summing to its rank's value
    shown = server.client().completions.create(model=NAME, prompt=PROMPT, n=n, best_of=best_of, seed=seed,
                                              temperature=1.0, max_tokens=8, logprobs=1, extra_body={"ignore_eos": True})
    assert [c.text for c in shown.choices] == [t for t, _ in want]
    for c, (_, cum) in zip(shown.choices, want):
        assert sum(c.logprobs.token_logprobs) == pytest.approx(cum, abs=1e-4)


def test_best_of_one_choice_and_several_prompts(server, alone):
    prompts = [[5, 17, 42, 99, 7], [130, 64, 12, 250, 33, 8, 9]]
    out = server.client().completions.create(model=NAME, prompt=prompts, best_of=3, seed=9, temperature=1.0,
                                            max_tokens=6, extra_body={"ignore_eos": True})
    want = [top([alone(q, temperature=1.0, seed=9 + i, max_tokens=6) for i in range(3)], 1)[0][0] for q in prompts]
    assert [c.text for c in out.choices] == want
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 12 and out.usage.completion_tokens == 2 * 3 * 6


def test_best_of_equal_to_n_streams_as_n(server, alone):
    texts = ["", ""]
    for c in server.client().completions.create(model=NAME, prompt=PROMPT, n=2, best_of=2, seed=3, temperature=1.0,
                                               max_tokens=5, stream=True, extra_body={"ignore_eos": True}):
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [alone(PROMPT, temperature=1.0, seed=3 + i, max_tokens=5)[0] for i in range(2)]


@pytest.mark.parametrize("body, says", [
    ({"best_of": 3, "stream": True}, "not streamed"),
    ({"best_of": 2, "n": 3}, "at least n"),
    ({"best_of": 17}, ""),
    ({"best_of": 0}, ""),
    ({"best_of": 16, "prompt": [[1, 2]] * 5}, "best_of = 16"),
])
def test_refused_best_of_is_a_400_naming_it(server, body, says):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == ("prompt" if "prompt" in body else "best_of"), err
    assert says in err["message"]


def test_chat_refuses_best_of(server):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    assert "/v1/completions" in r.json()["error"]["message"]
