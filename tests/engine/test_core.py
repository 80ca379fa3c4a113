"""Engine core details: an error while drafting (the step's or one request's), and a tree too wide for the KV pool."""

from __future__ import annotations

import pytest

from specpipe.config import ConfigError
from specpipe.engine.core import EngineCore
from engine_helpers import decode
from specpipe.loader import open_checkpoint
from specpipe.loader.partition import partition_layers
from specpipe.model.stage import build_stage
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.spec_decode.sources import NgramSource
from specpipe.worker.local_pipeline import LocalPipeline
from specpipe.worker.stage_worker import StageWorker

PROMPT = [5, 17, 33, 90, 5, 17, 33, 90, 5, 17, 120, 7, 5, 17]


class FlakySource(NgramSource):
    """Fails on its 3rd and 4th calls, as a draft model on a flaky device might."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def propose_many(self, calls):
        self.calls += 1
        if self.calls in (3, 4):
            raise RuntimeError("draft device error")
        return super().propose_many(calls)


@pytest.fixture(scope="module")
def ckpt(tiny_model_dir):
    return open_checkpoint(tiny_model_dir("llama"))


def pipeline(ckpt, S):
    return LocalPipeline([StageWorker(build_stage(ckpt, s), 32, 16) for s in partition_layers(4, S)])


def test_an_error_while_the_stages_compute_leaves_the_pipeline_in_step(ckpt):
    pipe = pipeline(ckpt, 4)
    reference = Request(0, PROMPT, SamplingParams(max_tokens=16), frozenset())
    decode(pipe, reference, "pp", kv_blocks=32, block_size=16)
    core = EngineCore(pipe, "specpipe", FlakySource(), width=4, kv_blocks=32, block_size=16)
    req = Request(1, PROMPT, SamplingParams(max_tokens=16), frozenset())
    core.add_request(req)
    errors = 0
    while core.has_work():
        try:
            core.step()
        except RuntimeError as e:
            assert "draft device error" in str(e)
            errors += 1
    assert errors == 2
    assert req.output_ids == reference.output_ids  # no result was lost, no token is wrong
    assert all(w.slots.total_in_use() == 0 for w in pipe.workers)


def test_a_tree_too_wide_for_the_pool_is_refused(ckpt):
    core = EngineCore(pipeline(ckpt, 2), "specpipe", NgramSource(), width=64, kv_blocks=8, block_size=16)
    with pytest.raises(ConfigError, match="tree-width"):
        core.add_request(Request(0, PROMPT, SamplingParams(max_tokens=16), frozenset()))


def test_an_engine_error_ends_every_request_and_frees_the_core(ckpt):
    class Broken(NgramSource):
        def propose_many(self, calls):
            raise RuntimeError("draft device lost")

    core = EngineCore(pipeline(ckpt, 2), "specpipe", Broken(), width=4, kv_blocks=32, block_size=16)
    reqs = [Request(i, PROMPT, SamplingParams(max_tokens=8), frozenset()) for i in range(3)]
    with pytest.raises(RuntimeError, match="draft device lost"):
        core.run(reqs)
    assert [r.finish_reason for r in reqs] == ["error"] * 3 and "draft device lost" in reqs[0].error
    assert not core.scheduler.has_work() and not core.requests


@pytest.mark.parametrize("mode", ["pp", "specpipe"])
def test_a_request_refused_by_add_request_leaves_the_core_serving(ckpt, mode):
    """An empty prompt reaching the core directly (the server refuses it before) used to be
    registered before its state was built: the state failed, and the next step died on a
    request without one."""
    pipe = pipeline(ckpt, 2)
    core = EngineCore(pipe, mode, NgramSource() if mode != "pp" else None, width=4, kv_blocks=32, block_size=16)
    with pytest.raises(ValueError):
        core.add_request(Request(0, [], SamplingParams(max_tokens=4), frozenset()))
    ok = Request(1, PROMPT, SamplingParams(max_tokens=4), frozenset())
    core.add_request(ok)
    while core.has_work():
        core.step()
    assert len(ok.output_ids) == 4
    assert all(w.slots.total_in_use() == 0 for w in pipe.workers)


def test_a_state_that_fails_to_build_is_never_registered(ckpt, monkeypatch):
    core = EngineCore(pipeline(ckpt, 2), "pp", kv_blocks=32, block_size=16)

    def broken(req):
        raise RuntimeError("state")

    monkeypatch.setattr(core, "_new_state", broken)
    with pytest.raises(RuntimeError):
        core.add_request(Request(0, PROMPT, SamplingParams(max_tokens=4), frozenset()))
    assert not core.has_work() and not core.requests


def test_what_add_request_accepts_can_be_admitted(ckpt):
    """The size check used the whole pool, admission the pool minus its watermark: a request in
    between was accepted and then waited at the head of the queue forever."""
    core = EngineCore(pipeline(ckpt, 2), "pp", kv_blocks=8, block_size=16)  # 128 slots, watermark 1 block
    assert core.scheduler.admissible_tokens == 112
    with pytest.raises(ConfigError, match="KV pool admits 112"):
        core.add_request(Request(0, list(range(1, 101)), SamplingParams(max_tokens=20), frozenset()))
    assert not core.has_work()
    fits = Request(1, list(range(1, 101)), SamplingParams(max_tokens=12), frozenset())
    core.add_request(fits)
    for _ in range(100):
        if not core.has_work():
            break
        core.step()
    assert fits.finish_reason == "length" and len(fits.output_ids) == 12


class NaNForOne(NgramSource):
    """Scores NaN for one request's children, as a draft model whose logits overflowed might."""

    def __init__(self, victim_pid: int):
        super().__init__()
        self.victim = victim_pid

    def propose_many(self, calls):
        outs = super().propose_many(calls)
        return [{n: [(t, float("nan")) for t, _ in c] for n, c in out.items()} if call.request_id == self.victim
                else out for call, out in zip(calls, outs)]


@pytest.mark.parametrize("mode", ["tree", "specpipe"])
def test_a_drafting_fault_of_one_request_ends_that_request_only(ckpt, mode):
    """A NaN in one request's draft scores makes TokenTree.expand raise: that request ends with
    an error naming the cause, the step still returns, the others decode as if alone."""
    pipe = pipeline(ckpt, 2)
    prompts = [PROMPT, PROMPT[::-1], PROMPT[3:]]
    want = []
    for i, p in enumerate(prompts):
        ref = Request(i, p, SamplingParams(max_tokens=12), frozenset())
        decode(pipe, ref, "pp", kv_blocks=32, block_size=16)
        want.append(ref.output_ids)
    core = EngineCore(pipe, mode, NaNForOne(victim_pid=1), width=4, kv_blocks=32, block_size=16)
    reqs = [Request(i, p, SamplingParams(max_tokens=12), frozenset()) for i, p in enumerate(prompts)]
    for r in reqs:
        core.add_request(r)
    finished = []
    while core.has_work():
        finished += core.step()  # never raises: the fault is the request's, not the engine's
    assert sorted(r.request_id for r in finished) == [0, 1, 2]
    assert reqs[1].finish_reason == "error" and "drafting failed" in reqs[1].error and "nan" in reqs[1].error
    assert [reqs[0].output_ids, reqs[2].output_ids] == [want[0], want[2]]
    assert all(w.slots.total_in_use() == 0 for w in pipe.workers) and not core.requests


def test_the_slot_tables_dropped_sets_stay_bounded_over_a_long_request(ckpt):
    """Every stage and the draft remember pruned node ids only while their rows can still arrive,
    not for the request's whole life; the output is still the plain decode's."""
    from specpipe.config import StageSpec
    from specpipe.spec_decode.draft_model import DraftModelSource

    pipe = LocalPipeline([StageWorker(build_stage(ckpt, s), 64, 16) for s in partition_layers(4, 4)])
    ref = Request(0, PROMPT, SamplingParams(max_tokens=60), frozenset())
    decode(pipe, ref, "pp", kv_blocks=64, block_size=16)
    draft = DraftModelSource(build_stage(ckpt, StageSpec(0, 1, True, True)), 64, 16, "self:1")
    core = EngineCore(pipe, "specpipe", draft, width=4, kv_blocks=64, block_size=16)
    req = Request(1, PROMPT, SamplingParams(max_tokens=60), frozenset())
    core.add_request(req)
    tables = [w.slots for w in pipe.workers] + [draft.slots]
    most = [0] * len(tables)
    while core.has_work():
        core.step()
        for i, t in enumerate(tables):
            most[i] = max([most[i]] + [len(r.dropped) for r in t.requests.values()])
    assert req.output_ids == ref.output_ids
    assert req.stats.drafted - req.stats.hits > 150  # many nodes were pruned over its life
    assert max(most) <= 4 * 4 * 6, most  # a few steps' prunings (width 4, up to 4 + 2 steps), not all


def test_a_request_whose_draft_ran_out_of_kv_drafts_again(ckpt):
    """A draft pool too small for two requests at once: the one that runs out is recomputed
    (counted in its stats) and drafts again once the other has finished; tokens unchanged."""
    from specpipe.config import StageSpec
    from specpipe.spec_decode.draft_model import DraftModelSource

    pipe = pipeline(ckpt, 2)
    prompts, lens = [PROMPT, PROMPT[::-1] + PROMPT], [8, 24]
    want = []
    for i, (p, n) in enumerate(zip(prompts, lens)):
        ref = Request(i, p, SamplingParams(max_tokens=n), frozenset())
        decode(pipe, ref, "pp", kv_blocks=32, block_size=16)
        want.append(ref.output_ids)
    draft = DraftModelSource(build_stage(ckpt, StageSpec(0, 1, True, True)), 4, 16, "self:1")
    core = EngineCore(pipe, "specpipe", draft, width=4, kv_blocks=32, block_size=16)
    reqs = [Request(i, p, SamplingParams(max_tokens=n), frozenset()) for i, (p, n) in enumerate(zip(prompts, lens))]
    for r in reqs:
        core.add_request(r)
    drafted_after_failure = 0
    while core.has_work():
        before = reqs[1].stats.drafted
        core.step()
        if reqs[1].stats.draft_failures:
            drafted_after_failure += reqs[1].stats.drafted - before
    assert [r.output_ids for r in reqs] == want
    assert reqs[1].stats.draft_failures >= 1 and reqs[1].summary(2)["draft_failures"] >= 1
    assert drafted_after_failure > 0  # its speculation came back
    assert all(w.slots.total_in_use() == 0 for w in pipe.workers) and not draft.slots.requests
