"""Prefix caching, measured: a multi-turn chat, many requests sharing a system prompt, and requests
that share nothing (what the cache costs where it cannot help). Real runs, each scenario with and
without the cache in two engines of the same configuration (docs/benchmarks.md, "Prefix caching").

  chat     a ten-turn chat (Spec-Bench questions as the user's turns, the model's replies kept):
           time to first token of each turn with the cache, against prefilling only the tokens
           the cache did not hold (that many tokens of the turn's prompt, alone, without the
           cache); total time with and without. With --llamacpp, llama-cpp-python on the same ids:
           its context keeps the previous prompt, and it evaluates only what follows the longest
           common prefix (reset before each turn for "without").
  shared   N requests at once, each a long shared system prompt plus its own question:
           throughput (output tokens/s over the wall time of all) with and without.
  noreuse  distinct prompts with nothing in common (raw text, no chat template): throughput with
           and without, one request at a time then all at once.

  python benchmarks/bench_prefix_cache.py --model TARGET --stages 2 --scenario chat --llamacpp \\
      --out benchmarks/results/prefix_cache_chat_qwen1.5b_xeon.json
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import cpu_name, resolve_model, write_json

from specpipe import LLM, SamplingParams
from specpipe.bench.datasets import load_prompts


def make_llm(args, cached: bool) -> LLM:
    return LLM(args.model, stages=args.stages, mode=args.mode, enable_prefix_caching=cached,
               kv_memory=args.kv_memory, max_context=args.max_context)


def chat(args) -> dict:
    questions = [p["text"] for p in load_prompts(args.turns, offset=args.offset)][:args.turns]
    sp = SamplingParams(max_tokens=args.tokens)
    turns = {}
    for cached in (True, False):
        llm = make_llm(args, cached)
        try:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
            llm.reset_prefix_cache()
            messages, rows, t0 = [], [], time.perf_counter()
            for q in questions:
                messages.append({"role": "user", "content": q})
                out = llm.chat([messages], sp)[0]
                messages.append({"role": "assistant", "content": out.text})
                rows.append({"prompt_tokens": len(out.prompt_token_ids), "prompt_ids": out.prompt_token_ids,
                             "cached": out.stats.get("cached_tokens", 0), "ttft_ms": out.stats["ttft_ms"],
                             "output_tokens": len(out.token_ids)})
            turns[cached] = {"total_s": time.perf_counter() - t0, "turns": rows}
            if not cached:  # the reference: only the tokens the cache did not hold, alone
                for row in turns[True]["turns"]:
                    new = row["prompt_ids"][row["cached"]:]
                    ref = llm.generate([new], SamplingParams(max_tokens=1))[0]
                    row["new_tokens"], row["new_only_ttft_ms"] = len(new), ref.stats["ttft_ms"]
                    row["ttft_vs_new_only"] = row["ttft_ms"] / ref.stats["ttft_ms"]
        finally:
            llm.close()
    with_, without = turns[True], turns[False]
    later = [r["ttft_vs_new_only"] for r in with_["turns"][1:]]
    out = {"with_cache": with_, "without_cache": without,
           "total_speedup": without["total_s"] / with_["total_s"],
           "ttft_vs_new_only_median_turns_2_on": statistics.median(later) if later else None,
           "ttft_vs_new_only_max_turns_2_on": max(later) if later else None}
    if args.llamacpp:
        out["llamacpp"] = llamacpp_chat(args, [r["prompt_ids"] for r in with_["turns"]])
    for rows in (with_["turns"], without["turns"]):
        for r in rows:
            del r["prompt_ids"]
    return out


def llamacpp_chat(args, prompts: list[list[int]]) -> dict:
    from llama_cpp import Llama

    llm = Llama(args.model, n_ctx=args.max_context, n_threads=args.threads, verbose=False)
    res = {}
    for reuse in (True, False):
        llm.reset()
        ttft, t0 = [], time.perf_counter()
        for ids in prompts:
            if not reuse:
                llm.reset()
            start = time.perf_counter()
            first = None
            for _ in llm.create_completion(ids, max_tokens=args.tokens, temperature=0.0, stream=True):
                if first is None:
                    first = time.perf_counter() - start
            ttft.append(first * 1e3)
        res["with_prompt_cache" if reuse else "without"] = {"total_s": time.perf_counter() - t0, "ttft_ms": ttft}
    res["total_speedup"] = res["without"]["total_s"] / res["with_prompt_cache"]["total_s"]
    return res


def shared(args) -> dict:
    texts = [p["text"] for p in load_prompts(80) if p["group"] == "summarization"]
    probe = make_llm(args, False)
    try:  # a system prompt of --system-tokens tokens: Spec-Bench articles, cut to length
        ids = probe.tokenizer.encode("\n".join(texts))[:args.system_tokens]
        system = probe.tokenizer.decode(ids)
        n_system = len(probe.tokenizer.encode(system))
    finally:
        probe.close()
    questions = [p["text"] for p in load_prompts(3, offset=args.offset)][:args.requests]
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    sp = SamplingParams(max_tokens=args.tokens)
    res = {"system_tokens": n_system, "requests": len(convs)}
    for cached in (True, False):
        llm = make_llm(args, cached)
        try:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.chat(convs, sp)
            dt = time.perf_counter() - t0
            tokens = sum(len(o.token_ids) for o in outs)
            res["with_cache" if cached else "without_cache"] = {
                "seconds": dt, "output_tokens": tokens, "tok_s": tokens / dt,
                "cached_tokens": sum(o.stats.get("cached_tokens", 0) for o in outs),
                "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
                "ttft_ms_median": statistics.median(o.stats["ttft_ms"] for o in outs)}
        finally:
            llm.close()
    res["throughput_ratio"] = res["with_cache"]["tok_s"] / res["without_cache"]["tok_s"]
    return res


def noreuse(args) -> dict:
    prompts = [f"{i}. {p['text']}" for i, p in enumerate(load_prompts(-(-args.requests // 6), offset=args.offset))]
    prompts = prompts[:args.requests]
    sp = SamplingParams(max_tokens=args.tokens)
    res = {"requests": len(prompts)}
    runs: dict[str, list[float]] = {}
    llms = {cached: make_llm(args, cached) for cached in (True, False)}
    try:
        for llm in llms.values():
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        for rep in range(args.repeats):  # interleaved, each first in turn, so that drift hits both alike
            for cached, llm in sorted(llms.items(), key=lambda kv: kv[0] == bool(rep % 2)):
                llm.reset_prefix_cache()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, chat=False)
                dt = time.perf_counter() - t0
                assert not any(o.stats.get("cached_tokens") for o in outs), "these prompts share no block"
                runs.setdefault("with" if cached else "without", []).append(
                    sum(len(o.token_ids) for o in outs) / dt)
    finally:
        for llm in llms.values():
            llm.close()
    res["tok_s"] = runs
    res["median_ratio"] = statistics.median(a / b for a, b in zip(runs["with"], runs["without"]))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF (default: the embedded SmolLM2)")
    p.add_argument("--scenario", choices=["chat", "shared", "noreuse"], required=True)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--mode", default="pp-cb")
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=32, help="output tokens per turn / request")
    p.add_argument("--offset", type=int, default=0, help="which Spec-Bench questions (per group)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-memory", default="1GiB")
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--llamacpp", action="store_true", help="chat: llama-cpp-python's prompt cache beside it")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.model = resolve_model(args.model)
    result = {"scenario": args.scenario, "model": args.model, "cpu": cpu_name(), "stages": args.stages,
              "mode": args.mode, "method": "real run", "date": time.strftime("%Y-%m-%d"),
              **{"chat": chat, "shared": shared, "noreuse": noreuse}[args.scenario](args)}
    summary = {k: v for k, v in result.items() if k not in ("with_cache", "without_cache")}
    print(summary)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
