"""The engine core in a thread of its own, for servers: requests come and go from asyncio code,
each with its own queue of outputs, while one thread runs the step loop and another makes text.

    handler --add(req)------> inbox --(engine thread: add_request / abort / stop / report)--> step()
    handler <--Delta--------- the request's asyncio.Queue <--(output thread: detokenize, stop
                              strings) <--(engine thread, after every step: new token ids)

As in vLLM v1, the step never detokenizes: the output thread turns each request's new ids into
text and matches its stop strings; when one appears it ends the stream there (ids after it are
dropped, so the output is what a step-by-step match gives) and tells the engine to stop the
request ("stop" in the inbox), which costs at most the tokens of the steps in between.

A slow client only lets its own queue grow: the step loop never waits for a reader. An error
that belongs to one request (its grammar, its drafting, its text) ends that request alone
(EngineCore.own_fault, and here `_handle_one` and `_run_outputs`). When the pipeline itself
fails (a stage died), every request in it ends with the error, `dead` says why (in the log and
in /health), and new requests are refused; the thread stays up to answer them.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Optional, Protocol

from specpipe.config import ConfigError
from specpipe.engine.core import EngineCore
from specpipe.request import Request
from specpipe.sched.scheduler import QueueFull

STAGE_REPORT_EVERY_S = 1.0  # the stages' counters ride on an ordinary step at most this often
HEALTH_FRESH_S = 1.0  # a step that ended this recently proves that every stage answers

log = logging.getLogger("specpipe.engine")


class EngineDead(RuntimeError):
    """The pipeline failed; the message names the stage. No request can be served any more."""


class AdmitFailed(RuntimeError):
    """Taking this one request in failed inside the engine (a bug); the engine serves on."""


class EngineStalled(RuntimeError):
    """The engine thread did not take the request in time (a step that does not end)."""


@dataclass
class Delta:
    """What one request decoded since its last Delta. The last one has `finish_reason` set
    (stop | length | abort | error; `error` says what went wrong)."""

    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None
    error: Optional[str] = None


@dataclass
class EngineSnapshot:
    """Levels the step loop publishes after each step (read by the metrics)."""

    running: int = 0
    waiting: int = 0
    steps: int = 0
    kv_blocks_used: int = 0  # the scheduler's view of the pool (the stages report their own)
    kv_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (None: caching off)
    prefix_cache_hits: int = 0  # ... and found there
    prefix_caching: bool = False


class Observer(Protocol):
    """Metrics hooks, called on the engine thread."""

    def on_admit(self, req: Request) -> None: ...

    def on_tokens(self, req: Request, n: int, gap_s: Optional[float]) -> None: ...

    def on_finish(self, req: Request) -> None: ...

    def on_step(self, seconds: float) -> None: ...


@dataclass
class _Stream:
    """The engine thread's end of one request: text not yet delivered and how far it got."""

    req: Request
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent: int = 0  # output tokens handed to the output thread
    last_emit: Optional[float] = None  # when the output thread last delivered tokens (only it uses this)
    over: bool = False  # the output thread delivered its last Delta (only it reads this)

    def put(self, delta: Delta) -> None:
        _call_soon(self.loop, self.queue.put_nowait, delta)


class RequestStream:
    """The caller's end: iterate for Deltas; `cancel()` (idempotent) aborts the request if it is
    still running, so its KV is freed at every stage on the next step. What the Deltas carried
    adds up in `text`, `token_ids`, `finish_reason` and `error` (read these, not the Request's
    fields, which the engine thread may still be settling)."""

    def __init__(self, engine: "AsyncEngine", req: Request, queue: asyncio.Queue) -> None:
        self._engine, self.req, self._queue = engine, req, queue
        self.done = False
        self.text, self.token_ids = "", []
        self.finish_reason: Optional[str] = None
        self.error: Optional[str] = None

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> Delta:
        if self.done:
            raise StopAsyncIteration
        delta = await self._queue.get()
        self.done = delta.finish_reason is not None
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.finish_reason, self.error = delta.finish_reason, delta.error
        return delta

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self._engine.abort(self.req.request_id)


class AsyncEngine:
    def __init__(self, core: EngineCore, observer: Optional[Observer] = None, admit_timeout_s: float = 60.0) -> None:
        """`admit_timeout_s`: how long `add` waits for the engine thread to take a request; it
        should outlast the longest healthy step (the stage timeout)."""
        self.core = core
        self.admit_timeout_s = admit_timeout_s
        self.last_step_end: Optional[float] = None  # time.monotonic() of the last completed step
        self._last_report = float("-inf")
        self.observer = observer
        self.dead: Optional[str] = None
        self.snapshot = EngineSnapshot(kv_blocks=core.scheduler.blocks.num_blocks)
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []
        self._stopping = False
        self._streams: dict[int, _Stream] = {}
        self._report_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()  # (stream, Delta of ids) for the output thread
        self._thread = threading.Thread(target=self._run, name="specpipe-engine", daemon=True)
        self._thread.start()
        self._output_thread = threading.Thread(target=self._run_outputs, name="specpipe-output", daemon=True)
        self._output_thread.start()

    # -- the asyncio side -------------------------------------------------------------------------
    async def add(self, req: Request) -> RequestStream:
        """Queue `req`; returns its stream once the engine has taken it. Raises QueueFull (the
        waiting queue is at --max-queue), ConfigError (it can never fit the KV pool),
        EngineDead, AdmitFailed or EngineStalled."""
        loop = asyncio.get_running_loop()
        admitted: asyncio.Future = loop.create_future()
        queue: asyncio.Queue = asyncio.Queue()
        stream = _Stream(req, loop, queue)
        self._post(("add", stream, admitted))
        try:
            await asyncio.wait_for(admitted, self.admit_timeout_s)
        except asyncio.TimeoutError:
            self.abort(req.request_id)  # in case the thread takes it after all
            raise EngineStalled(f"the engine did not take the request within {self.admit_timeout_s:g} s") from None
        except asyncio.CancelledError:
            self.abort(req.request_id)  # the client left while it was being admitted
            raise
        return RequestStream(self, req, queue)

    def abort(self, request_id: int) -> None:
        self._post(("abort", request_id))

    async def stage_stats(self, timeout_s: float = 5.0) -> Optional[list[dict]]:
        """The stages' counters, asked for on the next step (the last report if that takes longer
        than `timeout_s`, or if the pipeline has failed)."""
        if self.dead is None:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future = loop.create_future()
            self._post(("report", loop, fut))
            try:
                return await asyncio.wait_for(fut, timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.core.stage_stats

    async def check(self, timeout_s: float = 5.0) -> Optional[str]:
        """None while the engine serves, else why not; answers within `timeout_s`. A step that
        ended in the last HEALTH_FRESH_S proves every stage answers; otherwise one is asked for,
        shared by every caller asking at the same time (so polling makes at most about one step a
        second). No step within `timeout_s` is a wedged engine, not a healthy one."""
        if self.dead is not None:
            return self.dead
        if not self._thread.is_alive():
            return "the engine thread has stopped"
        if self.last_step_end is not None and time.monotonic() - self.last_step_end < HEALTH_FRESH_S:
            return None
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._post(("report", loop, fut))
        try:
            await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            return self.dead or f"no pipeline step completed within {timeout_s:g} s"
        return self.dead

    @property
    def latest_stage_stats(self) -> Optional[list[dict]]:
        """The stages' last report: refreshed on ordinary steps (at most every
        STAGE_REPORT_EVERY_S, and when the engine goes idle), never at a reader's request."""
        return self.core.stage_stats

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """End every request (abort) and stop the thread; the caller closes the pipeline."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)
        self._outputs.put(None)
        self._output_thread.join(timeout_s)

    def _post(self, item: tuple) -> None:
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._stopping or (self.dead is None and self.core.has_work())):
                    self._cond.wait()
                items, self._inbox = self._inbox, []
                stopping = self._stopping
            for item in items:
                self._handle_one(item)
            try:
                if stopping:
                    self._end_all("abort", "the server is shutting down")
                    self._emit()
                    return
                if self.dead is None and self.core.has_work():
                    self._step()
                self._emit()
            except Exception as e:  # noqa: BLE001  (a bug here must not leave requests hanging)
                traceback.print_exc()
                self._die(f"internal error in the engine loop: {e!r}")
                self._emit()

    def _handle_one(self, item: tuple) -> None:
        """One inbox item. An error fails that item alone and its caller hears of it: the rest of
        the batch is still handled, so no caller is left waiting on a future nobody resolves."""
        try:
            self._handle(item)
        except Exception as e:  # noqa: BLE001  (a bug in one request must not take the others down)
            traceback.print_exc()
            if item[0] == "add":
                _, stream, admitted = item
                rid = stream.req.request_id
                if self._streams.get(rid) is stream:
                    del self._streams[rid]
                self.core.abort(rid, "error", f"internal error: {e!r}")  # a no-op unless it got in
                _call_soon(stream.loop, _resolve, admitted, AdmitFailed(f"internal error admitting the request: {e!r}"))
            elif item[0] == "report":
                _, loop, fut = item
                _call_soon(loop, _resolve, fut, None, self.core.stage_stats)

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "add":
            _, stream, admitted = item
            try:
                if self.dead is not None:
                    raise EngineDead(self.dead)
                self.core.add_request(stream.req)
            except (QueueFull, ConfigError, ValueError, EngineDead) as e:
                _call_soon(stream.loop, _resolve, admitted, e)
                return
            self._streams[stream.req.request_id] = stream
            if self.observer is not None:
                self.observer.on_admit(stream.req)
            _call_soon(stream.loop, _resolve, admitted, None)
        elif kind == "abort":
            self.core.abort(item[1], "abort")
        elif kind == "stop":  # the output thread found a stop string after `kept` output ids
            _, req, kept = item
            self.core.abort(req.request_id, "stop")
            req.keep(kept)
        elif kind == "report":
            _, loop, fut = item
            if self.dead is not None:
                _call_soon(loop, _resolve, fut, None, self.core.stage_stats)
            else:
                self.core.request_stage_stats()
                self._report_waiters.append((loop, fut))

    def _step(self) -> None:
        now = time.monotonic()
        # Stage counters for /metrics ride on a step that runs anyway: at most every
        # STAGE_REPORT_EVERY_S, and on the step that delivers the last releases (so an idle
        # engine shows its KV freed). A scrape never costs a step.
        if now - self._last_report >= STAGE_REPORT_EVERY_S or not self.core.scheduler.has_work():
            self.core.request_stage_stats()
            self._last_report = now
        t0 = time.perf_counter()
        try:
            self.core.step()
        except Exception as e:  # noqa: BLE001  (the pipeline is gone: fail everyone, stay up to refuse)
            log.error("the pipeline failed; no request can be served", exc_info=True)
            self._die(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
        else:
            self.last_step_end = time.monotonic()
            if self.observer is not None:
                self.observer.on_step(time.perf_counter() - t0)
        sched = self.core.scheduler
        cache = sched.blocks.cache
        self.snapshot = EngineSnapshot(len(sched.running), len(sched.waiting), self.core.steps,
                                       sched.blocks.num_blocks - sched.blocks.pool.available(), sched.blocks.num_blocks,
                                       cache.stats.queries if cache else 0, cache.stats.hits if cache else 0,
                                       cache is not None)
        self._answer_reports()  # every waiter asked before this step, so the step carried the report

    def _answer_reports(self) -> None:
        waiters, self._report_waiters = self._report_waiters, []
        for loop, fut in waiters:
            _call_soon(loop, _resolve, fut, None, self.core.stage_stats)

    def _die(self, why: str) -> None:
        log.error("the engine is dead: %s", why)
        self.dead = why
        self._end_all("error", why)
        self._answer_reports()

    def _end_all(self, reason: str, error: str) -> None:
        for rid in list(self.core.requests):
            self.core.abort(rid, reason, error)

    def _emit(self) -> None:
        """Hand the output thread every request's ids since the last call; finished ones leave."""
        for rid, st in list(self._streams.items()):
            req = st.req
            n = len(req.output_ids)
            if n == st.sent and not req.finished:
                continue
            new = req.output_ids[st.sent:n]
            st.sent = n
            self._outputs.put((st, Delta("", new, req.finish_reason, req.error)))
            if req.finished:
                del self._streams[rid]
                if self.observer is not None:
                    self.observer.on_finish(req)

    # -- the output thread --------------------------------------------------------------------------
    def _run_outputs(self) -> None:
        while (item := self._outputs.get()) is not None:
            st, delta = item
            try:
                delta = self._text(st, delta)
            except Exception as e:  # noqa: BLE001  (a bug in one request's text must not hang its client)
                traceback.print_exc()
                self.abort(st.req.request_id)
                delta = Delta("", delta.token_ids, "error", f"internal error making the text: {e!r}")
            if delta is not None:
                # counted here, as delivered: a stop string found above drops the ids after it
                if delta.token_ids and self.observer is not None:
                    now = time.perf_counter()
                    self.observer.on_tokens(st.req, len(delta.token_ids),
                                            None if st.last_emit is None else now - st.last_emit)
                    st.last_emit = now
                st.over = delta.finish_reason is not None
                st.put(delta)

    def _text(self, st: _Stream, delta: Delta) -> Optional[Delta]:
        """The Delta with its text; None once the stream is over (a stop string ended it)."""
        out = st.req.output
        if st.over:
            return None
        if out is None:
            return delta
        seen = out.seen
        delta.text = out.feed(delta.token_ids, delta.finish_reason)
        if out.kept is not None:  # a stop string: the ids after it are dropped, the engine told
            self._post(("stop", st.req, out.kept))
            delta.token_ids = delta.token_ids[:out.kept - seen]
            delta.finish_reason, delta.error = "stop", None
        return delta


def _resolve(fut: asyncio.Future, error: Optional[BaseException], value=None) -> None:
    if not fut.done():
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the event loop has closed (server shutdown): nobody is waiting any more
