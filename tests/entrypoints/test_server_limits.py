"""The server's limits and honesty, in process (the app on a real uvicorn in a thread, the stages
in this process), so each check is quick:

  * a body over --max-body-bytes gets 413 before it is parsed; stop strings, max_tokens and
    prompt token lists over their limits get a 400 naming the field;
  * prompts are tokenized off the event loop;
  * /metrics never costs a step, /health tells the truth within 5 s (a wedged pipeline is
    unhealthy) and costs at most about a step a second; --metrics-need-key guards both;
  * a client that leaves before the first server-sent event does not leave its request decoding;
  * the OpenAPI schema declares the errors each route really answers with, and no 422.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from specpipe.config import EngineConfig
from specpipe.engine.async_engine import AsyncEngine
from specpipe.engine.core import EngineCore
from specpipe.engine.engine import Engine
from specpipe.engine.metrics import EngineMetrics
from specpipe.entrypoints.openai.api_server import ServerOptions, build_app, uvicorn_config

NAME = "tiny"
KEYS = ("key-a", "key-b")


class WedgeablePipe:
    """The engine's pipeline; while `wedged` is set, a step never comes back (a hung stage)."""

    concurrent = False

    def __init__(self, pipe) -> None:
        self.pipe, self.num_stages = pipe, pipe.num_stages
        self.wedged, self.free = threading.Event(), threading.Event()

    @property
    def reported(self):
        return self.pipe.reported

    @property
    def steps(self):
        return self.pipe.steps

    def submit(self, control, rows):
        self.pipe.submit(control, rows)

    def collect(self):
        if self.wedged.is_set():
            self.free.wait()
        return self.pipe.collect()


class LiveServer:
    """build_app on uvicorn in a background thread, on a free loopback port."""

    def __init__(self, engine: Engine, options: ServerOptions) -> None:
        self.pipe = WedgeablePipe(engine.pipeline)
        self.core = EngineCore(self.pipe, "pp-cb", kv_blocks=engine.num_blocks, block_size=engine.block_size,
                               max_num_seqs=4, step_rows=64, pids=engine._pids)
        self.metrics = EngineMetrics(lambda: self.aengine.snapshot, lambda: self.aengine.dead is None, NAME)
        self.aengine = AsyncEngine(self.core, observer=self.metrics, admit_timeout_s=30)
        self.app = build_app(engine, self.aengine, self.metrics, NAME, options)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(self.app, options, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def post(self, path: str, key: str = KEYS[0], **kw) -> httpx.Response:
        return httpx.post(self.url + path, headers={"Authorization": f"Bearer {key}", **kw.pop("headers", {})},
                          timeout=60, **kw)

    def get(self, path: str, key: str | None = None, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.url + path, headers=headers, timeout=60, **kw)

    def stop(self) -> None:
        self.pipe.free.set()
        self.server.should_exit = True
        self.thread.join(30)
        self.aengine.shutdown()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    e = Engine(EngineConfig(model=str(tiny_model_dir("llama", num_hidden_layers=2, max_position_embeddings=1024)),
                            mode="pp-cb", stages=2, transport="inproc", kv_memory="8MiB", max_context=1024))
    yield e
    e.close()


@pytest.fixture(scope="module")
def server(engine):
    s = LiveServer(engine, ServerOptions(api_keys=KEYS, max_body_bytes=64 << 10))
    yield s
    s.stop()


def completion(**kw) -> dict:
    return {"model": NAME, "prompt": "the cat sat", "max_tokens": 3, "temperature": 0, **kw}


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# -- limits -------------------------------------------------------------------------------------------

def test_a_body_over_the_limit_gets_413_before_it_is_parsed(server):
    big = completion(prompt="x" * (8 << 20))  # far over: still read and dropped, so the client sees the 413
    assert_error(server.post("/v1/completions", json=big), 413, code="request_too_large")

    async def post_async():  # an asyncio client still sending when the server closed got a reset
        async with httpx.AsyncClient(timeout=60) as c:
            return [await c.post(server.url + "/v1/completions", json=big, headers={"Authorization": "Bearer key-a"})
                    for _ in range(3)]

    for r in asyncio.run(post_async()):
        assert_error(r, 413, code="request_too_large")

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(80):
            yield b"y" * 1024
        yield b'"}'

    assert_error(server.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}),
                 413, code="request_too_large")
    assert server.post("/v1/completions", json=completion()).status_code == 200  # and it serves on


@pytest.mark.parametrize("body, param", [
    (completion(stop=["s"] * 1025), "stop"),  # any number as vLLM, within the documented bounds
    (completion(stop=["s" * 1000] * 17), "stop"),  # 17000 characters in all, over 16384
    (completion(stop="s" * 1025), "stop"),
    (completion(max_tokens=1025), "max_tokens"),
    (completion(prompt=[5] * 1025), "prompt"),  # token ids beyond the context, refused before any work
])
def test_limits_get_a_400_naming_the_field(server, body, param):
    assert_error(server.post("/v1/completions", json=body), 400, param=param)


def test_a_validation_error_is_a_400_not_fastapi_422(server):
    assert_error(server.post("/v1/completions", json={"model": NAME}), 400, param="prompt")
    assert_error(server.post("/v1/chat/completions", json={"model": NAME, "messages": "hi"}), 400, param="messages")


def test_prompts_are_tokenized_off_the_event_loop(server, engine, monkeypatch):
    threads = []
    encode = engine.tokenizer.encode

    def recording(text, *args, **kw):
        threads.append(threading.current_thread().name)
        return encode(text, *args, **kw)

    monkeypatch.setattr(engine.tokenizer, "encode", recording)
    assert server.post("/v1/completions", json=completion()).status_code == 200
    chat = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert server.post("/v1/chat/completions", json=chat).status_code == 200
    assert len(threads) == 2 and all(t.startswith("specpipe-tokenize") for t in threads), threads


# -- /health and /metrics ----------------------------------------------------------------------------

def idle(server) -> None:
    """No work left and no step running: the step count holds still for a while (has_work() alone
    can read false while the engine thread is inside the step that delivers the last report)."""
    deadline = time.monotonic() + 30
    while True:
        steps = server.core.steps
        time.sleep(0.3)
        if not server.core.has_work() and server.core.steps == steps:
            return
        assert time.monotonic() < deadline


def test_metrics_scrapes_cost_no_step(server):
    assert server.post("/v1/completions", json=completion(max_tokens=5)).status_code == 200
    idle(server)
    steps = server.core.steps
    for _ in range(5):
        text = server.get("/metrics").text
        assert 'specpipe:kv_cache_usage_perc{model_name="tiny",stage="1"} 0.0' in text  # the idle engine's report
    assert server.core.steps == steps


def test_health_polling_costs_at_most_about_a_step_a_second(server):
    idle(server)
    steps, t0 = server.core.steps, time.monotonic()
    for _ in range(20):
        assert server.get("/health").json()["status"] == "ok"
    assert server.core.steps - steps <= 2 + int(time.monotonic() - t0)


def test_health_tells_a_wedged_pipeline_within_5_s(engine):
    s = LiveServer(engine, ServerOptions())
    try:
        assert s.get("/health").status_code == 200
        time.sleep(1.1)  # the last step is no longer fresh
        s.pipe.wedged.set()
        t0 = time.monotonic()
        r = s.get("/health")
        assert time.monotonic() - t0 < 6.5
        assert r.status_code == 503 and "no pipeline step" in r.json()["error"], r.text
    finally:
        s.stop()


def test_metrics_need_key(engine, server):
    for path in ("/health", "/metrics"):
        assert server.get(path).status_code == 200  # without --metrics-need-key: open
    s = LiveServer(engine, ServerOptions(api_keys=KEYS, metrics_need_key=True))
    try:
        for path in ("/health", "/metrics"):
            assert_error(s.get(path), 401, code="invalid_api_key")
            assert s.get(path, key=KEYS[1]).status_code == 200
    finally:
        s.stop()


# -- clients that leave, and fair shares -----------------------------------------------------------------

def test_every_key_opens_v1_and_counts_as_its_own_client(server, monkeypatch):
    seen = []
    add = server.aengine.add

    async def recording(req):
        seen.append(req.client)
        return await add(req)

    monkeypatch.setattr(server.aengine, "add", recording)
    for key in KEYS:
        assert server.post("/v1/completions", json=completion(), key=key).status_code == 200
    assert_error(server.post("/v1/completions", json=completion(), key="key-c"), 401)
    assert seen == ["key:0", "key:1"]


def test_a_client_that_leaves_before_the_first_event_ends_its_request(server):
    """Streaming, with the client gone before anything was sent: the request must be aborted,
    not decoded to max_tokens for nobody."""
    idle(server)
    aborted = server.metrics._success.labels(NAME, "abort")
    before = aborted._value.get()

    async def leave_at_once():
        _reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        body = b'{"model": "tiny", "prompt": "the cat", "max_tokens": 900, "ignore_eos": true, "stream": true}'
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer key-a\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()  # gone before the first event
        await writer.wait_closed()

    asyncio.run(leave_at_once())
    deadline = time.monotonic() + 20
    while aborted._value.get() == before:
        assert time.monotonic() < deadline, "the request decoded on for nobody"
        time.sleep(0.05)
    idle(server)


def test_an_event_stream_cancels_its_request_even_if_its_generator_never_ran():
    """Starlette cancels a streaming response when the client leaves; if that happens while it
    sends the headers, the events' generator never starts and its `finally` (which cancelled the
    request) never runs. The response itself must cancel the request."""
    from specpipe.entrypoints.openai.api_server import _EventStream

    class Stream:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    async def main():
        stream = Stream()

        async def events():
            try:
                await asyncio.sleep(10)
                yield "data: x\n\n"
            finally:
                stream.cancel()

        async def receive():
            return {"type": "http.disconnect"}  # the client is already gone

        async def send(_message):
            await asyncio.sleep(0)  # a send that yields, as one through a middleware does

        await _EventStream(stream, events())({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        return stream.cancelled

    assert asyncio.run(main())


# -- the published schema ------------------------------------------------------------------------------

def test_openapi_declares_the_errors_each_route_sends(server):
    schema = server.get("/openapi.json").json()
    assert "422" not in str(schema["paths"]) and "HTTPValidationError" not in str(schema)
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429", "500", "503"} <= set(responses), path
        assert responses["413"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert "text/event-stream" in responses["200"]["content"]
    assert "401" in schema["paths"]["/v1/models"]["get"]["responses"]
    assert "503" in schema["paths"]["/health"]["get"]["responses"]


def test_refused_bodies_are_drained_at_a_bounded_pace_over_all_connections(monkeypatch):
    """Reading refused bodies takes the event loop every stream shares: a client posting 8 MB
    bodies in a loop made another stream pause 20x its usual gap (benchmarks/isolation.py) until
    the draining was paced, over all refused bodies together."""
    import asyncio

    from specpipe.entrypoints.openai import middleware

    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    monkeypatch.setattr(middleware.time, "monotonic", lambda: 100.0)  # no time passes by itself
    monkeypatch.setattr(middleware.asyncio, "sleep", sleep)
    monkeypatch.setattr(middleware, "DRAIN_BYTES_PER_S", 1 << 20)
    limit = middleware.BodyLimit(app=None, limit=10)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    def client(chunks: int):
        messages = [{"type": "http.request", "body": b"x" * (1 << 20), "more_body": i + 1 < chunks}
                    for i in range(chunks)]

        async def receive():
            return messages.pop(0)
        return receive

    async def two_clients():
        headers = [(b"content-length", str(3 << 20).encode())]
        await limit({"type": "http", "headers": headers}, client(3), send)
        await limit({"type": "http", "headers": headers}, client(3), send)

    asyncio.run(two_clients())
    # 6 MiB at 1 MiB/s in all: the second client's bytes wait behind the first's
    assert slept == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [413, 413]
