"""The central property: every speculative mode commits exactly the tokens plain decoding does.

Modes `pp`, `tree` and `specpipe` (every mode for the other families) run on the in-process pipeline (the same stage workers and
messages as the multi-process runtime, stepped in exact lock-step) at S = 1, 2, 4, 8, greedy and
with seeded sampling, for every speculative source. While they run, every stage's KV cache is
checked to hold only committed tokens plus live tree nodes, and to be empty once a request ends.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from specpipe.config import MODES, SPECULATIVE_MODES, StageSpec
from specpipe.costs.profile import CostProfile
from engine_helpers import decode
from specpipe.engine.modes.specpipe import AUTO_MAX_LAYERS
from specpipe.kernels import native
from specpipe.loader import open_checkpoint
from specpipe.loader.partition import partition_layers
from specpipe.model.stage import build_stage
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.spec_decode.draft_model import DraftModelSource
from specpipe.spec_decode.sources import MergedSource, NgramSource
from specpipe.worker.local_pipeline import LocalPipeline
from specpipe.worker.stage_worker import StageWorker

BLOCKS, BLOCK_SIZE = 64, 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24)


class CheckedPipeline(LocalPipeline):
    """LocalPipeline that asserts the KV bound after every step: at each stage, the speculative
    slots of a request never exceed the live tree (at most W nodes per layer, about S layers in
    flight, plus a new root) and committed slots never exceed the committed tokens."""

    def __init__(self, workers, width: int, max_committed: int):
        super().__init__(workers)
        self.bound = width * (self.num_stages + 8) + 1
        self.max_committed = max_committed
        self.peak_spec = 0

    def collect(self):
        out = super().collect()
        for w in self.workers:
            for r in w.slots.requests.values():
                assert len(r.spec) <= self.bound, (len(r.spec), self.bound)
                assert len(r.committed) <= self.max_committed
                self.peak_spec = max(self.peak_spec, len(r.spec))
                assert w.slots.total_in_use() == r.num_slots()  # nothing leaked from pruned nodes
        return out


def make_pipeline(ckpt, num_stages: int, width: int, max_committed: int, quantization=None) -> CheckedPipeline:
    specs = partition_layers(ckpt.config.num_layers, num_stages)
    return CheckedPipeline([StageWorker(build_stage(ckpt, s, quantization=quantization), BLOCKS, BLOCK_SIZE)
                            for s in specs], width, max_committed)


def run(pipe, mode: str, prompt: list[int], sampling: SamplingParams, source=None, width=4, depth=3,
        stop_ids=frozenset(), layers=1) -> Request:
    req = Request(0, prompt, sampling, frozenset(stop_ids))
    decode(pipe, req, mode, source, width, depth, layers=layers)
    for w in pipe.workers:  # the request was released: every slot is free again
        assert w.slots.total_in_use() == 0
        assert not w.slots.requests
    if source is not None and hasattr(source, "slots"):
        assert source.slots.total_in_use() == 0
    return req


def self_draft(ckpt, k: int) -> DraftModelSource:
    return DraftModelSource(build_stage(ckpt, StageSpec(0, k, first=True, last=True)), BLOCKS, BLOCK_SIZE, f"self:{k}")


def all_sources(target, draft_ckpt) -> dict:
    """Every kind of speculative source, each made fresh per run."""
    return {
        "ngram": lambda: NgramSource(),
        "self:2": lambda: self_draft(target, 2),
        "draft": lambda: DraftModelSource(build_stage(draft_ckpt, StageSpec.whole(draft_ckpt.config)),
                                          BLOCKS, BLOCK_SIZE, "draft"),
        "self:6+ngram": lambda: MergedSource([self_draft(target, 6), NgramSource()]),
        # a draft proposing from part of the vocabulary (--draft-vocab): every other token id
        "self:3/vocab": lambda: DraftModelSource(build_stage(target, StageSpec(0, 3, first=True, last=True)),
                                                 BLOCKS, BLOCK_SIZE, "self:3", vocab_ids=torch.arange(0, 300, 2)),
        # a draft whose weights are requantized to Q4_0 blocks (--draft-quantization int4)
        "draft/int4": lambda: DraftModelSource(build_stage(draft_ckpt, StageSpec.whole(draft_ckpt.config),
                                                           quantization="int4", requantize=True),
                                               BLOCKS, BLOCK_SIZE, "draft/int4"),
    }


@pytest.fixture(scope="module")
def tiny8(tiny_model_dir):
    """An 8-layer tiny Llama (so that S = 8 is possible) and a second tiny model as its draft."""
    target = open_checkpoint(tiny_model_dir("llama", num_hidden_layers=8))
    draft = open_checkpoint(tiny_model_dir("llama", seed=1))
    return target, draft


# A prompt with repetition, so that n-gram lookup finds something to propose.
TINY_PROMPT = [5, 17, 33, 90, 5, 17, 33, 90, 5, 17, 120, 7, 5, 17]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("num_stages", [1, 2, 4, 8])
def test_all_modes_and_sources_equal_pp_tiny(tiny8, num_stages, sampling):
    target, draft_ckpt = tiny8
    max_committed = len(TINY_PROMPT) + sampling.max_tokens
    reference = run(make_pipeline(target, 1, 1, max_committed), "pp", TINY_PROMPT, sampling).output_ids
    assert len(reference) == sampling.max_tokens

    pipe = make_pipeline(target, num_stages, 4, max_committed)
    pp = run(pipe, "pp", TINY_PROMPT, sampling)
    assert pp.output_ids == reference
    assert pp.stats.pipeline_steps == num_stages * sampling.max_tokens

    sources = all_sources(target, draft_ckpt)
    for (name, make), mode in itertools.product(sources.items(), ["tree", "specpipe"]):
        req = run(pipe, mode, TINY_PROMPT, sampling, make())
        assert req.output_ids == reference, f"{mode} with {name} differs from pp"
        steps = req.stats.pipeline_steps
        if mode == "specpipe":
            # Never slower than pp in steps, never better than the pipeline's cap N / (N + S - 1)
            # for S > 1. At S = 1 a new root and its first layer (sent together after a miss) are
            # verified in the same step, so up to two tokens can be committed per step.
            n = len(reference)
            assert steps <= num_stages * n
            assert steps >= (n + num_stages - 1 if num_stages > 1 else (n + 1) // 2)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("num_stages", [1, 2, 4, 8])
def test_quantized_target_with_fused_layers_equals_pp(tiny8, num_stages, sampling):
    """A Q4_0 target, whose layers run as one native call each where built (model/fused.py):
    every mode, a quantized draft and n-grams, one layer and auto blocks: pp's tokens."""
    target, draft_ckpt = tiny8
    max_committed = len(TINY_PROMPT) + sampling.max_tokens
    reference = run(make_pipeline(target, 1, 1, max_committed, "int4"), "pp", TINY_PROMPT, sampling).output_ids
    pipe = make_pipeline(target, num_stages, 4 * AUTO_MAX_LAYERS, max_committed, "int4")
    if native.available():
        assert all(layer.native is not None for w in pipe.workers for layer in w.model.layers.values())
    assert run(pipe, "pp", TINY_PROMPT, sampling).output_ids == reference
    every = all_sources(target, draft_ckpt)
    sources = {name: every[name] for name in ("ngram", "draft/int4")}
    for (name, make), (mode, layers) in itertools.product(sources.items(), [("tree", 1), ("specpipe", 1), ("specpipe", "auto")]):
        req = run(pipe, mode, TINY_PROMPT, sampling, make(), layers=layers)
        assert req.output_ids == reference, f"{mode} (layers={layers}) with {name} differs from pp"


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("num_stages", [1, 2, 4, 8])
def test_several_layers_per_step_equal_pp(tiny8, num_stages, sampling):
    """Blocks of d = 2, 3, 4 layers per step and auto (up to 8), every source: the same tokens as
    pp, and at every stage no more KV than committed tokens plus the live tree (d layers of W per
    step in flight)."""
    target, draft_ckpt = tiny8
    max_committed = len(TINY_PROMPT) + sampling.max_tokens
    reference = run(make_pipeline(target, 1, 1, max_committed), "pp", TINY_PROMPT, sampling).output_ids
    sources = all_sources(target, draft_ckpt)
    # At S = 8 (the longest runs in CI) the deepest fixed block and auto; the rest at S <= 4.
    for layers in ((4, "auto") if num_stages == 8 else (2, 3, 4, "auto")):
        deepest = AUTO_MAX_LAYERS if layers == "auto" else layers
        pipe = make_pipeline(target, num_stages, 4 * deepest, max_committed)
        for name, make in sources.items():
            req = run(pipe, "specpipe", TINY_PROMPT, sampling, make(), layers=layers)
            assert req.output_ids == reference, f"d={layers} with {name} differs from pp"
            assert req.stats.pipeline_steps <= num_stages * len(reference)
            assert max(req.stats.commits_per_step) <= deepest + 1  # a block, plus a new root at S = 1


def test_auto_plans_small_blocks_where_rows_cost(tiny8):
    """auto with a profile in which every row costs as much as the last: the same tokens, in
    blocks of one layer (a deeper or wider block would not pay for its rows); without a
    profile (rows free) the deepest, widest blocks."""
    target, _ = tiny8
    sampling = GREEDY
    max_committed = len(TINY_PROMPT) + sampling.max_tokens
    reference = run(make_pipeline(target, 1, 1, max_committed), "pp", TINY_PROMPT, sampling).output_ids
    rows = [1, 2, 4, 8, 16, 32, 64]
    costly = CostProfile("rows cost", rows, [[float(n) for n in rows]], [0.0] * len(rows), model={"num_layers": 8})
    shapes = {}
    for name, profile in (("costly", costly), ("free", None)):
        pipe = make_pipeline(target, 4, 4 * AUTO_MAX_LAYERS, max_committed)
        req = Request(0, TINY_PROMPT, sampling, frozenset())
        decode(pipe, req, "specpipe", self_draft(target, 7), 4, 3, layers="auto", cost_profile=profile)
        assert req.output_ids == reference, name
        shapes[name] = req.stats.block_shapes
    assert set(shapes["costly"]) == {"1x1"}
    assert max(shapes["free"], key=shapes["free"].get) == f"{AUTO_MAX_LAYERS}x4"


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_auto_stops_drafting_where_the_draft_costs_too_much(tiny8, sampling):
    """A profile in which a draft forward costs 50 stage steps: auto plans no drafting, the
    request runs as pp (pp's tokens and steps), and the draft holds nothing for it."""
    target, _ = tiny8
    max_committed = len(TINY_PROMPT) + sampling.max_tokens
    reference = run(make_pipeline(target, 1, 1, max_committed), "pp", TINY_PROMPT, sampling).output_ids
    rows = [1, 64]
    dear = CostProfile("dear draft", rows, [[1.0, 1.0]], [0.0, 0.0], [[100.0, 100.0]], model={"num_layers": 8})
    pipe = make_pipeline(target, 4, 4 * AUTO_MAX_LAYERS, max_committed)
    draft = self_draft(target, 7)
    req = Request(0, TINY_PROMPT, sampling, frozenset())
    decode(pipe, req, "specpipe", draft, 4, 3, layers="auto", cost_profile=dear)
    assert req.output_ids == reference
    assert set(req.stats.block_shapes) == {"0x0"} and req.stats.drafted == 0
    assert req.stats.pipeline_steps == 4 * len(reference)
    assert draft.slots.total_in_use() == 0 and not draft.slots.requests
    # n-gram lookup runs no model: the profile's draft does not price it, and it drafts
    req = Request(1, TINY_PROMPT, sampling, frozenset())
    decode(pipe, req, "specpipe", NgramSource(), 4, 3, layers="auto", cost_profile=dear)
    assert req.output_ids == reference and req.stats.drafted > 0 and "0x0" not in req.stats.block_shapes


def test_several_layers_pass_one_token_per_step(tiny8):
    """With a good draft, d = 4 commits more than one token in a step and beats d = 1 in steps."""
    target, _ = tiny8
    prompt, sampling = TINY_PROMPT, GREEDY
    pipe = make_pipeline(target, 4, 16, len(prompt) + sampling.max_tokens)
    one = run(pipe, "specpipe", prompt, sampling, self_draft(target, 7))
    four = run(pipe, "specpipe", prompt, sampling, self_draft(target, 7), layers=4)
    assert four.output_ids == one.output_ids
    # d = 1 commits two tokens in a step at most (a new root and its first layer after a miss).
    assert max(four.stats.commits_per_step) > 2 and max(one.stats.commits_per_step) <= 2
    assert four.stats.pipeline_steps < one.stats.pipeline_steps


def test_a_good_draft_gives_hits_and_fewer_steps(tiny8):
    """self:7 of 8 layers is close to the target: SpecPipe must turn that into hits and steps."""
    target, _ = tiny8
    prompt, sampling = TINY_PROMPT, GREEDY
    pipe = make_pipeline(target, 4, 4, len(prompt) + sampling.max_tokens)
    pp = run(pipe, "pp", prompt, sampling)
    sp = run(pipe, "specpipe", prompt, sampling, self_draft(target, 7))
    assert sp.output_ids == pp.output_ids
    assert sp.stats.hits > 0
    assert sp.stats.pipeline_steps < pp.stats.pipeline_steps
    assert pipe.peak_spec > 0  # the tree really was in flight at the stages


@pytest.mark.parametrize("mode", ["pp", "tree", "specpipe"])
def test_eos_stops_cleanly_mid_tree(tiny8, mode):
    target, _ = tiny8
    sampling = GREEDY
    pipe = make_pipeline(target, 4, 4, len(TINY_PROMPT) + sampling.max_tokens)
    full = run(pipe, "pp", TINY_PROMPT, sampling).output_ids
    stop = full[9]  # pretend this token is EOS: every mode must stop right after its first use
    expected = full[: full.index(stop) + 1]
    req = run(pipe, mode, TINY_PROMPT, sampling, None if mode == "pp" else self_draft(target, 7),
              stop_ids={stop})
    assert req.output_ids == expected
    assert req.finish_reason == "stop"


# The families of issue 21 at their tiny shape (tests/conftest.py TINY_FAMILIES: Gemma 3's window
# of 6 is shorter than the prompt, experts are top-2 of 4, Phi-3 runs its long RoPE factors).
FAMILIES = ["qwen3", "qwen3_moe", "mixtral", "gemma3_text", "phi3"]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_every_mode_equals_pp(tiny_model_dir, family, sampling):
    """Every mode at S = 1, 2, 4 (sampled: S = 2, to keep the time down) with a same-family draft
    (the target's first two layers) merged with n-grams: the same tokens as pp at S = 1."""
    target = open_checkpoint(tiny_model_dir(family))
    sampling = dataclasses.replace(sampling, max_tokens=12)  # 150 runs per family: keep each short
    max_committed = len(TINY_PROMPT) + sampling.max_tokens
    reference = run(make_pipeline(target, 1, 1, max_committed), "pp", TINY_PROMPT, sampling).output_ids
    assert len(set(reference)) > 3  # not a degenerate repetition
    for num_stages, mode in itertools.product([1, 2, 4] if sampling.temperature == 0 else [2], MODES):
        pipe = make_pipeline(target, num_stages, 4, max_committed)
        source = MergedSource([self_draft(target, 2), NgramSource()]) if mode in SPECULATIVE_MODES else None
        req = run(pipe, mode, TINY_PROMPT, sampling, source)
        assert req.output_ids == reference, f"{family}: {mode} at S={num_stages} differs from pp"


@pytest.mark.parametrize("num_stages", [1, 2, 4, 8])
def test_smollm2_modes_equal_pp(smollm2, num_stages):
    torch.manual_seed(0)
    # "1, 2, 3, 4, 5, 6" style prompt: repetitive enough for n-gram hits on a real model.
    prompt = [1, 9690, 198, 504, 3575, 282, 4649, 314, 7042, 30, 504, 3575, 282, 4649, 314, 7042, 30, 504, 3575]
    for sampling in (SamplingParams(temperature=0.0, max_tokens=12),
                     SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12)):
        pipe = make_pipeline(smollm2, num_stages, 4, len(prompt) + sampling.max_tokens)
        reference = run(pipe, "pp", prompt, sampling).output_ids
        for mode in ("tree", "specpipe"):
            source = MergedSource([self_draft(smollm2, 25), NgramSource()]) if num_stages <= 2 else NgramSource()
            req = run(pipe, mode, prompt, sampling, source)
            assert req.output_ids == reference, f"{mode} at S={num_stages} differs ({sampling})"
