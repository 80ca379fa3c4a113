"""Prefix caching is lossless: with the cache, every mode commits exactly the tokens it commits
without it, at S = 1, 2 and 4, greedy and seeded, for a chat's second turn, for requests sharing a
system prompt that arrive at once, and for a prompt that is a strict prefix of a cached one. After
every step, every stage holds exactly the cached blocks the driver's index names (no block is
served that a stage evicted or never had), and a request's KV leaves nothing behind but them.
"""

from __future__ import annotations

import pytest

from specpipe.config import MODES, SPECULATIVE_MODES, StageSpec
from specpipe.engine.core import EngineCore
from specpipe.loader import open_checkpoint
from specpipe.loader.partition import partition_layers
from specpipe.messages import StagesRestarted
from specpipe.model.stage import build_stage
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.sched.prefix_cache import PrefixCache
from specpipe.spec_decode.draft_model import DraftModelSource
from specpipe.spec_decode.sources import NgramSource
from specpipe.worker.local_pipeline import LocalPipeline
from specpipe.worker.stage_worker import StageWorker

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=14)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=77, max_tokens=14)
SYSTEM = [5, 17, 33, 90, 5, 17, 33, 90, 5, 17, 120, 7, 5, 17, 61, 62, 63, 5, 17, 33]


class CheckedPipeline(LocalPipeline):
    """After every step: each stage's cached blocks are exactly those of the driver's index (less
    any a stage lost, none here), and no stage holds a block nobody accounts for."""

    cache: PrefixCache | None = None

    def collect(self):
        out = super().collect()
        if self.cache is not None:
            ids = {b.block_id for b in self.cache.blocks.values()}
            for w in self.workers:
                assert set(w.slots.cached) == ids
                owned = sum(len(r.blocks) for r in w.slots.requests.values())
                assert w.slots.pool.num_blocks - w.slots.pool.num_free() == owned + len(ids)
                assert w.slots.idle == sum(1 for c in ids if w.slots.readers[c] == 0)
        return out


@pytest.fixture(scope="module")
def tiny8(tiny_model_dir):
    return open_checkpoint(tiny_model_dir("llama", num_hidden_layers=8))


def pipeline(ckpt, num_stages: int, blocks: int) -> CheckedPipeline:
    return CheckedPipeline([StageWorker(build_stage(ckpt, s), blocks, BLOCK_SIZE)
                            for s in partition_layers(ckpt.config.num_layers, num_stages)])


def source_for(ckpt, mode: str, cached: bool):
    if mode not in SPECULATIVE_MODES:
        return None
    if mode == "specpipe-db":
        return NgramSource()
    # The target itself as the draft: every guess hits, so accepted tree nodes sit in scattered
    # slots, which the stages copy into whole blocks when the request's blocks join the cache.
    layers = ckpt.config.num_layers
    draft = DraftModelSource(build_stage(ckpt, StageSpec(0, layers, first=True, last=True)), 64, BLOCK_SIZE,
                             f"self:{layers}")
    if cached:  # its own KV too, in a pool small enough that it must evict
        draft.enable_prefix_cache(PrefixCache(BLOCK_SIZE))
    return draft


class Served:
    """One engine core over fresh stages, with or without the cache; serves rounds of requests."""

    def __init__(self, ckpt, mode: str, num_stages: int, cached: bool, blocks: int = 256, step_rows: int = 8):
        self.pipe = pipeline(ckpt, num_stages, blocks)
        cache = PrefixCache(BLOCK_SIZE) if cached else None
        self.pipe.cache = cache
        self.core = EngineCore(self.pipe, mode, source_for(ckpt, mode, cached), width=3, depth=2, kv_blocks=blocks,
                               block_size=BLOCK_SIZE, max_num_seqs=8, step_rows=step_rows, prefix_cache=cache)
        self.ids = 0

    def serve(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Request]:
        reqs = []
        for p in prompts:
            reqs.append(Request(self.ids, list(p), sampling, frozenset()))
            self.ids += 1
        self.core.run(reqs)
        for w in self.pipe.workers:  # only the cache's blocks remain
            assert not w.slots.requests
        draft = self.core.source
        if getattr(draft, "prefix", None) is not None:
            assert not draft.slots.requests and not draft.prefix.requests
            assert set(draft.slots.cached) == {b.block_id for b in draft.prefix.index.blocks.values()}
        return reqs


def outputs(reqs: list[Request]) -> list[list[int]]:
    return [r.output_ids for r in reqs]


SAMPLINGS = pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
STAGES = pytest.mark.parametrize("num_stages", [1, 2, 4])


@SAMPLINGS
@STAGES
@pytest.mark.parametrize("mode", MODES)
def test_a_chat_turn_and_a_strict_prefix_are_lossless(tiny8, mode, num_stages, sampling):
    runs = {}
    for cached in (False, True):
        s = Served(tiny8, mode, num_stages, cached)
        first = s.serve([SYSTEM + [200, 201, 202]], sampling)[0]
        turn = SYSTEM + [200, 201, 202] + first.output_ids + [210, 211, 212, 213, 214]
        second = s.serve([turn], sampling)[0]
        prefix = s.serve([turn[:17], turn[:16]], sampling)  # within a cached block, and at its end
        runs[cached] = (outputs([first, second, *prefix]), second.stats.cached_tokens,
                        [r.stats.cached_tokens for r in prefix])
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == 0
    # More than the first turn's prompt: the blocks it decoded too (less its last S + 2 steps'
    # rows), copied into whole blocks where the tree had scattered them.
    assert runs[True][1] > (len(SYSTEM) + 3) // BLOCK_SIZE * BLOCK_SIZE
    assert runs[True][2] == [16, 12]  # a token is always computed, so 16 of 16 cannot be cached


@SAMPLINGS
@STAGES
@pytest.mark.parametrize("mode", ["pp-cb", "specpipe-db", "specpipe"])
def test_requests_sharing_a_system_prompt_at_once(tiny8, mode, num_stages, sampling):
    prompts = [SYSTEM * 2 + [240 + i, 241 + i] for i in range(6)]
    runs = {cached: Served(tiny8, mode, num_stages, cached).serve(prompts, sampling) for cached in (False, True)}
    assert outputs(runs[True]) == outputs(runs[False])
    hits = [r.stats.cached_tokens for r in runs[True]]
    if mode != "specpipe":  # a row budget: the later prompts wait for the first's blocks
        assert sum(hits) >= 2 * len(SYSTEM), hits


@pytest.mark.parametrize("mode", ["pp-cb", "specpipe-db"])
def test_eviction_never_serves_an_overwritten_block(tiny8, mode):
    """A pool of 20 blocks of 4: each request needs about half of it, so every new prompt evicts
    cached blocks of the earlier ones, and a prompt seen before is partly served from what is
    left. The tokens never change."""
    prompts = [[7 + i, 8, 9, 10] * 5 + [40 + i] for i in range(5)]
    order = [0, 1, 2, 0, 3, 1, 4, 0, 2]
    runs = {}
    for cached in (False, True):
        s = Served(tiny8, mode, 2, cached, blocks=20)
        runs[cached] = [s.serve([prompts[i]], GREEDY)[0] for i in order]
        if cached:
            assert s.core.scheduler.blocks.cache.stats.evictions > 0
            assert any(r.stats.cached_tokens for r in runs[True])
    assert outputs(runs[True]) == outputs(runs[False])


def test_a_request_cancelled_mid_prefill_caches_only_what_every_stage_computed(tiny8):
    prompt = SYSTEM * 3 + [250, 251]
    base = Served(tiny8, "pp-cb", 4, False).serve([prompt], GREEDY)[0]
    s = Served(tiny8, "pp-cb", 4, True, step_rows=8)
    req = Request(100, list(prompt), GREEDY, frozenset())
    s.core.add_request(req)
    for _ in range(8):  # 64 of its 62 rows sent, the last chunks still in the pipeline
        s.core.step()
    s.core.abort(req.request_id)
    while s.core.has_work():
        s.core.step()
    cached = len(s.core.scheduler.blocks.cache) * BLOCK_SIZE
    # Rows sent at step t are computed everywhere by step t + S - 1; only blocks below the floor
    # (what was sent S + 2 steps before the abort) were cached.
    assert 0 < cached <= 6 * 8
    again = s.serve([prompt], GREEDY)[0]
    assert again.stats.cached_tokens == cached
    assert again.output_ids == base.output_ids


def test_stages_started_afresh_start_with_an_empty_cache(tiny8):
    """Recovery: the driver forgets its index when the stages come back empty, and the requests
    in flight are recomputed from their prompts with the same tokens."""
    prompt = SYSTEM + [222, 223]
    base = Served(tiny8, "specpipe-db", 2, False).serve([prompt, prompt], GREEDY)
    s = Served(tiny8, "specpipe-db", 2, True)
    s.serve([prompt], GREEDY)
    assert len(s.core.scheduler.blocks.cache) > 0
    real_submit = s.pipe.submit
    state = {"failed": False}

    def submit(control, rows):
        if not state["failed"] and rows:
            state["failed"] = True
            s.pipe.workers = [StageWorker(w.model, w.slots.num_blocks, BLOCK_SIZE, horizon=i + 1)
                              for i, w in enumerate(s.pipe.workers)]
            s.pipe.close()  # nothing in flight any more
            raise StagesRestarted("a stage died")
        return real_submit(control, rows)

    s.pipe.submit = submit
    reqs = s.serve([prompt, prompt], GREEDY)
    assert state["failed"]
    assert outputs(reqs) == outputs(base)
    assert s.core.stage_restarts == 1
