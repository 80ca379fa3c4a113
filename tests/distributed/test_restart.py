"""A stage process that dies mid-generation (killed, out of memory) costs no token: the engine
starts the stages again and recomputes every request in flight from prompt + output so far, so
each ends with exactly the tokens of an undisturbed run. With --restart-stages 0 the requests
end with an error naming the stage instead. Either way no process is left behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from proc_helpers import stage_pids, wait_gone
from specpipe.config import EngineConfig
from specpipe.distributed.remote_pipeline import PipelineError
from specpipe.engine.engine import Engine
from specpipe.sampling import SamplingParams

PROMPTS = ["the theatre in the sea", "a b c a b c a b", "one two three four"]
PARAMS = [SamplingParams(max_tokens=40), SamplingParams(temperature=0.8, seed=3, max_tokens=40),
          SamplingParams(max_tokens=30)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def config(model: str, **extra) -> EngineConfig:
    return EngineConfig(model=model, mode="specpipe-db", draft="ngram", tree_width=4, kv_memory="8MiB",
                        max_context=128, stage_threads=1, **extra)


@pytest.fixture(scope="module")
def undisturbed(model):
    engine = Engine(config(model, transport="inproc", stages=2))
    try:
        return [engine.generate(p, s, chat=False).token_ids for p, s in zip(PROMPTS, PARAMS)]
    finally:
        engine.close()


def serve_and_kill(engine: Engine, kill_at_step: int):
    """Serve PROMPTS together, SIGKILL stage 2 at the given step; the requests and the kill time."""
    core = engine.core()
    reqs = [engine.prompts.make_request(p, s, chat=False) for p, s in zip(PROMPTS, PARAMS)]
    killed_at, steps = None, 0

    def kill(_req=None):
        nonlocal killed_at
        pids = stage_pids(os.getpid())
        assert len(pids) == 2, pids
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()

    for r in reqs:
        core.add_request(r)
    error = None
    try:
        while core.has_work():
            core.step()
            steps += 1
            if steps == kill_at_step:
                assert all(r.output_ids and not r.finished for r in reqs)  # mid-generation
                kill()
    except PipelineError as e:
        error = e
        for rid in list(core.requests):
            core.abort(rid, "error", str(e))
    return reqs, killed_at, error


def test_a_killed_stage_is_restarted_and_no_token_is_lost(model, undisturbed):
    engine = Engine(config(model, stages=2, stage_timeout_s=10))
    try:
        reqs, _, error = serve_and_kill(engine, kill_at_step=6)
        assert error is None
        assert [r.output_ids for r in reqs] == undisturbed
        assert engine.core().stage_restarts == 1 and all(r.stats.stage_restarts == 1 for r in reqs)
        assert len(stage_pids(os.getpid())) == 2  # the new stages
    finally:
        engine.close()
    assert wait_gone(stage_pids(os.getpid()), 10) == []


def test_without_restarts_every_request_ends_with_an_error_naming_the_stage(model):
    timeout = 5.0
    engine = Engine(config(model, stages=2, stage_timeout_s=timeout, restart_stages=0))
    try:
        reqs, killed_at, error = serve_and_kill(engine, kill_at_step=6)
        assert error is not None and time.monotonic() - killed_at < timeout + 5
        assert all(r.finish_reason == "error" and "stage 2" in r.error for r in reqs), [r.error for r in reqs]
    finally:
        engine.close()
    assert wait_gone(stage_pids(os.getpid()), 10) == []


def test_streams_through_the_async_engine_survive_a_killed_stage(model, undisturbed):
    """What the server runs: streams pause while the stages start again, then finish with the
    undisturbed tokens; the engine stays healthy (no 503 afterwards)."""
    import asyncio

    from specpipe.engine.async_engine import AsyncEngine

    engine = Engine(config(model, stages=2, stage_timeout_s=10))
    aengine = AsyncEngine(engine.core())

    async def main():
        streams = [await aengine.add(engine.prompts.make_request(p, s, chat=False)) for p, s in zip(PROMPTS, PARAMS)]

        async def read(stream, kill: bool):
            ids, last = [], None
            async for d in stream:
                ids, last = ids + d.token_ids, d
                if kill and len(ids) >= 5:  # mid-stream: stage 2 dies
                    os.kill(stage_pids(os.getpid())[1], signal.SIGKILL)
                    kill = False
            return ids, last.finish_reason

        outs = await asyncio.gather(*[read(s, i == 0) for i, s in enumerate(streams)])
        return outs, await aengine.check()

    try:
        outs, health = asyncio.run(main())
    finally:
        aengine.shutdown()
        engine.close()
    assert [ids for ids, _ in outs] == undisturbed and health is None
    assert engine.core().stage_restarts == 1


def test_the_backoff_doubles_up_to_a_cap():
    from specpipe.engine.restart import BACKOFF_MAX_S, backoff_s

    waits = [backoff_s(n) for n in range(1, 12)]
    assert waits[:4] == [0.5, 1.0, 2.0, 4.0] and max(waits) == BACKOFF_MAX_S == waits[-1]


class BrokenPipeline:
    """A pipeline whose stages have died: its next collect fails."""

    num_stages, concurrent, reported, steps = 2, True, None, 3

    def submit(self, control, rows):
        pass

    def collect(self):
        raise PipelineError("stage 2 died")

    def close(self):
        pass


def test_a_pipeline_that_served_a_while_restarts_with_the_first_back_off(monkeypatch):
    """Faults minutes apart are each a first restart (0.5 s), not a doubling series, even when
    the pipeline took fewer than HEALTHY_STEPS steps meanwhile; faults in quick succession still
    double."""
    from specpipe.engine import restart
    from specpipe.messages import StagesRestarted

    clock = [0.0]
    waits = []
    monkeypatch.setattr(restart.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(restart.time, "sleep", waits.append)
    pipe = restart.RestartingPipeline(BrokenPipeline, 5, lambda _m: None)
    for at in (1.0, 60.0, 120.0, 121.0):  # failures at these times
        clock[0] = at
        with pytest.raises(StagesRestarted):
            pipe.collect()
    assert waits == [0.5, 0.5, 0.5, 1.0]


def restarting(starts, restarts, monkeypatch):
    """A RestartingPipeline over a broken pipeline whose restarts run `starts` in turn (a
    callable raises, anything else is the new pipeline); the waits and messages it made."""
    from specpipe.engine import restart

    waits, said = [], []
    monkeypatch.setattr(restart.time, "sleep", waits.append)
    attempts = iter([lambda: BrokenPipeline()] + starts)

    def start():
        step = next(attempts)
        return step()

    return restart.RestartingPipeline(start, restarts, said.append), waits, said


def test_a_start_that_fails_with_any_error_is_one_failed_attempt(monkeypatch):
    """Recovery can fail in ways that are not a PipelineError (a node agent lost while it takes a
    stage's weights, a cache entry that will not verify, raised through Ray): that attempt counts
    against --restart-stages with its back-off and the next one is tried, instead of the error
    escaping and ending every request."""
    from specpipe.cluster.weights import WeightCacheError
    from specpipe.messages import StagesRestarted

    def lost_node():
        raise ConnectionError("the node agent died")

    def bad_cache():
        raise WeightCacheError("tiny.gguf: the stage bytes written hash to 00ff, expected 1234")

    pipe, waits, said = restarting([lost_node, bad_cache, lambda: BrokenPipeline()], 3, monkeypatch)
    with pytest.raises(StagesRestarted):
        pipe.collect()
    assert pipe.restarted == 1 and pipe.failed is None
    assert waits == [0.5, 1.0, 2.0]  # each failed start waited its back-off
    assert "ConnectionError: the node agent died" in said[1] and "WeightCacheError: tiny.gguf" in said[2]


def test_starts_that_keep_failing_end_with_their_cause(monkeypatch):
    from specpipe.cluster.weights import WeightCacheError

    def bad_cache():
        raise WeightCacheError("cannot create the stage's files (No space left on device)")

    pipe, waits, _ = restarting([bad_cache, bad_cache], 2, monkeypatch)
    with pytest.raises(PipelineError, match="No space left on device.*gave up after 2 restarts"):
        pipe.collect()
    assert waits == [0.5, 1.0] and "No space left" in pipe.failed
    with pytest.raises(PipelineError):  # dead from then on, without trying again
        pipe.submit(None, [])
