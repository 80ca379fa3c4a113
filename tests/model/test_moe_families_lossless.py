"""The sparse-expert families of 2026 in every mode: the tokens of plain pp. DeepSeek V2 and V3
(latent attention, a latent KV cache, DeepSeek's MoE), GLM-4.5 (`glm4_moe`) and MiniMax-M2
(`minimax_m2`; sigmoid routing with groups and a correction bias).

Each mode, greedy at S = 1 and 3 (the 4-layer tiny models split 2+1+1 at S = 3: the dense layer
and a sparse one, then sparse layers alone) and seeded at S = 2 (to keep the time down), with a
same-family draft (the target's first two layers) merged with n-grams, and prefix caching on at
the stages and in the draft: a first request, then a chat turn that repeats it, served partly from
cached blocks. Tree rows read the (latent) cache under tree masks, pruned nodes free their slots
and committed nodes move theirs; a tree row's experts and weights are those the row computed
alone in pp (the router is batch invariant, model/moe.py): the tokens must not change.
"""

from __future__ import annotations

import itertools

import pytest

from specpipe.config import MODES, SPECULATIVE_MODES, StageSpec
from specpipe.engine.core import EngineCore
from specpipe.loader import open_checkpoint
from specpipe.loader.partition import partition_layers
from specpipe.model.stage import build_stage
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.sched.prefix_cache import PrefixCache
from specpipe.spec_decode.draft_model import DraftModelSource
from specpipe.spec_decode.sources import MergedSource, NgramSource
from specpipe.worker.local_pipeline import LocalPipeline
from specpipe.worker.stage_worker import StageWorker

BLOCKS, BLOCK_SIZE = 96, 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=4321, max_tokens=12)
PROMPT = [5, 17, 33, 90, 5, 17, 33, 90, 5, 17, 120, 7, 5, 17]  # repeats, so n-grams propose too


def serve(ckpt, mode: str, num_stages: int, sampling: SamplingParams, cached: bool) -> list[Request]:
    """A first request, then a second turn whose prompt holds the first's prompt and output, on
    fresh stages under one engine core; returns both."""
    workers = [StageWorker(build_stage(ckpt, s), BLOCKS, BLOCK_SIZE)
               for s in partition_layers(ckpt.config.num_layers, num_stages)]
    if ckpt.config.mla is not None:
        assert all(w.kv.v is None for w in workers)  # every stage keeps the latent only
    source = None
    if mode in SPECULATIVE_MODES:
        draft = DraftModelSource(build_stage(ckpt, StageSpec(0, 2, first=True, last=True)), BLOCKS, BLOCK_SIZE,
                                 "self:2")
        if cached:
            draft.enable_prefix_cache(PrefixCache(BLOCK_SIZE))
        source = MergedSource([draft, NgramSource()])
    core = EngineCore(LocalPipeline(workers), mode, source, width=4, depth=3, kv_blocks=BLOCKS,
                      block_size=BLOCK_SIZE, max_num_seqs=4, step_rows=8,
                      prefix_cache=PrefixCache(BLOCK_SIZE) if cached else None)
    first = Request(0, list(PROMPT), sampling, frozenset())
    core.run([first])
    second = Request(1, PROMPT + first.output_ids + [200, 201, 202], sampling, frozenset())
    core.run([second])
    for w in workers:  # every request's KV released; only cached blocks may remain
        assert not w.slots.requests
    return [first, second]


def assert_every_mode_equals_pp(ckpt, sampling: SamplingParams, what: str) -> None:
    """Greedy at S = 1 and 3, seeded at S = 2: every mode's two requests (the second reading the
    first's prompt from the prefix cache) give pp's tokens."""
    reference = [r.output_ids for r in serve(ckpt, "pp", 1, sampling, cached=False)]
    assert all(len(out) == sampling.max_tokens and len(set(out)) > 3 for out in reference)
    for num_stages, mode in itertools.product([1, 3] if sampling.temperature == 0 else [2], MODES):
        first, second = serve(ckpt, mode, num_stages, sampling, cached=True)
        assert [first.output_ids, second.output_ids] == reference, f"{what}: {mode} at S={num_stages}"
        assert second.stats.cached_tokens >= len(PROMPT) // BLOCK_SIZE * BLOCK_SIZE, (mode, num_stages)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2"])
def test_every_mode_equals_pp(tiny_model_dir, family, sampling):
    assert_every_mode_equals_pp(open_checkpoint(tiny_model_dir(family)), sampling, family)
