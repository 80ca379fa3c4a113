"""`specpipe serve` end to end: a live server on loopback (two stage processes, specpipe-db) and
the official `openai` client, as a user runs them.

  * completions and chat, streamed and not: the chunks concatenate to the whole text, usage comes
    in the final chunk when asked, and greedy output equals the same prompt run alone in `pp`;
  * 32 concurrent requests all complete, each equal to the request alone;
  * every kind of bad input gets its 4xx with an OpenAI error body, and the server serves on;
  * the API key guards /v1 (not /health); /metrics parses and its counters move;
  * a client that leaves mid-stream frees its KV at every stage;
  * a full queue answers 429; a stage that dies fails the requests in flight with a 5xx naming
    the stage, /health turns unhealthy, and nothing hangs.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proc_helpers import Run, kill_session, stage_pids
from specpipe.config import EngineConfig
from specpipe.engine.engine import Engine
from specpipe.kernels import native
from specpipe.sampling import SamplingParams

KEY = "test-key"
NAME = "tiny"
PROMPTS = ["hello there", "the cat sat on the mat, the cat sat", "a b c a b c a b", "one two three four",
           "abcabcabcabc", "the theatre in the sea", "x", "to be or not to be, that is"]


class Server:
    def __init__(self, model, *args: str) -> None:
        self.run = Run(["serve", "--model", str(model), "--port", "0", "--served-model-name", NAME,
                        "--log-level", "warning", *args])
        self.run.wait_for_stderr("serving ", 1, timeout_s=120)
        line = next(ln for ln in self.run.err_lines if "serving " in ln)
        self.url = re.search(r"on (http://\S+)", line).group(1)

    def client(self, key: str = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=120, **kw)

    def post(self, path: str, timeout: float = 120, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEY}", **kw.pop("headers", {})}
        return httpx.post(self.url + path, headers=headers, timeout=timeout, **kw)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        text = self.get("/metrics").text
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def stop(self) -> None:
        self.run.proc.send_signal(signal.SIGINT)
        try:
            self.run.wait(30)
        finally:
            kill_session(self.run.proc)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_hidden_layers=4, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, "--stages", "2", "--mode", "specpipe-db", "--draft", "ngram", "--tree-width", "4",
               "--kv-memory", "16MiB", "--max-context", "1024", "--api-key", KEY)
    yield s
    s.stop()
    assert s.run.proc.returncode == 0, s.run.stderr


@pytest.fixture(scope="module")
def alone(model):
    """Each prompt run alone in `pp`, in this process: what the server must give."""
    engine = Engine(EngineConfig(model=str(model), mode="pp", transport="inproc", kv_memory="16MiB", max_context=1024))
    cache = {}

    def run(prompt, max_tokens, chat=False, **sampling):
        key = (str(prompt), max_tokens, chat, tuple(sorted(sampling.items())))
        if key not in cache:
            params = SamplingParams(max_tokens=max_tokens, **sampling)
            if chat:
                req = engine.prompts.make_request(engine.prompts.encode_chat(prompt), params)
                engine.run([req])
                cache[key] = (req.text, len(req.prompt_ids), len(req.output_ids), req.finish_reason)
            else:
                r = engine.generate(prompt, params, chat=False)
                cache[key] = (r.text, len(r.prompt_token_ids), len(r.token_ids), r.finish_reason)
        return cache[key]

    yield run
    engine.close()


# -- the API ----------------------------------------------------------------------------------------

def test_models_and_health(server):
    health = server.get("/health").json()  # no key needed
    assert health["status"] == "ok" and [st["state"] for st in health["stages"]] == ["running"] * len(health["stages"])
    assert all(st["restarts"] == 0 and len(st["layers"]) == 2 for st in health["stages"])
    # what the stages compute with, as the driver sees it (a float model: float32 matmuls)
    isa = native.isa() if native.available() else None
    assert health["kernels"] == {"weights": {"float": "float32"}, "native_isa": isa,
                                 "native_library": "loaded" if isa else native.unavailable_reason(),
                                 "seen_by": "driver"}
    info = [(labels, v) for (name, labels), v in server.metrics().items() if name == "specpipe:kernel_info"]
    assert info == [((("isa", isa or "none"), ("kernel", "float32"), ("weight_type", "float")), 1.0)]
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]


def test_completion_streamed_equals_whole_and_alone(server, alone):
    client = server.client()
    for prompt, n in [(PROMPTS[1], 24), (PROMPTS[2], 9)]:
        whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0)
        text, n_prompt, n_out, reason = alone(prompt, n, temperature=0.0)
        assert whole.choices[0].text == text
        assert whole.choices[0].finish_reason == reason
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (n_prompt, n_out)
        chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_out
        assert all(c.usage is None for c in chunks[:-1])


def test_stop_strings_streamed_and_whole_equal_alone(server, alone):
    """Stop strings are matched on the server's output thread, not in the step: the same text,
    completion tokens (none after the stop) and finish reason as alone."""
    client = server.client()
    text = alone(PROMPTS[1], 24, temperature=0.0)[0]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    want, _, n_out, reason = alone(PROMPTS[1], 24, temperature=0.0, stop=(stop,))
    assert reason == "stop" and len(want) < len(text)
    whole = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert (whole.choices[0].text, whole.usage.completion_tokens, whole.choices[0].finish_reason) == (want, n_out, "stop")
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop],
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == n_out
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_chat_streamed_and_whole(server, alone):
    client = server.client()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    text, n_prompt, n_out, reason = alone(messages, 12, chat=True, temperature=0.0)
    assert whole.choices[0].message.content == text and whole.choices[0].message.role == "assistant"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.choices[0].finish_reason) == (
        n_prompt, n_out, reason)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.total_tokens == n_prompt + n_out
    # Stop strings and seeded sampling reach the engine.
    sampled = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0.8,
                                             top_p=0.9, seed=7)
    assert sampled.choices[0].message.content == alone(messages, 10, chat=True, temperature=0.8, top_p=0.9, seed=7)[0]


def test_32_concurrent_requests_each_equal_alone(server, alone):
    jobs = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), 6 + (i * 5) % 23) for i in range(32)]

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*[aclient.completions.create(model=NAME, prompt=p, max_tokens=n, temperature=0)
                                          for p, n in jobs])
        finally:
            await aclient.close()

    outs = asyncio.run(main())
    for (prompt, n), out in zip(jobs, outs):
        text, _, n_out, reason = alone(prompt, n, temperature=0.0)
        assert (out.choices[0].text, out.usage.completion_tokens, out.choices[0].finish_reason) == (text, n_out, reason)


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": "hi " * 1100, "max_tokens": 4}, 400, "max_tokens"),  # the prompt alone is over the context
    ({"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": 12}, 400, "prompt"),
    ({"prompt": "hi", "n": 17}, 400, "n"),  # at most 16
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),  # at most 20
    ({"prompt": ["a"] * 33}, 400, "prompt"),  # over MAX_PROMPTS (a list of up to 32 is served)
    ({"prompt": [5, 99999]}, 400, "prompt"),  # a token id outside the vocabulary
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
])
def test_bad_input_gets_a_4xx_and_the_server_serves_on(server, body, status, param):
    r = server.post("/v1/completions", json={"model": NAME, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err
    ok = server.client().completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1


def test_malformed_json_and_bad_chat(server):
    r = server.post("/v1/completions", content=b'{"model": "tiny", "prompt": ', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = server.post("/v1/chat/completions", json={"model": NAME, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = server.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400
    r = server.post("/v1/nowhere", json={})
    assert r.status_code == 404 and "error" in r.json()


def test_api_key_is_enforced(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    r = server.get("/v1/models")  # no key at all
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert server.post("/v1/completions", json={"model": NAME, "prompt": "hi"},
                       headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert server.get("/health").status_code == 200
    assert server.get("/metrics").status_code == 200


def test_metrics_parse_and_move(server):
    before = server.metrics()
    server.client().completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=7, temperature=0,
                                       extra_body={"ignore_eos": True})
    steps = [("specpipe:stage_steps_total", (("stage", s),)) for s in ("1", "2")]
    # The stages' figures come with the step after the request (the idle report), which may
    # not have run when the response arrives: wait for it rather than make one.
    deadline = time.monotonic() + 30
    while True:
        after = server.metrics()
        if all(after.get(k, 0.0) > before.get(k, 0.0) for k in steps) or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    def moved(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert moved("specpipe:request_success_total", (("finished_reason", "length"),)) == 1
    assert moved("specpipe:generation_tokens_total") == 7
    assert moved("specpipe:prompt_tokens_total") > 0
    assert moved("specpipe:e2e_request_latency_seconds_count") == 1
    assert moved("specpipe:time_to_first_token_seconds_count") == 1
    assert moved("specpipe:spec_decode_num_verified_tokens_total") == 7
    assert moved("specpipe:spec_decode_num_draft_tokens_total") > 0
    assert moved("specpipe:pipeline_steps_total") > 0
    for stage in ("1", "2"):
        assert moved("specpipe:stage_steps_total", (("stage", stage),)) > 0
        assert after[("specpipe:kv_cache_usage_perc", (("stage", stage),))] == 0.0
    assert after[("specpipe:num_requests_running", ())] == 0
    assert 0 < after[("specpipe:tokens_per_step", ())] and 0 <= after[("specpipe:spec_decode_hit_rate", ())] <= 1


def test_a_repeated_prefix_is_served_from_the_cache_and_reported(server, alone):
    prompt = "the cat sat on the mat and the dog sat on the log, " * 4
    client = server.client()
    before = server.metrics()
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0)
    again = client.completions.create(model=NAME, prompt=prompt + "then", max_tokens=6, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= 16 and cached % 16 == 0 and cached < again.usage.prompt_tokens
    assert again.choices[0].text == alone(prompt + "then", 6)[0]  # the same tokens as without the cache
    after = server.metrics()
    hits = ("specpipe:prefix_cache_hits_total", ())
    queries = ("specpipe:prefix_cache_queries_total", ())
    assert after[hits] - before.get(hits, 0.0) == cached
    assert after[queries] - before.get(queries, 0.0) == first.usage.prompt_tokens + again.usage.prompt_tokens
    assert 0 < after[("specpipe:prefix_cache_hit_rate", ())] <= 1


def test_metrics_count_the_tokens_a_stop_string_keeps(server, alone):
    """Tokens the engine committed past a stop string are dropped from the answer, and from
    generation_tokens too (counted as delivered, not as computed)."""
    text, _, n, _ = alone(PROMPTS[2], 16, temperature=0.0)
    stop = text[len(text) // 2:][:3]
    assert stop.strip() and n == 16, (text, n)
    before = server.metrics()
    out = server.client().completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                             stop=[stop])
    after = server.metrics()
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens < 16
    moved = after[("specpipe:generation_tokens_total", ())] - before.get(("specpipe:generation_tokens_total", ()), 0.0)
    assert moved == out.usage.completion_tokens


def wait_kv_back(server, before, kv) -> dict:
    """Poll /metrics until every stage's KV use is back at `before` and nothing runs."""
    deadline = time.monotonic() + 30
    while True:
        now = server.metrics()
        if all(now[k] == before[k] for k in kv) and now[("specpipe:num_requests_running", ())] == 0:
            return now
        assert time.monotonic() < deadline, {k: now[k] for k in kv}
        time.sleep(0.2)


KV = [("specpipe:kv_cache_usage_perc", (("stage", s),)) for s in ("1", "2")]
ABORTED = ("specpipe:request_success_total", (("finished_reason", "abort"),))
LONG = {"model": NAME, "prompt": PROMPTS[5], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}


def test_disconnect_mid_stream_frees_the_kv(server):
    before = server.metrics()
    with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(10)]  # a few chunks in: the request holds KV now
        assert any(line.startswith("data: {") for line in got)
        during = server.metrics()
        assert during[("specpipe:num_requests_running", ())] == 1
        # The stages report on ordinary steps, at most once a second: wait for a report that
        # shows the request's KV at every stage.
        deadline = time.monotonic() + 10
        while not all(during[k] > before[k] for k in KV):
            assert time.monotonic() < deadline, {k: during[k] for k in KV}
            time.sleep(0.2)
            during = server.metrics()
    # The connection is closed: the request is cancelled and every stage frees its KV.
    now = wait_kv_back(server, before, KV)
    assert now[ABORTED] - before.get(ABORTED, 0.0) == 1


def test_disconnect_while_waiting_for_a_whole_response_frees_the_kv(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        server.post("/v1/completions", json=LONG, timeout=1)
    now = wait_kv_back(server, before, KV)
    assert now[ABORTED] - before.get(ABORTED, 0.0) == 1


# -- limits and failures (a server of their own) ------------------------------------------------------

def test_full_queue_429_then_dead_stage_fails_requests_and_health(model):
    s = Server(model, "--stages", "2", "--mode", "pp-cb", "--max-num-seqs", "1", "--max-queue", "1",
               "--kv-memory", "16MiB", "--max-context", "1024", "--link-delay-ms", "5",
               "--restart-stages", "0")  # a dead stage stays dead (tests/distributed/test_restart.py: restarts)
    try:
        long = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                async def one(stream: bool):
                    r = await c.post(s.url + "/v1/completions", json={**long, "stream": stream})
                    return r.status_code, r.text

                async def until(name: str, value: float):
                    while (await asyncio.to_thread(s.metrics))[(name, ())] != value:
                        await asyncio.sleep(0.1)

                # One runs, one waits (--max-queue 1), the rest find the queue full.
                tasks = [asyncio.create_task(one(False))]
                await asyncio.wait_for(until("specpipe:num_requests_running", 1), 30)
                tasks.append(asyncio.create_task(one(True)))
                await asyncio.wait_for(until("specpipe:num_requests_waiting", 1), 30)
                refused = await asyncio.gather(*[one(False) for _ in range(3)])
                assert [st for st, _ in refused] == [429] * 3, refused
                assert all('"queue_full"' in text for _, text in refused)
                # A stage dies with both requests in flight: each fails with a 5xx naming the stage.
                os.kill(stage_pids(s.run.proc.pid)[1], signal.SIGKILL)
                return await asyncio.gather(*tasks)

        t0 = time.monotonic()
        (status, text), (stream_status, stream_text) = asyncio.run(burst())
        assert time.monotonic() - t0 < 60  # nothing hung
        assert status == 500 and "stage 2" in text, text
        # The stream had already begun (or was waiting): its failure arrives as an error event.
        assert stream_status in (200, 500) and "stage 2" in stream_text, stream_text
        health = s.get("/health")
        assert health.status_code == 503 and "stage 2" in health.json()["error"]
        assert {st["state"] for st in health.json()["stages"]} == {"failed"}
        r = s.post("/v1/completions", json={**long, "max_tokens": 2})
        assert r.status_code == 503 and "stage 2" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_max_concurrency_bounds_open_requests(model):
    """--max-concurrency reaches uvicorn (limit_concurrency): beyond it a request gets 503."""
    s = Server(model, "--mode", "pp-cb", "--max-concurrency", "2", "--kv-memory", "16MiB", "--max-context", "1024")
    try:
        body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as c1, httpx.Client(timeout=60) as c2:
            with c1.stream("POST", s.url + "/v1/completions", json=body) as r1, \
                    c2.stream("POST", s.url + "/v1/completions", json=body) as r2:
                assert (r1.status_code, r2.status_code) == (200, 200)
                assert s.post("/v1/completions", json={**body, "stream": False}).status_code == 503
        deadline = time.monotonic() + 30
        while s.get("/health").status_code != 200:  # the two streams' connections are closed again
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        s.stop()
