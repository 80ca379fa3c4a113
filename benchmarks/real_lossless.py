"""On a real GGUF: SpecPipe (and any other mode) gives exactly pp's tokens, prompt by prompt.

Method: real run, stages in this process (inproc). The same Spec-Bench prompts (tokenized as
benchmarks/common.py's encode_prompt does) go greedy through `pp` at S = 1 and through `--mode` at
`--stages` with `--draft`; every request's tokens must be equal. Prints one line per prompt and a
summary with tokens per step and hit rate.

    PYTHONPATH=. python benchmarks/real_lossless.py --model gemma3-270m --stages 2 --draft ngram
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.common import encode_prompt, resolve_model
from specpipe import LLM, SamplingParams
from specpipe.bench.datasets import load_prompts
from specpipe.tokenizer.tokenizer import Tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file, or gemma3-270m (default: the embedded SmolLM2)")
    p.add_argument("--mode", default="specpipe")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--draft", default="ngram")
    p.add_argument("--prompts-per-group", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tok = Tokenizer.from_path(path)
    prompts = [encode_prompt(tok, q["text"]) for q in load_prompts(args.prompts_per_group)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens)
    with LLM(model=path, mode="pp", transport="inproc") as llm:
        reference = llm.generate(prompts, greedy)
    with LLM(model=path, mode=args.mode, stages=args.stages, draft=args.draft, transport="inproc") as llm:
        outputs = llm.generate(prompts, greedy)
    equal = 0
    for ref, out in zip(reference, outputs):
        same = ref.token_ids == out.token_ids
        equal += same
        print(json.dumps({"equal": same, "tokens": len(out.token_ids), "tokens_per_step": out.stats["tokens_per_step"],
                          "hit_rate": out.stats["hit_rate"]}), flush=True)
    print(json.dumps({"model": path.rsplit("/", 1)[-1], "mode": args.mode, "stages": args.stages, "draft": args.draft,
                      "prompts": len(prompts), "equal_to_pp": equal}))


if __name__ == "__main__":
    main()
