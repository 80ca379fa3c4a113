"""Prompt logprobs (issue 62, item 2; vLLM's `prompt_logprobs`, the server's echo): the prefill's
rows are scored on the next prompt token at the last stage, only for a request that asks.

  * the values equal a single forward's log_softmax (transformers, the same weights), the first
    token's None, with the top k at each position;
  * the same in a speculative mode over stage processes (the wire's SCORED rows), with chunked
    prefill and a prompt the prefix cache holds (a scoring request computes all of it anyway);
  * the output is unchanged by asking.
"""

from __future__ import annotations

import pytest
import torch

from specpipe import LLM
from specpipe.distributed.wire import decode_rows_header, encode_rows
from specpipe.messages import Rows
from specpipe.sampling import SamplingParams

PROMPT = "the cat sat on the mat and the dog sat on the log, then the cat saw the dog and ran away"
ASK = SamplingParams(max_tokens=4, prompt_logprobs=3, logprobs=1)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_hidden_layers=2)


def generate(model, params, **kw):
    with LLM(str(model), **kw) as llm:
        return [llm.generate(PROMPT, p, use_tqdm=False)[0] for p in params]


def test_prompt_logprobs_are_a_single_forwards_log_softmax(model):
    transformers = pytest.importorskip("transformers")
    out, plain = generate(model, [ASK, SamplingParams(max_tokens=4, logprobs=1)], stages=1, mode="pp")
    assert out.token_ids == plain.token_ids and plain.prompt_logprobs is None
    for a, b in zip(out.logprobs, plain.logprobs):  # the output's own, trimmed to its top count
        assert a.top_ids == b.top_ids and a.logprob == pytest.approx(b.logprob, abs=1e-5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32).eval()
    ids = out.prompt_token_ids
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)  # (T, V)
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for i in range(1, len(ids)):
        mine = out.prompt_logprobs[i]
        assert mine.logprob == pytest.approx(float(lp[i - 1, ids[i]]), abs=1e-4)
        top_lp, top_ids = lp[i - 1].topk(3)
        assert list(mine.top_ids) == top_ids.tolist()
        assert list(mine.top_logprobs) == pytest.approx(top_lp.tolist(), abs=1e-4)


def test_speculative_stage_processes_chunked_and_cached(model):
    ref = generate(model, [ASK], stages=1, mode="pp")[0]
    # The first request fills the prefix cache; the second, scoring, computes its whole prompt.
    warm, out = generate(model, [SamplingParams(max_tokens=2), ASK], stages=2, mode="specpipe-db", draft="ngram",
                         transport="processes", max_step_rows=8, max_num_seqs=4)
    assert out.prompt_logprobs == ref.prompt_logprobs and out.token_ids == ref.token_ids
    assert out.logprobs == ref.logprobs


def test_scored_rows_round_trip_the_wire():
    rows = Rows(3, [0, 1, 2], [-1, 0, 1], [0, 1, 2], torch.tensor([5, 6, 7]), head_rows=[0, 1, 2], scored=[6, 7, -1])
    header, _ = encode_rows([rows])
    (got, _, _), = decode_rows_header(header)
    assert got.scored == [6, 7, -1] and got.head_rows == [0, 1, 2]
    assert rows.select([1, 2]).scored == [7, -1]
