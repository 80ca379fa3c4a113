"""The oracle pipeline reproduces a real pipeline's step counts and hits exactly (greedy)."""

import pytest

from specpipe.config import StageSpec
from engine_helpers import decode
from specpipe.loader import open_checkpoint
from specpipe.loader.partition import partition_layers
from specpipe.model.stage import build_stage
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from specpipe.sim.oracle_pipeline import OraclePipeline
from specpipe.spec_decode.draft_model import DraftModelSource
from specpipe.worker.local_pipeline import LocalPipeline
from specpipe.worker.stage_worker import StageWorker

PROMPT = [5, 17, 33, 90, 5, 17, 33, 90, 5, 17, 120, 7]


@pytest.mark.parametrize("mode", ["tree", "specpipe"])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_oracle_matches_real_pipeline(tiny_model_dir, mode, num_stages):
    ckpt = open_checkpoint(tiny_model_dir("llama"))

    def source():
        return DraftModelSource(build_stage(ckpt, StageSpec(0, 3, True, True)), 16, 16, "self:3")

    def run(pipe, mode):
        req = Request(0, PROMPT, SamplingParams(max_tokens=20), frozenset())
        if mode == "pp":
            decode(pipe, req, "pp")
        elif mode == "tree":
            decode(pipe, req, "tree", source(), 4, 3)
        else:
            decode(pipe, req, "specpipe", source(), 4)
        return req

    real_pipe = LocalPipeline([StageWorker(build_stage(ckpt, s), 16, 16)
                               for s in partition_layers(4, num_stages)])
    reference = run(real_pipe, "pp").output_ids
    real = run(real_pipe, mode)
    oracle_pipe = OraclePipeline(num_stages, PROMPT + reference)
    oracle = run(oracle_pipe, mode)
    assert oracle.output_ids == real.output_ids == reference
    assert oracle.stats.pipeline_steps == real.stats.pipeline_steps
    assert oracle.stats.hits == real.stats.hits and real.stats.hits > 0
    assert len(oracle_pipe.rows_per_step) >= real.stats.pipeline_steps


def test_oracle_matches_real_pipeline_with_many_requests(tiny_model_dir):
    """Several requests sharing steps (specpipe-db, narrowing trees): same steps, hits, tokens."""
    from specpipe.engine.core import EngineCore

    ckpt = open_checkpoint(tiny_model_dir("llama"))
    prompts = [PROMPT, PROMPT[:5], [9, 8, 7, 9, 8, 7, 9], PROMPT[3:] * 2]

    def run(pipe):
        draft = DraftModelSource(build_stage(ckpt, StageSpec(0, 3, True, True)), 64, 16, "self:3")
        core = EngineCore(pipe, "specpipe-db", draft, width=4, kv_blocks=64, block_size=16, max_num_seqs=4,
                          step_rows=10)
        reqs = [Request(i, p, SamplingParams(max_tokens=14), frozenset()) for i, p in enumerate(prompts)]
        for r in reqs:
            core.add_request(r)
        while core.has_work():
            core.step()
        return core, reqs

    real_core, real = run(LocalPipeline([StageWorker(build_stage(ckpt, s), 64, 16) for s in partition_layers(4, 2)]))
    seqs = {i: p + r.output_ids for i, (p, r) in enumerate(zip(prompts, real))}  # pids 0..3, in order
    oracle_core, oracle = run(OraclePipeline(2, seqs.__getitem__))
    assert [r.output_ids for r in oracle] == [r.output_ids for r in real]
    assert [(r.stats.pipeline_steps, r.stats.hits) for r in oracle] == \
        [(r.stats.pipeline_steps, r.stats.hits) for r in real]
    assert oracle_core.steps == real_core.steps and sum(r.stats.hits for r in real) > 0
