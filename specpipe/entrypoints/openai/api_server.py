"""`specpipe serve`: the OpenAI-compatible HTTP server.

    uvicorn (event loop) --BodyLimit, API key--> routes --> OpenAIServing --add/abort--> AsyncEngine
                                                             (engine thread) --step()--> stages

Routes: /v1/completions, /v1/chat/completions (streaming as server-sent events), /v1/messages
(Anthropic's Messages API, anthropic_api.py), /v1/responses (OpenAI's Responses API,
responses_api.py), /v1/models,
/tokenize, /detokenize and /tokenizer_info (vLLM's), /health, /metrics (Prometheus). With
--api-key every /v1 route and /tokenize, /detokenize, /tokenizer_info want `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`)
(and /health and /metrics too with --metrics-need-key). Every error has OpenAI's body, and the
OpenAPI schema declares, per route, the statuses it can answer with.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specpipe import __version__
from specpipe.engine.async_engine import AsyncEngine
from specpipe.engine.engine import Engine
from specpipe.engine.metrics import EngineMetrics
from specpipe.entrypoints.openai import protocol as p
from specpipe.entrypoints.openai.anthropic_api import (AnthropicServing, CountTokensRequest, MessagesRequest,
                                                       error_body as anthropic_error)
from specpipe.entrypoints.openai.responses_api import ResponsesRequest, ResponsesServing
from specpipe.entrypoints.openai.connections import HEADER_TIMEOUT_S, MAX_CONNECTIONS_PER_CLIENT, http_protocol
from specpipe.entrypoints.openai.middleware import DEFAULT_MAX_BODY_BYTES, BodyLimit, key_index
from specpipe.entrypoints.openai.serving import ApiError, OpenAIServing

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
HEALTH_TIMEOUT_S = 5.0  # /health answers within this: a pipeline that does not step by then is unhealthy


@dataclass(frozen=True)
class ServerOptions:
    api_keys: tuple[str, ...] = ()  # any of them opens /v1; each key is one client for fair admission
    metrics_need_key: bool = False  # the keys guard /health and /metrics too
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies get 413 before they are parsed
    max_concurrency: Optional[int] = None  # uvicorn's limit_concurrency: beyond it, a bare 503
    header_timeout_s: float = HEADER_TIMEOUT_S  # a request head not complete by then: the connection is closed
    max_connections_per_client: Optional[int] = MAX_CONNECTIONS_PER_CLIENT  # open at once from one address
    fenced_tool_calls: bool = True  # tool_choice auto also reads a ```json fenced call (--strict-tool-calls: off)


ERROR_STATUSES = {
    400: "Malformed body, wrong type, out-of-range or unsupported value, or over a limit (the field is `param`)",
    401: "Missing or wrong API key",
    404: "Unknown model",
    413: "Request body over --max-body-bytes",
    429: "The waiting queue is full (--max-queue), or this client's share of it (--max-queue-per-client)",
    500: "The request failed inside the engine",
    503: "The engine cannot serve (a stage failed, or it stalled); beyond --max-concurrency uvicorn answers "
         "a bare text/plain 503",
}


def _errors(*statuses: int, plain_503: bool = False) -> dict:
    out = {s: {"model": p.ErrorResponse, "description": ERROR_STATUSES[s]} for s in statuses}
    if plain_503 and 503 in out:  # uvicorn's own answer beyond --max-concurrency
        out[503]["content"] = {"text/plain": {"schema": {"type": "string", "example": "Service Unavailable"}}}
    return out


STREAM_200 = {200: {"description": "The whole response, or with `stream: true` server-sent events (one JSON chunk "
                                   "per `data:` line, `data: [DONE]` last)",
                    # One server-sent event (as OpenAPI 3.2's itemSchema reads it): its data is a chunk or [DONE].
                    "content": {"text/event-stream": {"schema": {
                        "type": "object", "required": ["data"],
                        "properties": {"data": {"type": "string", "description": "a JSON chunk, or [DONE]"}}}}}}}


def build_app(engine: Engine, aengine: AsyncEngine, metrics: EngineMetrics, model_names: Union[str, Sequence[str]],
              options: ServerOptions = ServerOptions()) -> FastAPI:
    """`model_names`: the name clients use, or several (any of them is served)."""
    app = FastAPI(title="SpecPipe", version=__version__, docs_url=None, redoc_url=None)
    serving = OpenAIServing(engine, aengine, model_names, fenced_tool_calls=options.fenced_tool_calls)
    app.state.serving = serving  # serve() closes its tokenizer threads
    keys = options.api_keys
    guarded = ("/v1", "/tokenize", "/detokenize") + (("/health", "/metrics") if options.metrics_need_key else ())
    key_errors = (401,) if keys else ()
    status_key_errors = key_errors if options.metrics_need_key else ()

    app.add_middleware(BodyLimit, limit=options.max_body_bytes)

    def key_of(request: Request) -> Optional[int]:
        """Which key the request carries: `Authorization: Bearer KEY`, or Anthropic's `x-api-key`."""
        i = key_index(request.headers.get("authorization", ""), keys)
        if i is None and "x-api-key" in request.headers:
            i = key_index(f"Bearer {request.headers['x-api-key']}", keys)
        return i

    @app.middleware("http")  # added last, so it runs first: no body is read for a request without a key
    async def check_api_key(request: Request, call_next):
        if keys and request.url.path.startswith(guarded):
            if key_of(request) is None:
                e = ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY, or x-api-key: KEY)",
                             code="invalid_api_key")
                if request.url.path.startswith("/v1/messages"):
                    return JSONResponse(anthropic_error(e), status_code=401)
                return _error(e)
        return await call_next(request)

    def client_of(request: Request) -> str:
        """Who a request counts against for fair admission: its API key, else its address."""
        i = key_of(request) if keys else None
        if i is not None:
            return f"key:{i}"
        return f"addr:{request.client.host}" if request.client else "addr:?"

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, e: RequestValidationError):
        if request.url.path.startswith("/v1/messages"):  # Anthropic's route answers in Anthropic's shape
            return JSONResponse(anthropic_error(_validation_error(e)), status_code=400)
        return _error(_validation_error(e))  # FastAPI's 422 becomes OpenAI's 400

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException):
        r = _error(ApiError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None))
        r.headers.update(e.headers or {})  # e.g. a 405's Allow, which HTTP requires
        return r

    @app.get("/health", response_model=p.HealthResponse, response_model_exclude_none=True,
             responses={503: {"model": p.HealthResponse, "description": "The engine cannot serve: `error` says why"},
                        **_errors(*status_key_errors)})
    async def health():
        # The truth within HEALTH_TIMEOUT_S: a stage that died while the server was idle, or a
        # pipeline that stopped stepping, is unhealthy; it costs at most about a step a second.
        problem = await aengine.check(HEALTH_TIMEOUT_S)
        stages = engine.placement()
        if problem is not None:
            return JSONResponse({"status": "unhealthy", "error": problem, "stages": stages,
                                 "kernels": engine.kernel_report()}, status_code=503)
        return {"status": "ok", "stages": stages, "kernels": engine.kernel_report()}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=Response, responses={
        200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"},
        **_errors(*status_key_errors)})
    async def prometheus_metrics():
        # The stages' last report (refreshed on ordinary steps): a scrape never costs a step.
        metrics.set_stages(aengine.latest_stage_stats)
        metrics.placement = engine.placement()
        metrics.kernels = engine.kernel_report()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=_errors(*key_errors))
    async def models() -> p.ModelList:
        return serving.models()

    @app.post("/tokenize", response_model=p.TokenizeResponse, response_model_exclude_none=True,
              responses=_errors(400, *key_errors, 404, 413))
    async def tokenize(body: p.TokenizeRequest):
        return await serving.tokenize(body)

    @app.post("/detokenize", response_model=p.DetokenizeResponse, responses=_errors(400, *key_errors, 404, 413))
    async def detokenize(body: p.DetokenizeRequest):
        return await serving.detokenize(body)

    @app.get("/tokenizer_info", responses=_errors(*key_errors))  # guarded: it starts with /tokenize
    async def tokenizer_info() -> p.TokenizerInfo:
        return serving.tokenizer_info()

    generation_errors = {**STREAM_200, **_errors(400, *key_errors, 404, 413, 429, 500, 503,
                                                 plain_503=options.max_concurrency is not None)}

    @app.post("/v1/completions", response_model=p.CompletionResponse, responses=generation_errors)
    async def completions(body: p.CompletionRequest, request: Request):
        stream = await serving.completion_stream(body, client_of(request))
        return await _respond(request, body, stream, serving.completion_events, serving.completion)

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=generation_errors)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        stream = await serving.chat_stream(body, client_of(request))
        return await _respond(request, body, stream, serving.chat_events, serving.chat)

    anthropic = AnthropicServing(serving)

    @app.post("/v1/messages", responses={**STREAM_200, **_errors(400, *key_errors, 404, 413, 429, 500, 503)})
    async def messages(body: MessagesRequest, request: Request):
        """Anthropic's Messages API (anthropic_api.py); its errors in Anthropic's shape."""
        try:
            stream = await anthropic.start(body, client_of(request))
            if body.stream:
                return _EventStream(stream, anthropic.events(body, stream))
            return await _unless_disconnected(request, anthropic.whole(body, stream), stream)
        except ApiError as e:
            return JSONResponse(anthropic_error(e), status_code=e.status)

    responses_api = ResponsesServing(serving)

    @app.post("/v1/responses", responses=generation_errors)
    async def responses(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API (responses_api.py)."""
        stream = await responses_api.start(body, client_of(request))
        if body.stream:
            return _EventStream(stream, responses_api.events(body, stream))
        return await _unless_disconnected(request, responses_api.whole(body, stream), stream)

    @app.post("/v1/messages/count_tokens", responses=_errors(400, *key_errors, 404, 413))
    async def count_tokens(body: CountTokensRequest):
        """Anthropic's token count of a Messages request's prompt."""
        try:
            return await anthropic.count_tokens(body)
        except ApiError as e:
            return JSONResponse(anthropic_error(e), status_code=e.status)

    def openapi() -> dict:
        """FastAPI's schema, less the 422 it adds to every route with a body: this server answers
        a body it cannot validate with a 400 (declared on each route). Limits that depend on the
        model served are filled in: token ids below its vocabulary, prompts of token ids and
        max_tokens within its context."""
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema["paths"].values():
                for operation in path.values():
                    operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            models = schema["components"]["schemas"]
            _bound(models["CompletionRequest"]["properties"]["prompt"], engine.prompts.vocab_size - 1,
                   engine.max_context - 1)
            for name, key in (("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_tokens"),
                              ("ChatCompletionRequest", "max_completion_tokens"), ("MessagesRequest", "max_tokens"),
                              ("ResponsesRequest", "max_output_tokens")):
                for branch in models[name]["properties"][key].get("anyOf", [models[name]["properties"][key]]):
                    if branch.get("type") == "integer":
                        branch["maximum"] = engine.max_context - 1
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


async def _respond(request: Request, body: p.SamplingFields, stream, events, whole):
    """Server-sent events for `stream: true`, else the whole response once it is done."""
    if body.stream:
        return _EventStream(stream, events(stream, body.include_usage))
    return await _unless_disconnected(request, whole(stream), stream)


class _EventStream(StreamingResponse):
    """Server-sent events that cancel their request however the response ends. The events'
    generator cancels it too, but only once it has started: a client that leaves before the first
    event may stop the response before the generator ever runs."""

    def __init__(self, stream, events) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._stream = stream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.cancel()


async def _unless_disconnected(request: Request, work, stream):
    """Await `work` (a whole response), but cancel the request if the client goes away first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            stream.cancel()
            return Response(status_code=499)  # nobody reads it
        return task.result()
    finally:
        gone.cancel()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _bound(node, max_id: int, max_items: int) -> None:
    """Token ids (integers with minimum 0) at most `max_id`, lists of them at most `max_items` long."""
    if isinstance(node, list):
        for item in node:
            _bound(item, max_id, max_items)
    elif isinstance(node, dict):
        if node.get("type") == "integer" and node.get("minimum") == 0:
            node["maximum"] = max_id
        if node.get("type") == "array" and node.get("items", {}).get("type") == "integer":
            node["maxItems"] = max_items
        for value in node.values():
            _bound(value, max_id, max_items)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body.model_dump(), status_code=e.status)


def _validation_error(e: RequestValidationError) -> ApiError:
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "))
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")  # our own validators' messages
    return ApiError(400, f"{param}: {msg}" if param else msg, param=param)


# -- the command ------------------------------------------------------------------------------------
def serve(config, host: str, port: int, options: ServerOptions, model_name: Union[None, str, Sequence[str]],
          log_level: str = "info", rank_env=None) -> int:
    """Bind the port, load the model and bring up the stages, then serve until Ctrl-C / SIGTERM."""
    sock = _bind(host, port)  # before the (slow) model load: a taken port fails at once
    say = lambda msg: print(f"specpipe: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if config.device == "cpu":
        from specpipe.kernels import native

        native.report_unavailable(lambda msg: say(f"warning: {msg}"))
    engine = Engine(config, rank_env=rank_env, progress=say)
    names = ((model_name,) if isinstance(model_name, str) else tuple(model_name or ())) or \
        (_default_name(engine.model_path),)
    name = names[0]  # the one metrics and the log use
    aengine: Optional[AsyncEngine] = None
    app: Optional[FastAPI] = None
    try:
        metrics = EngineMetrics(lambda: aengine.snapshot, lambda: aengine.dead is None, name)
        # A healthy step may take up to the stage timeout: only a longer wait is a stalled engine.
        aengine = AsyncEngine(engine.core(), observer=metrics, admit_timeout_s=config.stage_timeout_s + 10.0)
        app = build_app(engine, aengine, metrics, names, options)
        bound_host, bound_port = sock.getsockname()[:2]
        stages = engine.pipeline.num_stages  # as planned and started (config.stages may be 0: "plan it")
        server = _Server(uvicorn_config(app, options, log_level), lambda: say(
            f"serving {name!r} ({config.mode}, {stages} stage{'s' if stages != 1 else ''}) "
            f"on http://{bound_host}:{bound_port}"))
        # uvicorn stops on Ctrl-C or SIGTERM and then raises the signal again; as KeyboardInterrupt
        # both end here, so the stages are shut down instead of the process dying on the spot.
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            pass
        say("server stopped")
    finally:
        if app is not None:
            app.state.serving.close()
        if aengine is not None:
            aengine.shutdown()
        engine.close()
    return 0


def uvicorn_config(app: FastAPI, options: ServerOptions, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for the app: its h11 protocol with the head deadline and the bound per
    client address (connections.py), and --max-concurrency."""
    # uvicorn counts the arriving connection itself against limit_concurrency: + 1, so that
    # --max-concurrency N serves N connections at once.
    limit = options.max_concurrency + 1 if options.max_concurrency is not None else None
    return uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10, limit_concurrency=limit,
                          http=http_protocol(options.header_timeout_s, options.max_connections_per_client))


class _Server(uvicorn.Server):
    """uvicorn's server, which says it serves once its socket listens (a client that reads the
    line and connects at once is never refused)."""

    def __init__(self, config: uvicorn.Config, on_listening) -> None:
        super().__init__(config)
        self._on_listening = on_listening

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_listening()


def _interrupt(_signum, _frame) -> None:
    raise KeyboardInterrupt


def _bind(host: str, port: int) -> socket.socket:
    from specpipe.config import ConfigError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _default_name(path: Path) -> str:
    return path.stem if path.suffix == ".gguf" else path.name
