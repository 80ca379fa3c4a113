"""Many requests at once on the engine core: every mode gives each request exactly the tokens it
gets alone in `pp` (mixed prompt lengths, greedy and seeded sampling, different max tokens and
stop strings); aborts free KV at every stage; KV exhaustion queues or preempts cleanly; a long
prompt is prefilled in chunks while the others keep decoding."""

from __future__ import annotations

import random

import pytest

from specpipe.config import MODES, EngineConfig
from specpipe.engine.engine import Engine
from specpipe.sampling import SamplingParams

N_REQUESTS = 32


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama", num_hidden_layers=8))


def make_engine(model, mode="pp", stages=1, **kw) -> Engine:
    kw.setdefault("kv_memory", "4MiB")
    kw.setdefault("max_context", 256)
    kw.setdefault("max_num_seqs", N_REQUESTS)
    kw.setdefault("max_step_rows", 48)
    return Engine(EngineConfig(model=model, mode=mode, stages=stages, transport="inproc", tree_width=4,
                               tree_depth=3, draft="self:6+ngram" if mode in ("tree", "specpipe", "specpipe-db") else None,
                               **kw))


def workload(seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    out = []
    for i in range(N_REQUESTS):
        n = rng.choice([3, 8, 17, 40, 90])
        motif = [rng.randrange(3, 250) for _ in range(rng.randrange(2, 6))]
        prompt = (motif * (n // len(motif) + 1))[:n]  # repetitive, so n-grams find something
        sampled = i % 2 == 1
        out.append((prompt, SamplingParams(temperature=0.8 if sampled else 0.0, top_p=0.9, seed=1000 + i,
                                           max_tokens=rng.randrange(4, 24))))
    return out


@pytest.fixture(scope="module")
def reference(model):
    """Each request alone in pp; a few of them get a stop string taken from their own text."""
    engine = make_engine(model, "pp")
    try:
        cases = []
        for i, (prompt, params) in enumerate(workload()):
            if i % 5 == 2:
                text = engine.generate(prompt, params).text
                if len(text) > 6:  # stop in the middle of what it would have said
                    params = SamplingParams(params.temperature, params.top_p, params.top_k, params.seed,
                                            params.max_tokens, stop=(text[len(text) // 2:len(text) // 2 + 2],))
            cases.append((prompt, params, engine.generate(prompt, params)))
        return cases
    finally:
        engine.close()


def run_together(engine: Engine, cases) -> list:
    reqs = [engine.prompts.make_request(prompt, params) for prompt, params, _ in cases]
    engine.run(reqs)
    return reqs


@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("mode", MODES)
def test_concurrent_requests_equal_each_alone_in_pp(model, reference, mode, stages):
    engine = make_engine(model, mode, stages)
    try:
        reqs = run_together(engine, reference)
        assert any(r.finish_reason == "stop" and r.sampling.stop for r in reqs)  # stop strings were used
        for req, (_, _, alone) in zip(reqs, reference):
            assert req.output_ids == alone.token_ids, f"request {req.request_id} in {mode} at S={stages}"
            assert (req.text, req.finish_reason) == (alone.text, alone.finish_reason)
        for w in engine.pipeline.workers:
            assert w.slots.total_in_use() == 0  # every release reached every stage
        core = engine.core()
        blocks = core.scheduler.blocks  # every block free, or cached and read by nobody
        assert blocks.pool.available() == blocks.num_blocks
        assert blocks.num_free() + len(engine.prefix_cache) == blocks.num_blocks
        if mode in ("pp-cb", "specpipe-db"):
            assert core.steps < sum(r.stats.pipeline_steps for r in reqs)  # they really shared steps
    finally:
        engine.close()


@pytest.mark.parametrize("mode,layers", [("specpipe", 3), ("specpipe-db", 3), ("specpipe-db", "auto")])
def test_several_layers_per_step_with_many_requests(model, reference, mode, layers):
    """Blocks of 3 layers per step, or planned ones (auto), narrowed by the row budget in
    specpipe-db, for 32 requests together: each request's tokens equal it alone in pp."""
    engine = make_engine(model, mode, 2, layers_per_step=layers)
    try:
        reqs = run_together(engine, reference)
        for req, (_, _, alone) in zip(reqs, reference):
            assert req.output_ids == alone.token_ids, f"request {req.request_id} in {mode}"
        assert all(w.slots.total_in_use() == 0 for w in engine.pipeline.workers)
    finally:
        engine.close()


def stage_usage(engine) -> list[int]:
    return [w.slots.total_in_use() for w in engine.pipeline.workers]


@pytest.mark.parametrize("mode", ["pp-cb", "specpipe-db"])
def test_abort_mid_flight_frees_kv_at_every_stage(model, reference, mode):
    engine = make_engine(model, mode, 4)
    try:
        core = engine.core()
        keep = engine.prompts.make_request(reference[0][0], SamplingParams(max_tokens=40))
        core.add_request(keep)
        for _ in range(6):
            core.step()
        before = stage_usage(engine)
        victim = engine.prompts.make_request(reference[4][0], SamplingParams(max_tokens=40))
        core.add_request(victim)
        for _ in range(7):  # its prompt and tree are in flight at every stage now
            core.step()
        assert all(u > b for u, b in zip(stage_usage(engine), before))
        core.abort(victim.request_id)
        assert victim.finish_reason == "abort"
        core.step()  # the release rides on the next ordinary step
        for w in engine.pipeline.workers:  # the survivor's KV may have grown; the victim's is gone
            assert set(w.slots.requests) <= {core.states[keep.request_id].pid}
        while core.has_work():
            core.step()
        assert keep.finish_reason == "length" and len(keep.output_ids) == 40
        assert stage_usage(engine) == [0, 0, 0, 0]
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["pp-cb", "specpipe-db", "specpipe"])
def test_kv_exhaustion_queues_or_preempts_and_everyone_finishes_correctly(model, reference, mode):
    # A pool of 24 blocks x 8 slots: room for two or three of these requests at a time.
    engine = make_engine(model, mode, 2, kv_memory=None, block_size=8, max_context=200)
    engine.num_blocks = 24  # what a small memory would give; the stages have more, the driver admits by this
    try:
        reqs = run_together(engine, reference)
        for req, (_, _, alone) in zip(reqs, reference):
            assert req.output_ids == alone.token_ids
        core = engine.core()
        assert core.scheduler.blocks.pool.available() == 24
        assert stage_usage(engine) == [0, 0]
    finally:
        engine.close()


def test_long_prompt_is_prefilled_in_chunks_while_others_decode(model):
    engine = make_engine(model, "pp-cb", 2, max_step_rows=40)
    try:
        alone = engine.generate(list(range(3, 203)), SamplingParams(max_tokens=4), mode="pp")
        core = engine.core()
        short = [engine.prompts.make_request([7, 8, 9, 7, 8], SamplingParams(max_tokens=30)) for _ in range(3)]
        for r in short:
            core.add_request(r)
        for _ in range(6):
            core.step()
        long = engine.prompts.make_request(list(range(3, 203)), SamplingParams(max_tokens=4))  # 200 tokens, 40-row budget
        core.add_request(long)
        counts = []
        while not long.output_ids:
            core.step()
            counts.append(sum(len(r.output_ids) for r in short))
        # The prompt took at least 5 steps (200 rows / at most 40 per step) ...
        assert len(counts) >= 5
        # ... and the short requests kept getting tokens during them
        assert counts[-1] - counts[0] >= 2
        while core.has_work():
            core.step()
        assert long.output_ids == alone.token_ids
    finally:
        engine.close()
