"""`--draft-async`: the draft runs off the critical path (spec_decode/async_draft.py,
engine/async_drafting.py) and every mode it applies to still commits exactly pp's tokens, greedy
and seeded, at S = 1, 2, 4; with the draft's answers arriving 0 or 3 steps late (a modeled
clock, deterministic) and on a real thread behind a slow draft; and requests that finish or are
aborted while a forward is in flight leave no draft KV behind, and shutdown does not hang.
"""

from __future__ import annotations

import time

import pytest

from specpipe.engine.core import EngineCore
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.spec_decode.async_draft import AsyncDraft
from specpipe.spec_decode.sources import NgramSource, WrappedSource

from specpipe.loader.partition import partition_layers
from specpipe.model.stage import build_stage
from specpipe.worker.local_pipeline import LocalPipeline
from specpipe.worker.stage_worker import StageWorker
from test_lossless import (BLOCK_SIZE, BLOCKS, GREEDY, SAMPLED, TINY_PROMPT, make_pipeline, self_draft,  # noqa: F401
                           tiny8)


def shared_pipeline(ckpt, num_stages: int) -> LocalPipeline:
    """Stages several requests share (CheckedPipeline's KV check is for one request at a time)."""
    return LocalPipeline([StageWorker(build_stage(ckpt, s), BLOCKS, BLOCK_SIZE)
                          for s in partition_layers(ckpt.config.num_layers, num_stages)])


class LagClock:
    """A forward's answer is ready `lag` pipeline steps after it was asked for (0: the next poll)."""

    def __init__(self, pipe, lag: int) -> None:
        self.pipe, self.lag, self._free = pipe, lag, 0.0

    def now_ms(self) -> float:
        return float(self.pipe.steps)

    def forward_done_ms(self, rows: int, context: int) -> float:
        self._free = max(self.now_ms(), self._free) + self.lag
        return self._free


class SlowDraft(WrappedSource):
    """A draft model that takes `delay_s` longer per forward: slower than these tiny stages."""

    def __init__(self, inner, delay_s: float) -> None:
        super().__init__(inner, inner.name + "-slow")
        self.delay_s = delay_s

    def propose(self, request_id, tree, rows, want, k):
        raise AssertionError("the engine batches its calls (propose_many)")

    def propose_many(self, calls):
        time.sleep(self.delay_s)
        return self.inner.propose_many(calls)


def serve(pipe, mode, requests, source: AsyncDraft, layers=1, width=4):
    core = EngineCore(pipe, mode, source, width=width, depth=3, layers=layers, kv_blocks=64, block_size=16)
    core.run(requests)
    source.drain()
    draft = source.inner.inner if isinstance(source.inner, SlowDraft) else source.inner
    assert draft.slots.total_in_use() == 0 and not draft.slots.requests  # no draft KV left behind
    for w in pipe.workers:
        assert w.slots.total_in_use() == 0
    return core


RUNS = [("tree", 1), ("specpipe", 1), ("specpipe-db", 1), ("specpipe", "auto")]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_async_draft_equals_pp(tiny8, num_stages, sampling):
    target, _ = tiny8
    max_committed = len(TINY_PROMPT) + sampling.max_tokens
    reference = Request(0, TINY_PROMPT, sampling, frozenset())
    serve_pp = EngineCore(make_pipeline(target, 1, 1, max_committed), "pp", kv_blocks=64, block_size=16)
    serve_pp.run([reference])
    pipe = make_pipeline(target, num_stages, 4 * 8, max_committed)
    lagged = 0
    for (mode, layers), lag in [(r, lag) for r in RUNS for lag in (0, 3)]:
        source = AsyncDraft(self_draft(target, 2), clock=LagClock(pipe, lag))
        req = Request(0, TINY_PROMPT, sampling, frozenset())
        serve(pipe, mode, [req], source, layers)
        assert req.output_ids == reference.output_ids, f"{mode} layers={layers} lag={lag} differs from pp"
        if (mode, layers, sampling) == ("specpipe", 1, GREEDY) and num_stages > 1:
            pp_steps = num_stages * len(reference.output_ids)
            if lag == 0:  # answers in time: it speculates (fewer steps than pp)
                assert req.stats.pipeline_steps < pp_steps
            elif lag > num_stages - 1:  # a root is verified before its children are drafted: pp's steps
                assert req.stats.pipeline_steps == pp_steps and req.stats.hits == 0
        lagged += lag and mode != "tree" and req.stats.draft_calls > 0
        source.close()
    assert lagged  # the late answers really were used


@pytest.mark.parametrize("mode", ["specpipe", "specpipe-db"])
def test_slow_draft_on_its_thread_never_gates_a_step(tiny8, mode):
    """A draft 30 ms a forward on its own thread: the same tokens, several requests at once, and
    steps that run on without it (far more steps than forwards)."""
    target, _ = tiny8
    prompts = [TINY_PROMPT, TINY_PROMPT[3:], TINY_PROMPT[::-1]]
    params = [GREEDY, SAMPLED, SamplingParams(temperature=0.0, max_tokens=9)]
    refs = [Request(i, p, s, frozenset()) for i, (p, s) in enumerate(zip(prompts, params))]
    EngineCore(shared_pipeline(target, 1), "pp", kv_blocks=64, block_size=16).run(refs)
    source = AsyncDraft(SlowDraft(self_draft(target, 2), 0.03))
    reqs = [Request(i, p, s, frozenset()) for i, (p, s) in enumerate(zip(prompts, params))]
    core = serve(shared_pipeline(target, 2), mode, reqs, source)
    for req, ref in zip(reqs, refs):
        assert req.output_ids == ref.output_ids
    assert core.draft_bound_steps == 0
    calls = sum(r.stats.draft_calls for r in reqs)
    assert core.steps > 2 * calls / len(reqs)  # the steps did not wait for the forwards
    source.close()
    assert not source._thread.is_alive()


def test_finish_and_abort_while_a_forward_is_in_flight(tiny8):
    """Requests end (max tokens, a stop token, an abort) while the draft computes for them: the
    others keep pp's tokens, the aborted one keeps a prefix of them, the draft's KV is empty
    once the queue has run, and closing does not hang."""
    target, _ = tiny8
    stop = None
    ref = Request(0, TINY_PROMPT, GREEDY, frozenset())
    EngineCore(shared_pipeline(target, 1), "pp", kv_blocks=64, block_size=16).run([ref])
    stop = ref.output_ids[5]
    source = AsyncDraft(SlowDraft(self_draft(target, 2), 0.02))
    core = EngineCore(shared_pipeline(target, 2), "specpipe", source, width=4, kv_blocks=64, block_size=16)
    reqs = [Request(0, TINY_PROMPT, GREEDY, frozenset()), Request(1, TINY_PROMPT, GREEDY, frozenset([stop])),
            Request(2, TINY_PROMPT, GREEDY, frozenset()), Request(3, TINY_PROMPT, SamplingParams(temperature=0.0, max_tokens=3), frozenset())]
    for r in reqs:
        core.add_request(r)
    aborted_in_flight = False
    while core.has_work():
        core.step()
        if core.steps >= 4 and not reqs[2].finished and core.drafter.in_flight():
            core.abort(2)
            aborted_in_flight = True
    assert aborted_in_flight
    assert reqs[0].output_ids == ref.output_ids
    assert reqs[1].output_ids == ref.output_ids[:ref.output_ids.index(stop) + 1]
    assert reqs[2].output_ids == ref.output_ids[:len(reqs[2].output_ids)] and reqs[2].finish_reason == "abort"
    assert reqs[3].output_ids == ref.output_ids[:3]
    source.drain()
    assert source.inner.inner.slots.total_in_use() == 0 and not source.inner.inner.slots.requests
    source.close()
    assert not source._thread.is_alive()


def test_a_source_that_reads_the_tree_is_refused():
    with pytest.raises(ValueError, match="draft model"):
        AsyncDraft(NgramSource())


def test_engine_flag_serves_pp_tokens_and_refuses_ngram(tiny_model_dir):
    """`--draft-async` through EngineConfig / Engine: pp's tokens, one worker thread for the
    draft, stopped by close(); refused where it cannot apply (n-gram, a mode without a source)."""
    from specpipe.config import ConfigError, EngineConfig
    from specpipe.engine.engine import Engine

    model = str(tiny_model_dir("llama", num_hidden_layers=4))
    common = dict(model=model, transport="inproc", kv_memory="8MiB", max_context=128, stages=2)
    sampling = SamplingParams(temperature=0.0, max_tokens=12)
    pp = Engine(EngineConfig(mode="pp", **common))
    try:
        want = pp.generate(TINY_PROMPT, sampling).token_ids
    finally:
        pp.close()
    engine = Engine(EngineConfig(mode="specpipe", draft="self:2", draft_async=True, **common))
    try:
        assert engine.generate(TINY_PROMPT, sampling).token_ids == want
        assert engine.generate(TINY_PROMPT, sampling, draft_async=False).token_ids == want
    finally:
        engine.close()
    assert not engine.async_source._thread.is_alive()
    with pytest.raises(ConfigError, match="draft model"):
        Engine(EngineConfig(mode="specpipe", draft="ngram", draft_async=True, **common))
    with pytest.raises(ConfigError, match="draft-async"):
        EngineConfig(mode="pp", draft_async=True, **common).validate()


def test_async_draft_with_prefix_caching(tiny_model_dir):
    """--draft-async with --enable-prefix-caching: a second request on the same prompt starts
    after the cached prefix at the stages and in the draft (its worker), with pp's tokens."""
    from specpipe.config import EngineConfig
    from specpipe.engine.engine import Engine

    model = str(tiny_model_dir("llama", num_hidden_layers=4))
    common = dict(model=model, transport="inproc", kv_memory="8MiB", max_context=128, stages=2)
    sampling = SamplingParams(temperature=0.0, max_tokens=12)
    prompt = TINY_PROMPT * 3  # longer than a block, so a block of it is cached
    pp = Engine(EngineConfig(mode="pp", **common))
    try:
        want = pp.generate(prompt, sampling).token_ids
    finally:
        pp.close()
    engine = Engine(EngineConfig(mode="specpipe", draft="self:2", draft_async=True, enable_prefix_caching=True,
                                 **common))
    try:
        first = engine.generate(prompt, sampling)
        second = engine.generate(prompt, sampling)
        assert first.token_ids == second.token_ids == want
        assert second.stats["cached_tokens"] > 0
    finally:
        engine.close()


STRUCTURED = [  # (prompt, constraint): JSON with fixed keys and enums, a date by a regular expression
    ("Pick a color and a size, as JSON.", {"json_schema": {
        "type": "object", "additionalProperties": False, "required": ["color", "size"], "properties": {
            "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}}}),
    ("When is the meeting?", {"regex": r"(Monday|Tuesday|Friday), [0-9]{1,2} (May|June) 20[0-9]{2}"}),
]


def test_async_candidates_obey_the_grammar(smollm2, monkeypatch):
    """Structured output under --draft-async: the draft-ahead masks its logits with the request's
    grammar (the masks taken when the call is made) and its candidates are filtered as synchronous
    drafting's are, so no candidate that reaches a tree is a token the grammar forbids after its
    parent; the tokens are constrained pp's. The draft's answers come on the modeled clock
    (LagClock: at the next step, or a step late, when the grammar has moved on with the committed
    tokens), so candidates always arrive and are used, whatever the machine's load."""
    from specpipe.engine import core as engine_core
    from specpipe.engine.modes.specpipe import SpecPipeState
    from specpipe.grammar import StructuredOutput
    from specpipe.grammar.compiler import GrammarCompiler
    from specpipe.grammar.matcher import RequestGrammar
    from specpipe.loader.default_model import default_model_path
    from specpipe.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(default_model_path())
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]),
                                add_special_tokens=False) for p, _ in STRUCTURED]
    sampling = SamplingParams(temperature=0.0, max_tokens=24)
    compiler = GrammarCompiler(tokenizer, smollm2.config.vocab_size)
    try:
        grammars = [compiler.compile(StructuredOutput(**c)) for _, c in STRUCTURED]

        def requests() -> list[Request]:
            return [Request(i, list(p), sampling, frozenset(tokenizer.eos_token_ids), grammar=RequestGrammar(g))
                    for i, (p, g) in enumerate(zip(prompts, grammars))]

        want = requests()
        EngineCore(shared_pipeline(smollm2, 1), "pp", kv_blocks=64, block_size=16).run(want)
        assert all(r.finish_reason == "stop" and r.grammar.closed for r in want)  # the grammar ended them
        seen = {"raw": 0, "raw_forbidden": 0, "candidates": 0, "forbidden": 0}
        take, allowed = SpecPipeState.async_proposals, engine_core.EngineCore.allowed_proposals

        def filtered(st, wanted, k, props):  # the draft's answer as it came, then filtered
            for n, cands in props.items():
                ranked = [c for c in cands if c[1] > float("-inf")]  # (top-k past the allowed ones: -inf)
                if n in st.tree:
                    seen["raw"] += len(ranked)
                    seen["raw_forbidden"] += len(ranked) - len(st.req.grammar.filter(st.tree.path_tokens(n), ranked))
            return allowed(st, wanted, k, props)

        def checked(st, call, props):  # what enters the tree
            g = st.req.grammar
            for n, cands in props.items():
                if n in st.tree and not g.closed:
                    seen["candidates"] += len(cands)
                    seen["forbidden"] += len(cands) - len(g.filter(st.tree.path_tokens(n), cands))
            return take(st, call, props)

        monkeypatch.setattr(engine_core.EngineCore, "allowed_proposals", staticmethod(filtered))
        monkeypatch.setattr(SpecPipeState, "async_proposals", checked)
        for mode, lag in [("specpipe", 0), ("specpipe", 1), ("specpipe-db", 1)]:
            pipe = shared_pipeline(smollm2, 2)
            source = AsyncDraft(self_draft(smollm2, 8), clock=LagClock(pipe, lag))
            got = requests()
            serve(pipe, mode, got, source)
            source.close()
            assert [r.output_ids for r in got] == [r.output_ids for r in want], (mode, lag, [(r.finish_reason, r.error) for r in got])
            assert sum(r.stats.hits for r in got) > 0, (mode, lag)  # async candidates were accepted
        assert seen["candidates"] > 0 and seen["forbidden"] == 0, seen
        # the draft's masked logits ranked only what the grammar allows: every candidate it scored is allowed
        assert seen["raw"] > 0 and seen["raw_forbidden"] == 0, seen
    finally:
        compiler.close()


class FailingObserve(WrappedSource):
    """A draft whose observe fails for one request."""

    def __init__(self, inner, bad: int) -> None:
        super().__init__(inner, inner.name)
        self.bad, self.calls = bad, []

    def observe(self, request_id, commit, drop):
        self.calls.append(request_id)
        if request_id == self.bad:
            raise RuntimeError(f"draft state of request {request_id} is broken")
        self.inner.observe(request_id, commit, drop)


@pytest.mark.parametrize("worker", ["thread", "clock"])
def test_a_queued_call_that_fails_is_raised_for_its_own_request_only(tiny8, worker):
    """A start/observe/finish runs later on the draft's worker; when one fails, the failure goes to
    that request's next call (the engine then ends that request alone), never to another
    request's call that happens to come next; a request that finishes takes it away."""
    target, _ = tiny8
    inner = FailingObserve(self_draft(target, 2), bad=1)
    source = AsyncDraft(inner, clock=LagClock(None, 0) if worker == "clock" else None)
    try:
        for rid in (1, 2, 3):
            source.start(rid)
        source.observe(1, [], [])
        source.drain()  # the failure has happened; drain does not raise it for anybody
        source.observe(2, [], [])  # another request's calls go on
        source.start(4)
        source.drain()
        with pytest.raises(RuntimeError, match="request 1 is broken"):
            source.observe(1, [], [])  # its own next call
        source.observe(1, [], [])
        source.drain()
        source.finish(1)  # its second failure: the request is over, nobody else gets it
        source.observe(3, [], [])
        source.drain()
        source.raise_failure(1)
        assert inner.calls == [1, 2, 1, 3]
    finally:
        source.close()


def test_reset_prefix_cache_empties_the_drafts_cache_too(tiny_model_dir):
    """Engine.reset_prefix_cache (bench's "each run starts from an empty cache") forgets the
    draft model's cached prefixes as well as the stages': the next request hits neither, and its
    tokens are unchanged. With the draft on its worker thread too."""
    from specpipe.config import EngineConfig
    from specpipe.engine.engine import Engine

    model = str(tiny_model_dir("llama", num_hidden_layers=4))
    sampling = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = TINY_PROMPT * 3  # longer than a block, so a block of it is cached
    for draft_async in (False, True):
        engine = Engine(EngineConfig(model=model, mode="specpipe", draft="self:2", draft_async=draft_async,
                                     enable_prefix_caching=True, transport="inproc", kv_memory="8MiB",
                                     max_context=128, stages=2))
        try:
            draft = engine.source
            first = engine.generate(prompt, sampling)
            if engine.async_source is not None:
                engine.async_source.drain()
            assert len(draft.prefix.index) > 0 and draft.slots.cached  # warm
            engine.reset_prefix_cache()
            assert len(draft.prefix.index) == 0 and not draft.slots.cached, draft_async
            hits = draft.prefix.index.stats.hits
            second = engine.generate(prompt, sampling)
            if engine.async_source is not None:
                engine.async_source.drain()
            assert second.stats["cached_tokens"] == 0 and draft.prefix.index.stats.hits == hits
            assert second.token_ids == first.token_ids
        finally:
            engine.close()
