"""Penalties, logit_bias and min_p (issue 62, item 3): applied at the last stage over each row's
own path (specpipe/penalties.py), so speculation keeps plain decoding's tokens.

  * pp at S = 1 equals a plain reference loop: transformers' forward over the whole sequence at
    every step, vLLM's rules written out token by token, the engine's keyed draw;
  * every mode (pp, pp-cb, tree, specpipe, specpipe-db, auto) at S = 1, 2, 3 gives pp's tokens,
    greedy and seeded, several penalized requests in one batch;
  * the penalties change the output (the test can fail), and logprobs stay the raw ones;
  * the penalty context round-trips through the stage processes' wire encoding.
"""

from __future__ import annotations

import math

import pytest
import torch

from specpipe import LLM
from specpipe.distributed.wire import decode_control, decode_rows_header, encode_control, encode_rows
from specpipe.messages import Admit, Control, Rows
from specpipe.penalties import adjust_logits, context_tensors
from specpipe.sampling import SamplingParams, target_tokens

PROMPTS = ["a b c a b c a b", "the cat sat on the mat, the cat sat"]
PENALIZED = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.7, logit_bias=((5, 2.5), (7, -3.0)))
GREEDY = SamplingParams(max_tokens=10, logprobs=2, **PENALIZED)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, min_p=0.05, seed=77, max_tokens=10, **PENALIZED)
# (mode, stages, layers per step)
# Each mode once, S = 1, 2 and 3 among them (and S = 2 again over stage processes, below).
MODES = [("pp", 2, 1), ("pp-cb", 3, 1), ("tree", 1, 1), ("specpipe", 3, 1), ("specpipe-db", 2, 1),
         ("specpipe-db", 3, 1), ("specpipe-db", 2, "auto")]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", num_hidden_layers=3)


def run(model, mode, stages, params_list, layers=1, transport="inproc"):
    # The target as its own draft: its top-4 holds the penalized token often (the n-gram draft
    # never hits here), so committed tokens come from speculative rows with paths of their own.
    kw = {} if mode.startswith("pp") else {"draft": str(model), "tree_width": 4, "layers_per_step": layers}
    prompts = [p for p in PROMPTS for _ in params_list]
    params = [s for _ in PROMPTS for s in params_list]
    with LLM(str(model), stages=stages, mode=mode, transport=transport, **kw) as llm:
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(model):
    return run(model, "pp", 1, [GREEDY, SEEDED])


def plain_rules(logits: torch.Tensor, prompt: list[int], generated: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's rules written out one token at a time (the reference for penalties.adjust_logits)."""
    x = logits.float().clone()
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(generated):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(generated):
        x[t] -= p.frequency_penalty * generated.count(t)
        x[t] -= p.presence_penalty
    return x


def test_pp_equals_a_plain_reference_loop(model, reference):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model), torch_dtype=torch.float32).eval()
    with LLM(str(model), stages=1, mode="pp") as llm:
        prompts = [llm.engine.prompts.encode_prompt(p, False) for p in PROMPTS]
    outs = iter(reference)
    for prompt in prompts:
        for params in (GREEDY, SEEDED):
            ids = list(prompt)
            for _ in range(params.max_tokens):
                with torch.no_grad():
                    logits = hf(torch.tensor([ids])).logits[0, -1]
                x = plain_rules(logits, prompt, ids[len(prompt):], params)[None]
                ids += [int(x.argmax()) if params.greedy else target_tokens(x, [len(ids) - 1], params)[0]]
            assert next(outs) == ids[len(prompt):]


def test_penalties_change_the_output_and_logprobs_stay_raw(model, reference):
    plain = SamplingParams(max_tokens=10, logprobs=2)
    assert run(model, "pp", 1, [plain])[0] != reference[0]
    with LLM(str(model), stages=1, mode="pp") as llm:
        out = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
        raw = llm.generate(PROMPTS[0], plain, use_tqdm=False)[0]
    # The first token's logprobs come from the same (unpenalized) distribution either way.
    assert out.logprobs[0].top_logprobs == raw.logprobs[0].top_logprobs


@pytest.mark.parametrize("mode, stages, layers", MODES)
def test_every_mode_gives_pps_tokens(model, reference, mode, stages, layers):
    assert run(model, mode, stages, [GREEDY, SEEDED], layers) == reference


def test_stage_processes_carry_the_penalty_context(model, reference):
    assert run(model, "specpipe-db", 2, [GREEDY, SEEDED], transport="processes") == reference


def test_adjust_logits_is_the_plain_rules():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    prompt, committed_out = [1, 2, 3, 2], [4, 4, 9]
    paths = [[9, 11], None, []]
    seen, path_t = context_tensors(len(prompt), prompt + committed_out, paths, GREEDY)
    got = adjust_logits(logits, GREEDY, seen, path_t)
    for i, path in enumerate(paths):
        want = plain_rules(logits[i], prompt, committed_out + list(path or ()), GREEDY)
        assert torch.allclose(got[i], want, atol=1e-6)
    nothing_seen = context_tensors(len(prompt), prompt, [[]], SamplingParams(presence_penalty=1.0))  # (2, 0), (1, 0)
    assert torch.equal(adjust_logits(logits[:1], SamplingParams(presence_penalty=1.0), *nothing_seen), logits[:1])


def test_wire_round_trip():
    control = Control(admit=[Admit(3, SEEDED), Admit(4, SamplingParams())])
    assert decode_control(encode_control(control)) == control
    seen, paths = context_tensors(2, [1, 2, 3, 3], [[4], [4, 5]], GREEDY)
    rows = Rows(9, [0, 1], [-1, 0], [4, 5], torch.tensor([4, 5]), seen=seen, paths=paths)
    header, tensors = encode_rows([rows])
    (got, shape, _), = decode_rows_header(header)
    assert got.seen.shape == seen.shape and got.paths.shape == paths.shape and len(tensors) == 3
    assert torch.equal(tensors[1], seen) and torch.equal(tensors[2], paths)


def test_bounds():
    for bad in (dict(presence_penalty=2.5), dict(repetition_penalty=0.0), dict(min_p=1.5),
                dict(logit_bias=((1, 101.0),)), dict(frequency_penalty=math.nan)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_a_stage_refuses_a_penalty_context_outside_the_vocabulary():
    from specpipe.distributed.wire import RowLimits, RowsMalformed, check_rows
    limits = RowLimits(first=True, hidden=8, dtype=torch.float32, vocab_size=50, mask_words=1, max_rows=8)
    seen, paths = context_tensors(1, [1, 2], [[3]], GREEDY)
    ok = Rows(9, [0], [-1], [2], torch.tensor([3]), seen=seen, paths=paths)
    check_rows(ok, limits)
    for bad in (dict(paths=torch.tensor([[50]])), dict(seen=torch.tensor([[60], [0]])), dict(paths=torch.tensor([[3], [4]])),
                dict(paths=None)):
        with pytest.raises(RowsMalformed):
            check_rows(Rows(9, [0], [-1], [2], torch.tensor([3]), **{"seen": seen, "paths": paths, **bad}), limits)
