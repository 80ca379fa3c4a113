"""AsyncEngine: the step loop on its own thread, requests from asyncio code (what the server uses)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from specpipe.config import EngineConfig
from specpipe.distributed.remote_pipeline import PipelineError
from specpipe.engine.async_engine import AdmitFailed, AsyncEngine, EngineDead, EngineStalled
from specpipe.engine.core import EngineCore
from specpipe.engine.engine import Engine
from specpipe.sampling import SamplingParams
from specpipe.sched.scheduler import QueueFull

PROMPTS = ["hello there", "the cat sat on the mat, the cat sat", "a b c a b c a b", "one two three"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    e = Engine(EngineConfig(model=str(tiny_model_dir("llama", num_hidden_layers=2)), mode="specpipe-db",
                            stages=2, transport="inproc", kv_memory="8MiB", max_context=256, max_waiting=4))
    yield e
    e.close()


class FailingPipe:
    """The engine's pipeline, failing (as a dead stage does) from its `fail_at`-th collect on."""

    concurrent = False

    def __init__(self, pipe, fail_at: int) -> None:
        self.pipe, self.fail_at, self.calls = pipe, fail_at, 0
        self.num_stages = pipe.num_stages

    def __getattr__(self, name):  # the rest of the Pipeline protocol is the real pipeline's
        return getattr(self.pipe, name)

    def submit(self, control, rows):
        self.pipe.submit(control, rows)

    def collect(self):
        results = self.pipe.collect()  # keep the real pipeline in step
        self.calls += 1
        if self.calls >= self.fail_at:
            raise PipelineError("pipeline failed: stage 2 exited with signal 9; in-flight requests were aborted")
        return results


def alone(engine, prompt, n):
    return engine.generate(prompt, SamplingParams(max_tokens=n), chat=False, mode="pp")


async def collect(stream):
    text, ids, last = "", [], None
    async for d in stream:
        text, ids, last = text + d.text, ids + d.token_ids, d
    return text, ids, last.finish_reason


def test_streams_equal_alone_and_abort_frees_kv(engine):
    want = [alone(engine, p, 5 + 3 * i) for i, p in enumerate(PROMPTS)]
    aengine = AsyncEngine(engine.core())

    async def main():
        streams = [await aengine.add(engine.prompts.make_request(p, SamplingParams(max_tokens=5 + 3 * i), chat=False))
                   for i, p in enumerate(PROMPTS)]
        victim = await aengine.add(engine.prompts.make_request(PROMPTS[0], SamplingParams(max_tokens=200), chat=False))
        outs = await asyncio.gather(*[collect(s) for s in streams])
        first = await victim.__anext__()
        victim.cancel()  # the client went away
        stats = await aengine.stage_stats()
        return outs, first, stats

    try:
        outs, first, stats = asyncio.run(main())
    finally:
        aengine.shutdown()
    for (text, ids, reason), w in zip(outs, want):
        assert (text, ids, reason) == (w.text, w.token_ids, w.finish_reason)
    assert first.token_ids and first.finish_reason is None
    assert [s["blocks_in_use"] for s in stats] == [0, 0]  # the cancelled request's KV is gone everywhere
    assert not engine.core().has_work()


def spy_threads(req) -> set[str]:
    """The names of the threads that detokenize for `req`, filled as it runs."""
    names: set[str] = set()
    detok = req.output.detokenizer
    add = detok.add

    def spied(token):
        names.add(threading.current_thread().name)
        return add(token)

    detok.add = spied
    return names


def stop_case(engine, prompt):
    """Sampling with a stop string taken from the middle of what `prompt` gives, and the result."""
    text = alone(engine, prompt, 24).text
    params = SamplingParams(max_tokens=24, stop=(text[len(text) // 2:len(text) // 2 + 2],))
    want = engine.generate(prompt, params, chat=False, mode="pp")
    assert want.finish_reason == "stop" and text.startswith(want.text) and len(want.text) <= len(text) // 2
    return params, want


def test_text_is_made_off_the_engine_thread_and_stop_strings_still_cut(engine):
    """Before, Request.append detokenized and matched stop strings on the engine thread, inside
    the step. Now the output thread does: same text, ids and finish reason as alone."""
    cases = [(p, *stop_case(engine, p)) for p in PROMPTS[:2]]
    aengine = AsyncEngine(engine.core())
    seen: list[set[str]] = []

    async def main():
        streams = []
        for prompt, params, _ in cases:
            req = engine.prompts.make_request(prompt, params, chat=False)
            seen.append(spy_threads(req))  # filled later, as the request runs
            streams.append(await aengine.add(req))
        outs = await asyncio.gather(*[collect(s) for s in streams])
        return outs, streams, await aengine.stage_stats()  # a step after the stops: the releases

    try:
        outs, streams, stats = asyncio.run(main())
    finally:
        aengine.shutdown()
    for (text, ids, reason), stream, (_, _, want) in zip(outs, streams, cases):
        assert (text, ids, reason) == (want.text, want.token_ids, "stop")
        assert (stream.text, stream.token_ids, stream.finish_reason) == (text, ids, reason)
    assert seen == [{"specpipe-output"}] * len(cases)
    assert [s["blocks_in_use"] for s in stats] == [0, 0]  # the engine heard of the stops and freed the KV
    assert not engine.core().has_work()


def test_the_step_never_detokenizes(engine):
    """The offline loop makes text between steps (EngineCore.follow_text), never inside one."""
    params, want = stop_case(engine, PROMPTS[1])
    core = engine.core("pp")
    req = engine.prompts.make_request(PROMPTS[1], params, chat=False)
    calls = spy_threads(req)
    core.add_request(req)
    stopped = []
    while core.has_work():
        finished = core.step()
        assert not calls, "the step detokenized"
        stopped += core.follow_text(finished)
        calls.clear()
    assert stopped == [req]  # the stop string ended it, outside the step
    assert (req.text, req.output_ids, req.finish_reason) == (want.text, want.token_ids, "stop")


def test_queue_full_and_too_big(engine):
    core = EngineCore(engine.pipeline, "pp", kv_blocks=8, block_size=16, max_num_seqs=1, max_waiting=1,
                      pids=engine._pids)
    aengine = AsyncEngine(core)

    async def main():
        params = SamplingParams(max_tokens=80)  # fits what admission can grant (the pool above its watermark)
        first = await aengine.add(engine.prompts.make_request(PROMPTS[0], params, chat=False, ignore_eos=True))
        second = await aengine.add(engine.prompts.make_request(PROMPTS[1], params, chat=False, ignore_eos=True))
        with pytest.raises(QueueFull):
            await aengine.add(engine.prompts.make_request(PROMPTS[2], params, chat=False))
        with pytest.raises(ValueError, match="KV pool"):
            await aengine.add(engine.prompts.make_request(PROMPTS[2], SamplingParams(max_tokens=200), chat=False))
        first.cancel()
        second.cancel()
        await aengine.stage_stats()  # the releases have reached the stages

    try:
        asyncio.run(main())
    finally:
        aengine.shutdown()
    assert not core.has_work()


def test_a_failed_pipeline_ends_every_request_and_refuses_new_ones(tiny_model_dir):
    engine = Engine(EngineConfig(model=str(tiny_model_dir("llama", num_hidden_layers=2)), stages=2,
                                 transport="inproc", kv_memory="8MiB", max_context=256))
    pipe = FailingPipe(engine.pipeline, fail_at=1 << 30)
    core = EngineCore(pipe, "pp", kv_blocks=256, block_size=16)
    aengine = AsyncEngine(core)

    async def main():
        streams = [await aengine.add(engine.prompts.make_request(p, SamplingParams(max_tokens=50), chat=False, ignore_eos=True))
                   for p in PROMPTS[:3]]
        pipe.fail_at = pipe.calls + 4  # once all three run (on a loaded machine the adds take steps)
        outs = await asyncio.wait_for(asyncio.gather(*[collect(s) for s in streams]), 30)
        with pytest.raises(EngineDead, match="stage 2"):
            await aengine.add(engine.prompts.make_request(PROMPTS[0], SamplingParams(max_tokens=5), chat=False))
        return outs, [s.req.error for s in streams]

    try:
        outs, errors = asyncio.run(main())
    finally:
        aengine.shutdown()
        engine.close()
    assert [reason for _, _, reason in outs] == ["error"] * 3
    assert all("stage 2" in e for e in errors)
    assert aengine.dead is not None and "stage 2" in aengine.dead


def test_an_error_admitting_one_request_fails_it_alone(engine):
    """An error while handling one inbox item used to drop the rest of that batch: their callers
    waited forever on futures nobody resolved (and the engine died)."""
    core = engine.core()
    aengine = AsyncEngine(core)
    real_add = core.add_request

    def add_request(req):
        if req.sampling.max_tokens == 3:
            raise RuntimeError("a bug while adding")
        real_add(req)

    core.add_request = add_request  # instance attribute: only this core, only this test

    async def main():
        bad = engine.prompts.make_request(PROMPTS[0], SamplingParams(max_tokens=3), chat=False)
        good = engine.prompts.make_request(PROMPTS[1], SamplingParams(max_tokens=5), chat=False)
        with aengine._cond:  # hold the engine thread off: both land in one inbox batch
            tasks = [asyncio.ensure_future(aengine.add(r)) for r in (bad, good)]
            await asyncio.sleep(0.05)
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert isinstance(done[0], AdmitFailed) and "a bug while adding" in str(done[0])
        out = await asyncio.wait_for(collect(done[1]), 30)
        await aengine.stage_stats()  # the release has reached the stages
        return out

    try:
        text, ids, reason = asyncio.run(main())
    finally:
        del core.add_request
        aengine.shutdown()
    assert aengine.dead is None and len(ids) == 5 and reason == "length"
    assert not core.has_work()


def test_add_gives_up_when_the_engine_thread_does_not_answer(engine):
    """`await admitted` had no timeout: with the engine thread stuck, the caller hung forever."""
    core = EngineCore(engine.pipeline, "pp", kv_blocks=64, block_size=16, pids=engine._pids)
    aengine = AsyncEngine(core, admit_timeout_s=0.5)

    async def main():
        with aengine._cond:  # the engine thread cannot take anything from its inbox meanwhile
            with pytest.raises(EngineStalled):
                await asyncio.wait_for(aengine.add(engine.prompts.make_request(PROMPTS[0], SamplingParams(max_tokens=2),
                                                                       chat=False)), 10)

    try:
        asyncio.run(main())
    finally:
        aengine.shutdown()
    assert not core.has_work()  # the abort that followed the timeout reached it
