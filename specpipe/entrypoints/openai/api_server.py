"""`specpipe serve`: the OpenAI-compatible HTTP server.

    uvicorn (event loop) --routes--> OpenAIServing --add/abort--> AsyncEngine (engine thread)
                                                                   --step()--> stages

Routes: /v1/completions, /v1/chat/completions (streaming as server-sent events), /v1/models,
/health, /metrics (Prometheus). With --api-key every /v1 route wants `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from specpipe import __version__
from specpipe.engine.async_engine import AsyncEngine
from specpipe.engine.engine import Engine
from specpipe.engine.metrics import EngineMetrics
from specpipe.entrypoints.openai import protocol as p
from specpipe.entrypoints.openai.serving import ApiError, OpenAIServing

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def build_app(engine: Engine, aengine: AsyncEngine, metrics: EngineMetrics, model_name: str,
              api_key: Optional[str] = None) -> FastAPI:
    app = FastAPI(title="SpecPipe", version=__version__, docs_url=None, redoc_url=None)
    serving = OpenAIServing(engine, aengine, model_name)
    health_timeout = engine.config.stage_timeout_s + 5.0

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)",
                                       code="invalid_api_key"))
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request: Request, e: RequestValidationError):
        return _error(_validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, e: StarletteHTTPException):
        return _error(ApiError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None))

    @app.get("/health")
    async def health():
        # A round trip through every stage (a report rides on the next step), so a stage that died
        # while the server was idle is noticed here too.
        await aengine.stage_stats(health_timeout)
        if aengine.dead is not None:
            return JSONResponse({"status": "unhealthy", "error": aengine.dead}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics():
        metrics.set_stages(await aengine.stage_stats(health_timeout))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> p.ModelList:
        return serving.models()

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request):
        stream = await serving.completion_stream(body)
        return await _respond(request, body, stream, serving.completion_events, serving.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        stream = await serving.chat_stream(body)
        return await _respond(request, body, stream, serving.chat_events, serving.chat)

    return app


async def _respond(request: Request, body: p.SamplingFields, stream, events, whole):
    """Server-sent events for `stream: true`, else the whole response once it is done."""
    if body.stream:
        return StreamingResponse(events(stream, body.include_usage), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    return await _unless_disconnected(request, whole(stream), stream)


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


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body.model_dump(), status_code=e.status)


def _validation_error(e: RequestValidationError) -> ApiError:
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "))
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    return ApiError(400, f"{param}: {msg}" if param else msg, param=param)


# -- the command ------------------------------------------------------------------------------------
def serve(config, host: str, port: int, api_key: Optional[str], model_name: Optional[str],
          log_level: str = "info", rank_env=None) -> int:
    """Bind the port, load the model and bring up the stages, then serve until Ctrl-C / SIGTERM."""
    import uvicorn

    sock = _bind(host, port)  # before the (slow) model load: a taken port fails at once
    say = lambda msg: print(f"specpipe: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    engine = Engine(config, rank_env=rank_env, progress=say)
    name = model_name or _default_name(engine.model_path)
    aengine: Optional[AsyncEngine] = None
    try:
        metrics = EngineMetrics(lambda: aengine.snapshot, lambda: aengine.dead is None, name)
        aengine = AsyncEngine(engine.core(), observer=metrics)
        app = build_app(engine, aengine, metrics, name, api_key)
        bound_host, bound_port = sock.getsockname()[:2]
        say(f"serving {name!r} ({config.mode}, {config.stages} stage{'s' if config.stages > 1 else ''}) "
            f"on http://{bound_host}:{bound_port}")
        server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=10))
        # uvicorn stops on Ctrl-C or SIGTERM and then raises the signal again; as KeyboardInterrupt
        # both end here, so the stages are shut down instead of the process dying on the spot.
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:
            pass
        say("server stopped")
    finally:
        if aengine is not None:
            aengine.shutdown()
        engine.close()
    return 0


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
