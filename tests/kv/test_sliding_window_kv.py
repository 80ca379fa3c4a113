"""Sliding-window layers keep only their window: their own slot table forgets committed positions
no row can see any more (kv/slot_table.py), the driver counts that pool too
(sched/block_manager.py), and outputs stay exactly pp's."""

from __future__ import annotations


import pytest

from specpipe.config import ConfigError, StageSpec
from specpipe.engine.core import EngineCore
from specpipe.kv.slot_table import SlotTable
from specpipe.loader import open_checkpoint
from specpipe.loader.partition import partition_layers
from specpipe.messages import NO_PARENT
from specpipe.model.stage import build_stage
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.sched.block_manager import BlockManager, window_need
from specpipe.spec_decode.draft_model import DraftModelSource
from specpipe.spec_decode.sources import MergedSource, NgramSource
from specpipe.worker.local_pipeline import LocalPipeline
from specpipe.worker.stage_worker import StageWorker

PROMPT = [5, 17, 33, 90, 5, 17, 33, 90, 5, 17, 120, 7, 5, 17, 33, 90, 5, 17]


def test_the_window_table_keeps_the_last_window_and_returns_whole_blocks():
    table = SlotTable(num_blocks=32, block_size=4, window_pool=(6, 4))
    window = table.window
    table.admit(0)
    prompt = list(range(10))
    table.commit(0, prompt)  # the prompt is committed up front, settled as it is computed
    plan = table.plan(0, prompt, [NO_PARENT] + prompt[:-1])
    assert plan.window is not None and len(plan.window.read_slots) == 10  # the chunk reads itself
    table.computed(0)
    r = window.requests[0]
    # Rows still to come sit at positions >= 10 and see positions > 10 - 6: 5..9 stay.
    assert (r.evicted, len(r.committed)) == (5, 5)
    assert window.blocks_in_use() == 2  # block 0 (positions 0-3) went back to the pool
    slot_position = dict(zip(plan.window.write_slots, range(10)))
    for pos in range(10, 60):  # plain decode: every step a token, committed once computed
        plan = table.plan(0, [pos], [pos - 1])
        slot_position[plan.window.write_slots[0]] = pos
        table.commit(0, [pos])
        table.computed(0)
        # The new row read exactly the window behind it, in position order, and itself.
        assert [slot_position[s] for s in plan.window.read_slots] == list(range(pos - 5, pos + 1))
        assert window.blocks_in_use() <= 2
    assert table.blocks_in_use() == 15  # the main table holds the whole context
    table.release(0)
    assert window.blocks_in_use() == 0 and window.pool.num_free() == 4


def test_a_tree_in_the_window_table_is_pruned_and_committed_like_the_main_table():
    table = SlotTable(num_blocks=32, block_size=4, window_pool=(3, 8))
    table.admit(7)
    table.commit(7, [0, 1, 2, 3])
    table.plan(7, [0, 1, 2, 3], [NO_PARENT, 0, 1, 2])
    table.computed(7)
    plan = table.plan(7, [10, 11, 12], [3, 3, 10])  # two children of 3, a grandchild under 10
    assert plan.window.mask.tolist() == [[True, True, True, False, False],
                                         [True, True, False, True, False],
                                         [True, True, True, False, True]]
    table.drop(7, [11])
    table.commit(7, [10, 12])
    w = table.window.requests[7]
    assert not w.spec and (w.evicted, len(w.committed)) == (4, 2)
    assert table.total_in_use() == 6 and table.window.total_in_use() == 2


def test_the_driver_counts_the_window_pool_behind_its_floor():
    blocks = BlockManager(100, 4, window=8, window_blocks=5)
    assert blocks.fits(0, 20)  # 20 slots of the main pool: all 20 in the window too (floor 0)
    assert not blocks.fits(0, 21)
    blocks.set_floor(0, 30)  # every stage has settled 30 positions: 23 of them are evicted
    assert blocks.fits(0, 43) and not blocks.fits(0, 44)
    blocks.reserve(0, 43)
    assert blocks.held(0) == 11 and blocks.window_pool.held[0] == 5
    assert blocks.room(0) == min(blocks.pool.room(0), 5 * 4 + 23)
    blocks.free(0)
    assert blocks.num_free() == 100 and blocks.window_pool.num_free() == 5


def _pipeline(ckpt, num_stages: int, window_blocks: int, block_size: int = 4) -> LocalPipeline:
    specs = partition_layers(ckpt.config.num_layers, num_stages)
    return LocalPipeline([StageWorker(build_stage(ckpt, s), 64, block_size, window_blocks=window_blocks)
                          for s in specs])


def _serve(pipe: LocalPipeline, mode: str, prompts: list[list[int]], sampling: SamplingParams, window_pool=None,
           source=None, max_num_seqs: int = 1, kv_blocks: int = 64) -> list[Request]:
    core = EngineCore(pipe, mode, source, width=4, kv_blocks=kv_blocks, block_size=4, max_num_seqs=max_num_seqs,
                      step_rows=4 * max_num_seqs, window_pool=window_pool)
    reqs = [Request(i, list(p), sampling, frozenset()) for i, p in enumerate(prompts)]
    for req in reqs:
        core.add_request(req)
    for _ in range(5000):
        if not core.has_work():
            break
        core.step()
        if window_pool is None:
            continue
        # The driver's count covers what every stage holds in its window pool (the mirror).
        counted = core.scheduler.blocks.window_pool.held
        for rid in core.scheduler.running:
            pid = core.states[rid].pid
            for w in pipe.workers:
                r = w.slots.window.requests.get(pid) if w.slots.window is not None else None
                assert r is None or len(r.blocks) <= counted.get(rid, 0)
    assert all(req.finished for req in reqs) and not core.has_work()
    return reqs


def _decode(pipe: LocalPipeline, mode: str, sampling: SamplingParams, window_pool=None, source=None) -> Request:
    return _serve(pipe, mode, [PROMPT], sampling, window_pool, source)[0]


def _draft(ckpt):
    """The target's first layer as a draft, merged with n-grams: trees that are often right."""
    return MergedSource([DraftModelSource(build_stage(ckpt, StageSpec(0, 1, first=True, last=True)), 64, 4, "self:1"),
                         NgramSource()])


@pytest.mark.parametrize("family,overrides", [("gemma3_text", {}), ("mistral", {"sliding_window": 5})])
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0, max_tokens=50),
                                      SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=50)],
                         ids=["greedy", "sampled"])
def test_a_long_request_fits_a_window_pool_smaller_than_its_context(tiny_model_dir, family, overrides, sampling):
    """Gemma 3 (sliding and global layers alternate; at S = 4 a stage holds only one kind) and
    Mistral (every layer slides): with a window pool far smaller than the request's context, the
    serving modes give pp's tokens, no stage ever runs out (the driver's count holds), and
    everything comes back at the end."""
    ckpt = open_checkpoint(tiny_model_dir(family, **overrides))
    window = ckpt.config.sliding_window
    reference = _decode(_pipeline(ckpt, 1, 0), "pp", sampling).output_ids
    context = len(PROMPT) + sampling.max_tokens
    for num_stages, mode in [(1, "pp-cb"), (2, "pp-cb"), (2, "specpipe-db"), (4, "specpipe-db")]:
        reserve = EngineCore(_pipeline(ckpt, num_stages, 0), mode, NgramSource(), width=4).spec_reserve()
        need = window_need(context + reserve, window, reserve, num_stages, 4)
        window_blocks = -(-need // 4) + 1  # what one request can be counted for, and the watermark
        assert window_blocks * 4 < context
        pipe = _pipeline(ckpt, num_stages, window_blocks)
        req = _decode(pipe, mode, sampling, (window, window_blocks), _draft(ckpt) if mode == "specpipe-db" else None)
        assert req.output_ids == reference, f"{family}: {mode} at S={num_stages} differs from pp"
        assert req.stats.preemptions == 0  # no stage ran out of window blocks
        for w in pipe.workers:
            assert w.stats.requests_failed == 0
            if w.slots.window is not None:
                assert w.slots.window.blocks_in_use() == 0
        assert any(w.slots.window is not None for w in pipe.workers)


def test_a_request_the_window_pool_cannot_hold_is_refused_at_once(tiny_model_dir):
    ckpt = open_checkpoint(tiny_model_dir("gemma3_text"))
    pipe = _pipeline(ckpt, 1, 3)
    core = EngineCore(pipe, "pp-cb", kv_blocks=64, block_size=4, max_num_seqs=1, step_rows=4,
                      window_pool=(ckpt.config.sliding_window, 3))
    with pytest.raises(ConfigError, match="sliding-window KV pool"):
        core.add_request(Request(0, list(PROMPT), SamplingParams(max_tokens=40), frozenset()))


def test_many_requests_share_a_tight_window_pool_losslessly(tiny_model_dir):
    """Several requests of different lengths, two running at a time, a main pool small enough to
    preempt and a window pool for two windows: each gets the tokens it gets alone under pp."""
    ckpt = open_checkpoint(tiny_model_dir("gemma3_text"))
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=40)
    prompts = [PROMPT[:n] for n in (18, 9, 14, 5)]
    want = [_serve(_pipeline(ckpt, 1, 0), "pp", [p], sampling)[0].output_ids for p in prompts]
    reserve = EngineCore(_pipeline(ckpt, 2, 0), "specpipe-db", NgramSource(), width=4).spec_reserve()
    need = window_need(len(PROMPT) + 40 + reserve, 6, reserve, 2, 8)
    window_blocks = 2 * -(-need // 4) + 1
    pipe = _pipeline(ckpt, 2, window_blocks)
    got = _serve(pipe, "specpipe-db", prompts, sampling, (6, window_blocks), _draft(ckpt), max_num_seqs=2,
                 kv_blocks=24)
    assert [r.output_ids for r in got] == want
    assert sum(r.stats.preemptions for r in got) > 0  # the main pool was tight: recomputation was exercised
    for w in pipe.workers:
        assert w.stats.requests_failed == 0 and w.slots.window.blocks_in_use() == 0
