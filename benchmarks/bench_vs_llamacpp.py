#!/usr/bin/env python3
"""Whole-model forward time of SpecPipe and llama.cpp on the same GGUF file, same threads: prefill,
decode (1 row) and a step of T rows (2 .. 64) after a prompt — the row cost that speculation pays.

Both engines run the whole model in this process (SpecPipe: one stage, build_stage with the
default kernels; llama.cpp: llama-cpp-python). After a prompt of P tokens, a step of T rows is
T new tokens at positions P .. P+T-1 as a causal chain over the prompt (llama.cpp's batch; for
SpecPipe the rows of a tree step cost the same, only the mask differs), logits for the last row
only on both sides; each engine's KV is cut back to the prompt before every step. Each figure
is the median of --repeats timed runs after one warm-up and a 0.2 s pause (both engines' worker
threads spin a while after a call and would take the cores from the other); the two engines
alternate per row count.

    PYTHONPATH=. python benchmarks/bench_vs_llamacpp.py [--model PATH.gguf] [--threads 2]
        [--prompt-tokens 128] [--rows 1 2 4 8 16 32 64] [--repeats 9] [--out results.json]

Prints a Markdown table: ms per step of each engine, its ratio to its own 1-row step, and
SpecPipe's speed relative to llama.cpp (llama.cpp's time / SpecPipe's).
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
import torch

from specpipe.config import StageSpec
from specpipe.loader import open_checkpoint
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_agreement import resolve_model  # noqa: E402


def timed(fn, repeats: int) -> float:
    time.sleep(0.2)  # the other engine's worker threads stop spinning and leave the cores
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file or gemma3-270m (default: the embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
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
        meta = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                "model": name, "threads": args.threads, "prompt_tokens": p, "repeats": args.repeats,
                "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
                "load_avg": os.getloadavg()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "prefill_ms": prefill, "records": records}, indent=1))
        print(f"\nsaved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
