"""The lossless property on quantized weights: every speculative mode commits pp's tokens.

Quantized models: a tiny Hugging Face model quantized at load to Q8_0 / Q4_0 under the default
kernel (the native one where it is built: int8 activations, where a 1-ulp difference between a
tree row and a pp row once became a different sampled token), and the default SmolLM2 GGUF (Q4_1
layers, Q8_0 tied embedding / head) with torch's int4pack kernel (bf16 activations); SmolLM2 on
the default kernel at S = 1-8 is in test_lossless.py. Target and draft (self:K) are built through
the same quantized path. S = 1 and 2 in process.
"""

from __future__ import annotations

import pytest
from engine_helpers import decode

from specpipe.config import StageSpec
from specpipe.kernels.qlinear import QuantLinear
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


def samplings(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n),
            SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=n)]


def equal_to_pp(ckpt, num_stages: int, prompt: list[int], n: int, draft_layers: int | None, **build) -> None:
    """draft_layers: a self:K draft (built the same way) merged with n-gram lookup; None: n-gram only."""
    specs = partition_layers(ckpt.config.num_layers, num_stages)
    workers = [StageWorker(build_stage(ckpt, s, **build), BLOCKS, BLOCK_SIZE) for s in specs]
    assert any(isinstance(m, QuantLinear) for m in workers[0].model.modules())
    pipe = LocalPipeline(workers)

    def run(mode, sampling, source=None):
        req = Request(0, prompt, sampling, frozenset())
        decode(pipe, req, mode, source, 4, 3, layers=1)
        return req.output_ids

    for sampling in samplings(n):
        reference = run("pp", sampling)
        for mode in ("tree", "specpipe"):
            source = NgramSource()
            if draft_layers is not None:
                draft = build_stage(ckpt, StageSpec(0, draft_layers, first=True, last=True), **build)
                source = MergedSource([DraftModelSource(draft, BLOCKS, BLOCK_SIZE, "self"), source])
            assert run(mode, sampling, source) == reference, f"{mode} at S={num_stages} differs ({sampling})"


@pytest.mark.parametrize("quantization,num_stages", [("int8", 1), ("int4", 2)])
def test_tiny_quantized_at_load(tiny_model_dir, quantization, num_stages):
    ckpt = open_checkpoint(tiny_model_dir("llama", num_hidden_layers=8))
    prompt = [5, 17, 33, 90, 5, 17, 33, 90, 5, 17, 120, 7, 5, 17]
    equal_to_pp(ckpt, num_stages, prompt, 8, 2, quantization=quantization)


@pytest.mark.parametrize("num_stages", [1, 2])
def test_smollm2_int4pack(smollm2, num_stages):
    ckpt = smollm2
    prompt = [1, 9690, 198, 504, 3575, 282, 4649, 314, 7042, 30, 504, 3575, 282, 4649, 314, 7042, 30, 504, 3575]
    # n-gram only: the draft-model path is covered above, and each draft step would pay the
    # Q8_0 head (dequantized per call without the native kernel) once more.
    equal_to_pp(ckpt, num_stages, prompt, 5, None, kernel="int4pack")
