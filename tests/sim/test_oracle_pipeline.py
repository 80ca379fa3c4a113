"""The oracle pipeline reproduces a real pipeline's step counts and hits exactly (greedy)."""

import pytest

from specpipe.config import StageSpec
from specpipe.engine.decode_rounds import decode_rounds
from specpipe.engine.decode_specpipe import decode_specpipe
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
        return DraftModelSource(build_stage(ckpt, StageSpec(0, 3, True, True)), 256, "self:3")

    def run(pipe, mode):
        req = Request(0, PROMPT, SamplingParams(max_tokens=20), frozenset())
        if mode == "pp":
            decode_rounds(pipe, req)
        elif mode == "tree":
            decode_rounds(pipe, req, source(), 3, 4)
        else:
            decode_specpipe(pipe, req, source(), 4)
        return req

    real_pipe = LocalPipeline([StageWorker(build_stage(ckpt, s), 256)
                               for s in partition_layers(4, num_stages)])
    reference = run(real_pipe, "pp").output_ids
    real = run(real_pipe, mode)
    oracle_pipe = OraclePipeline(num_stages, PROMPT + reference)
    oracle = run(oracle_pipe, mode)
    assert oracle.output_ids == real.output_ids == reference
    assert oracle.stats.pipeline_steps == real.stats.pipeline_steps
    assert oracle.stats.hits == real.stats.hits and real.stats.hits > 0
    assert len(oracle_pipe.rows_per_step) >= real.stats.pipeline_steps
