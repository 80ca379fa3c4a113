"""Logprobs (issue 62, item 1): computed at the last stage for the rows it computes, kept by the
driver for committed nodes only, so every mode at every stage count gives plain decoding's values.

  * pp, tree, specpipe, specpipe-db at S = 1, 2, 3, greedy and seeded: the same tokens and the
    same log-probabilities, bitwise (the CPU kernels are batch-invariant), as `pp` at S = 1;
  * through stage processes (the Results' wire encoding) the same again;
  * the values are those of a direct log_softmax of the target's logits (transformers' forward
    on the same weights), before temperature and top-p, as vLLM returns by default;
  * the encoding round-trips, and the bounds are checked.
"""

from __future__ import annotations

import math

import pytest
import torch

from specpipe import LLM
from specpipe.distributed.wire import WireError, decode_control, decode_results, encode_control, encode_results
from specpipe.messages import Admit, Control, Results
from specpipe.sampling import MAX_LOGPROBS, SamplingParams, TokenLogprobs

PROMPTS = ["the cat sat on the mat, the cat sat", "a b c a b c a b"]
GREEDY = SamplingParams(max_tokens=16, logprobs=5)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=16, logprobs=5)
MODES = [("pp", 2), ("pp", 3), ("tree", 1), ("tree", 2), ("tree", 3), ("specpipe", 1), ("specpipe", 2),
         ("specpipe", 3), ("specpipe-db", 1), ("specpipe-db", 2), ("specpipe-db", 3)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_hidden_layers=4)


def run(model, mode: str, stages: int, params: SamplingParams, transport: str = "inproc"):
    kw = {} if mode.startswith("pp") else {"draft": "ngram", "tree_width": 4}
    with LLM(str(model), stages=stages, mode=mode, transport=transport, **kw) as llm:
        return llm.generate(PROMPTS, params, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(model):
    return {name: run(model, "pp", 1, params) for name, params in (("greedy", GREEDY), ("seeded", SEEDED))}


@pytest.mark.parametrize("mode, stages", MODES)
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_every_mode_gives_pps_logprobs(model, reference, mode, stages, sampling):
    outs = run(model, mode, stages, GREEDY if sampling == "greedy" else SEEDED)
    for out, ref in zip(outs, reference[sampling]):
        assert out.token_ids == ref.token_ids
        assert len(out.logprobs) == len(out.token_ids) > 0
        assert out.logprobs == ref.logprobs  # bitwise: floats compared exactly


def test_stage_processes_carry_the_same_logprobs(model, reference):
    for out, ref in zip(run(model, "specpipe-db", 2, SEEDED, transport="processes"), reference["seeded"]):
        assert out.token_ids == ref.token_ids and out.logprobs == ref.logprobs


def test_values_are_the_targets_raw_log_softmax(model, reference):
    """transformers' forward over prompt + output: at each output position, the chosen token's
    log-probability and the top 5 of log_softmax(logits), before temperature and top-p."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32).eval()
    for sampling in ("greedy", "seeded"):
        for out in reference[sampling]:
            ids = out.prompt_token_ids + out.token_ids
            with torch.no_grad():
                logits = hf(torch.tensor([ids])).logits[0].float()  # (T, V)
            lp = torch.log_softmax(logits, dim=-1)[len(out.prompt_token_ids) - 1:-1]  # (N, V): row i picks token i
            for i, (tok, mine) in enumerate(zip(out.token_ids, out.logprobs)):
                assert math.isclose(mine.logprob, float(lp[i, tok]), abs_tol=1e-4), (i, mine.logprob, float(lp[i, tok]))
                top_lp, top_ids = lp[i].topk(5)
                assert list(mine.top_ids) == top_ids.tolist()
                assert mine.top_logprobs == pytest.approx(top_lp.tolist(), abs=1e-4)
                assert list(mine.top_logprobs) == sorted(mine.top_logprobs, reverse=True)
            if sampling == "greedy":  # the chosen token is the top one
                assert all(t == x.top_ids[0] and x.logprob == x.top_logprobs[0]
                           for t, x in zip(out.token_ids, out.logprobs))


def test_vllm_shaped_outputs(reference):
    out = reference["greedy"][0]
    first = out.outputs[0].logprobs[0]
    assert set(first) == set(out.logprobs[0].top_ids)
    assert first[out.token_ids[0]].rank == 1 and first[out.token_ids[0]].logprob == out.logprobs[0].logprob


def test_no_logprobs_unless_asked(model):
    out = run(model, "specpipe", 2, SamplingParams(max_tokens=4))[0]
    assert out.logprobs is None and out.outputs[0].logprobs is None


def test_wire_round_trip_and_bounds():
    lps = [TokenLogprobs(-0.5, (3, 7), (-0.25, -1.5)), TokenLogprobs(-2.0, (9, 3), (-0.1, -2.0))]
    res = [Results(4, [10, 11], [3, 9], logprobs=lps), Results(5, [12], [1]), Results(6, [], [], failed=True)]
    assert decode_results(encode_results(res)) == res
    values = encode_results([Results(4, [10], [3], logprobs=[TokenLogprobs(-0.5)])])
    assert decode_results(values)[0].logprobs == [TokenLogprobs(-0.5)]  # logprobs=0: the token's own only
    bad = encode_results([Results(4, [10], [3], logprobs=[TokenLogprobs(-0.5, (1,) * 21, (0.0,) * 21)])])
    with pytest.raises(WireError, match="top logprobs"):
        decode_results(bad)
    with pytest.raises(ValueError):
        encode_results([Results(4, [10, 11], [3, 9], logprobs=lps[:1])])
    control = Control(admit=[Admit(3, SamplingParams(logprobs=7)), Admit(4, SamplingParams())])
    assert decode_control(encode_control(control)) == control
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)
