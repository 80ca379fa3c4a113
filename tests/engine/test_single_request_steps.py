"""Regression: the single-request modes keep their exact step counts on the engine core.

`data/single_request_steps.json` was recorded with the decode loops the engine core replaced
(the last commit before it): for every mode, source, S = 1, 2, 4, 8, greedy and seeded sampling
and three prompts, the tokens and pipeline steps of one request alone. The core must give the same
tokens and the same steps per prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specpipe.config import StageSpec
from engine_helpers import decode
from specpipe.loader import open_checkpoint
from specpipe.loader.partition import partition_layers
from specpipe.model.stage import build_stage
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.spec_decode.draft_model import DraftModelSource
from specpipe.spec_decode.sources import MergedSource, NgramSource
from specpipe.worker.local_pipeline import LocalPipeline
from specpipe.worker.stage_worker import StageWorker

BASELINE = json.loads((Path(__file__).parent / "data" / "single_request_steps.json").read_text())
BLOCKS, BLOCK = 64, 16


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    target = open_checkpoint(tiny_model_dir("llama", num_hidden_layers=8))
    draft = open_checkpoint(tiny_model_dir("llama", seed=1))
    return target, draft


def make_source(name, target, draft):
    def self_draft(k):
        return DraftModelSource(build_stage(target, StageSpec(0, k, True, True)), BLOCKS, BLOCK, f"self:{k}")
    return {
        "none": lambda: None,
        "ngram": NgramSource,
        "self:2": lambda: self_draft(2),
        "self:7": lambda: self_draft(7),
        "draft": lambda: DraftModelSource(build_stage(draft, StageSpec.whole(draft.config)), BLOCKS, BLOCK, "draft"),
        "self:6+ngram": lambda: MergedSource([self_draft(6), NgramSource()]),
    }[name]()


@pytest.mark.parametrize("stages", [1, 2, 4, 8])
def test_same_tokens_and_steps_as_before_the_core(models, stages):
    target, draft = models
    pipe = LocalPipeline([StageWorker(build_stage(target, s), BLOCKS, BLOCK)
                          for s in partition_layers(target.config.num_layers, stages)])
    runs = [r for r in BASELINE["runs"] if r["stages"] == stages]
    assert runs
    for r in runs:
        sampling = SamplingParams(**BASELINE["samplings"][r["sampling"]])
        req = Request(0, list(BASELINE["prompts"][r["prompt"]]), sampling, frozenset())
        decode(pipe, req, r["mode"], make_source(r["source"], target, draft), r["width"], r["depth"],
               kv_blocks=BLOCKS, block_size=BLOCK)
        what = f"{r['mode']} {r['source']} S={stages} {r['sampling']} prompt {r['prompt']}"
        assert req.output_ids == r["tokens"], what
        assert (req.stats.pipeline_steps, req.stats.hits) == (r["steps"], r["hits"]), what
        for w in pipe.workers:
            assert w.slots.total_in_use() == 0, what  # the release rode on the last step
