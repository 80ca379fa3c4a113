"""No request can take the engine down (issue 57, finding 1):

  * every number a body carries is bounded where it is parsed, so top_k = 2**63 (which failed a
    step of the whole pipeline, and the engine with it) is a 400 naming the field, and the
    served schema shows the same bound;
  * SamplingParams refuses the same values for the Python API;
  * an error inside a step that belongs to one request (here its grammar, which raises) ends
    that request with an error naming the cause, while a request beside it and the next one
    are served and /health stays ok;
  * when the pipeline itself fails, /health says why and the log says so too.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import httpx
import pytest

from test_server_limits import KEYS, NAME, LiveServer, assert_error, completion, engine  # noqa: F401  (a fixture)
from specpipe.entrypoints.openai.api_server import ServerOptions
from specpipe.sampling import MAX_TOP_K, SamplingParams


@pytest.fixture(scope="module")
def server(engine):  # noqa: F811
    s = LiveServer(engine, ServerOptions(api_keys=KEYS, max_body_bytes=64 << 10))
    yield s
    s.stop()


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**63), ("seed", 2**53 + 1), ("top_k", MAX_TOP_K + 1), ("max_tokens", 2**63), ("temperature", 1e308),
])
def test_out_of_range_numbers_are_a_400_and_the_engine_serves_on(server, field, value):
    assert_error(server.post("/v1/completions", json=completion(**{field: value})), 400, param=field)
    assert server.get("/health").status_code == 200
    assert server.post("/v1/completions", json=completion()).status_code == 200


def test_the_served_schema_bounds_every_sampling_number(server):
    schema = server.get("/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schema[name]["properties"]
        for field in ("top_k", "seed", "max_tokens", "temperature", "top_p"):
            bounded = [b for b in props[field].get("anyOf", [props[field]]) if b.get("type") in ("integer", "number")]
            assert bounded and all("maximum" in b for b in bounded), (name, field, props[field])
        assert props["top_k"]["maximum"] == MAX_TOP_K


@pytest.mark.parametrize("kwargs", [
    dict(top_k=2**63), dict(top_k=1.5), dict(temperature=math.nan), dict(temperature=math.inf),
    dict(top_p=math.nan), dict(max_tokens=2**63), dict(seed=-1), dict(max_tokens=True),
])
def test_sampling_params_refuse_values_the_engine_cannot_use(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_a_tiny_temperature_is_greedy_not_nan():
    # logits / 1e-300 overflow to inf, and softmax then gives NaN: the limit, argmax, is used
    import torch

    from specpipe.sampling import target_tokens

    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert target_tokens(logits, [0, 1], SamplingParams(temperature=1e-300, seed=1)) == [1, 0]


class RaisingGrammar:
    """A grammar that fails inside the step (as a resource limit of llguidance's would)."""

    closed = complete = False

    def masks(self, paths):
        raise RuntimeError("grammar exploded")

    def accept(self, token):
        return None

    def proposals(self, path, candidates, k):
        return candidates[:k]

    def close(self):
        self.closed = True


def test_an_error_of_one_request_inside_a_step_ends_that_request_alone(server, engine):  # noqa: F811
    async def run():
        bad = engine.prompts.make_request("the cat sat", SamplingParams(max_tokens=4))
        bad.grammar = RaisingGrammar()
        good = engine.prompts.make_request("the dog ran", SamplingParams(max_tokens=4))
        streams = [await server.aengine.add(bad), await server.aengine.add(good)]
        for s in streams:
            async for _ in s:
                pass
        return streams

    bad, good = asyncio.run(run())
    assert bad.finish_reason == "error" and "grammar exploded" in bad.error, bad.error
    assert good.finish_reason == "length" and len(good.token_ids) == 4
    assert server.aengine.dead is None
    assert server.get("/health").json()["status"] == "ok"
    assert server.post("/v1/completions", json=completion()).status_code == 200


def test_a_pipeline_fault_is_logged_and_health_says_why(engine, caplog):  # noqa: F811
    s = LiveServer(engine, ServerOptions())
    try:
        def broken(control, rows):
            raise ConnectionError("stage 2 is gone")

        s.pipe.submit = broken
        with caplog.at_level(logging.ERROR, logger="specpipe.engine"):
            r = httpx.post(s.url + "/v1/completions", json=completion(), timeout=60)
        assert r.status_code == 500 and "stage 2 is gone" in r.json()["error"]["message"]
        health = s.get("/health")
        assert health.status_code == 503 and "stage 2 is gone" in health.json()["error"]
        assert any("stage 2 is gone" in rec.getMessage() for rec in caplog.records)
    finally:
        s.stop()


# -- connections (issue 57, finding 9) ------------------------------------------------------------------

@pytest.fixture(scope="module")
def strict_server(engine):  # noqa: F811
    s = LiveServer(engine, ServerOptions(header_timeout_s=1.0, max_connections_per_client=2))
    yield s
    s.stop()


def test_a_connection_that_sends_half_a_head_is_closed(strict_server):
    import socket

    with socket.create_connection(("127.0.0.1", strict_server.port), timeout=10) as c:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the blank line never comes
        t0 = time.monotonic()
        assert c.recv(1024) == b""  # closed by the server
        assert time.monotonic() - t0 < 5
    assert strict_server.get("/health").status_code == 200


def test_one_address_holds_a_bounded_number_of_connections(strict_server):
    import socket

    held = [socket.create_connection(("127.0.0.1", strict_server.port), timeout=10) for _ in range(2)]
    try:
        with socket.create_connection(("127.0.0.1", strict_server.port), timeout=10) as c:
            assert c.recv(1024).startswith(b"HTTP/1.1 503")
    finally:
        for c in held:
            c.close()
    deadline = time.monotonic() + 5
    while strict_server.get("/health").status_code != 200:  # the held ones are gone: served again
        assert time.monotonic() < deadline
        time.sleep(0.1)


# -- grammars (issue 57, finding 7) ---------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("guided_regex", "a{1000}{1000}"),  # gave a 500 mid-stream: "the grammar refuses committed token"
    ("guided_grammar", "start: " + " | ".join(f'"w{i}"' for i in range(3000))),  # a row over llguidance's 2,000
], ids=["nested-repeat", "wide-lark"])
def test_a_grammar_that_cannot_follow_itself_is_a_400_before_queueing(server, field, value):
    steps = server.core.steps
    assert_error(server.post("/v1/completions", json=completion(**{field: value})), 400, param=field)
    assert server.core.steps == steps  # nothing was queued (the server was idle)
    assert server.post("/v1/completions", json=completion()).status_code == 200


def test_an_astral_character_in_a_regex_is_served(server):
    r = server.post("/v1/completions", json=completion(guided_regex="x𝄞y", max_tokens=12))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "x𝄞y", r.text
