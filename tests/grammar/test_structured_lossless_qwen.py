"""The structured-output lossless check on a real 1.5B model: Qwen2.5-Coder 1.5B (Q4_K_M), five
constraints, greedy, plain constrained decoding (pp, S = 1) against tree, specpipe and specpipe-db
at S = 2 and 4 with the n-gram draft. Skipped where the file is not downloaded (CI: it is not;
benchmarks/model_pair.py fetches it); a few minutes on 2 cores."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from constraints import CONSTRAINTS, check_output
from specpipe import LLM, SamplingParams

QWEN = Path.home() / ".cache/specpipe/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
pytestmark = pytest.mark.skipif(not QWEN.exists(), reason="the Qwen2.5-Coder 1.5B GGUF is not downloaded")
RUNS = [("tree", 2), ("specpipe", 2), ("specpipe-db", 4)]


def _generate(mode, stages):
    names = list(CONSTRAINTS)
    params = [dataclasses.replace(SamplingParams(max_tokens=40), structured=CONSTRAINTS[n][1]) for n in names]
    with LLM(model=str(QWEN), stages=stages, mode=mode, draft=None if mode == "pp" else "ngram",
             transport="inproc", tree_width=4, max_context=512) as llm:
        outs = llm.generate([CONSTRAINTS[n][0] for n in names], params, use_tqdm=False, chat=True)
    return names, outs


@pytest.fixture(scope="module")
def reference():
    names, outs = _generate("pp", 1)
    for name, out in zip(names, outs):
        if out.finish_reason == "stop":  # a 40-token cut may end mid-string; what is there still matched
            check_output(name, out.text)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("mode,stages", RUNS)
def test_qwen_constrained_output_equal(reference, mode, stages):
    _, outs = _generate(mode, stages)
    assert [o.token_ids for o in outs] == reference
