#!/usr/bin/env python3
"""Standard pipeline parallelism (mode `pp`) measured for real: TBT at S = 1, 2, 4 with the
communication it costs (method: real run, this machine).

Each S runs the whole pipeline for real: the driver (this process) and S stage processes joined
by torch.distributed (gloo) on loopback, each stage process with cores/S torch threads (see
specpipe/engine/launcher.py); `--s1-inproc 1,2` adds the single-process baseline (the one stage
inside the driver) with 1 and with 2 torch threads. One Engine per S serves every prompt, so its
processes stay up across prompts; one untimed warm-up request precedes the measured ones.

Per S the table gives, over the prompts:
  tok/step      decoded tokens per pipeline step (pp: 1/S exactly)
  TBT           median over prompts of each request's mean time between tokens (SPEC §7)
  TTFT          median time to the first token (prefill crossing all S stages)
  step          TBT x tokens/step: the wall time of one pipeline step
  compute/tok   forward-pass time per decoded token, summed over the stages
  other/tok     mean TBT minus compute/tok: links (send, receive, wake-up), message encoding, the
                driver's own work; what pipelining adds on top of the model's compute
  per stage, decode steps only (the prefill is measured separately and subtracted):
  compute       ms per step spent in forward passes
  wait          ms per step blocked receiving (the pipeline bubble: waiting for the previous stage
                or the driver, plus the transfer itself)
  bytes/step    bytes sent per step (hidden states to the next stage; token ids and control from
                the last stage to the driver)

Plain PP does not make one request faster: every token still crosses all S stages one after
another, so TBT ~ the whole model's compute (split over S stages, each with fewer threads) plus
S + 1 link hops (driver -> stage 1 -> ... -> stage S -> driver).

Wall-clock figures depend on the machine being otherwise idle: the load average is printed. On a
shared 2-core machine a 2-thread torch process suffers badly when another process holds a core
(its threads wait on each other at every op), so compare the 1- and 2-thread baselines.

Usage:
  python benchmarks/bench_pp.py [--stages 1,2,4] [--prompts 4] [--tokens 32] [--link-delay-ms 0]
                                [--model PATH] [--s1-inproc 1,2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from specbench import GROUPS, load_prompts  # noqa: E402
from specpipe.config import EngineConfig  # noqa: E402
from specpipe.engine.engine import Engine  # noqa: E402
from specpipe.sampling import SamplingParams  # noqa: E402

def spread_prompts(path: Path | None, n: int) -> list[tuple[str, str]]:
    """(group, first turn) for n prompts spread over Spec-Bench's six groups: one of each group in
    turn, then the next of each group, ..."""
    per_group = load_prompts(-(-n // len(GROUPS)), path=path)
    ranked = sorted(enumerate(per_group), key=lambda ip: (ip[0] % (len(per_group) // len(GROUPS)), ip[0]))
    return [(p["group"], p["text"]) for _, p in ranked][:n]


def run_config(model: str | None, stages: int, transport: str, prompts: list[tuple[str, str]], tokens: int,
               link_delay_ms: float, threads: int = 0) -> dict:
    """One Engine at S stages serving every prompt. `threads` (in-process only): torch threads of
    the stage inside this process (0: torch's default, all cores)."""
    default_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=model, mode="pp", stages=stages, transport=transport,
                                 link_delay_ms=link_delay_ms, max_context=1024))
    startup_s = time.perf_counter() - t0
    try:
        engine.generate(prompts[0][1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up, untimed
        per_prompt = []
        for group, text in prompts:
            # The same prompt twice: prefill only (1 token), then the whole request. The difference
            # of the stage counters is the decode of tokens 2..N alone (the steps TBT measures).
            first = engine.generate(text, SamplingParams(temperature=0.0, max_tokens=1))
            r = engine.generate(text, SamplingParams(temperature=0.0, max_tokens=tokens))
            assert r.token_ids[:1] == first.token_ids
            decode = [{k: a[k] - b[k] for k in ("steps", "compute_s", "wait_s", "bytes_sent")}
                      for a, b in zip(r.stats["stages"], first.stats["stages"])]
            per_prompt.append({"group": group, "prompt_tokens": len(r.prompt_token_ids),
                               "tokens": len(r.token_ids), **{k: r.stats[k] for k in (
                                   "pipeline_steps", "tokens_per_step", "ttft_ms", "tbt_ms")},
                               "stages": r.stats["stages"], "decode_stages": decode})
    finally:
        engine.close()
        torch.set_num_threads(default_threads)
    S = stages
    dec = [{k: sum(p["decode_stages"][s][k] for p in per_prompt) for k in ("steps", "compute_s", "wait_s", "bytes_sent")}
           for s in range(S)]
    decoded = sum(p["tokens"] - 1 for p in per_prompt)  # tokens after the first
    summary = {
        "stages": S, "transport": transport, "link_delay_ms": link_delay_ms, "startup_s": startup_s,
        "threads_per_stage": max(1, (os.cpu_count() or 1) // S) if transport == "processes" else (threads or default_threads),
        "tokens_per_step": sum(p["tokens"] for p in per_prompt) / sum(p["pipeline_steps"] for p in per_prompt),
        "tbt_ms_median": statistics.median(p["tbt_ms"] for p in per_prompt if p["tbt_ms"] is not None),
        "tbt_ms_mean": sum(p["tbt_ms"] * (p["tokens"] - 1) for p in per_prompt) / decoded,
        "ttft_ms_median": statistics.median(p["ttft_ms"] for p in per_prompt),
        # decode steps only (prefill excluded), per stage
        "compute_ms_per_step": [d["compute_s"] / d["steps"] * 1e3 for d in dec],
        "wait_ms_per_step": [d["wait_s"] / d["steps"] * 1e3 for d in dec],
        "bytes_per_step": [d["bytes_sent"] / d["steps"] for d in dec],
        # per decoded token: forward passes summed over the stages, and everything else
        "compute_ms_per_token": sum(d["compute_s"] for d in dec) / decoded * 1e3,
        "prompts": per_prompt,
    }
    summary["other_ms_per_token"] = summary["tbt_ms_mean"] - summary["compute_ms_per_token"]
    summary["step_ms"] = summary["tbt_ms_median"] * summary["tokens_per_step"]
    return summary


def fmt_list(values: list[float], spec: str) -> str:
    return "/".join(format(v, spec) for v in values)


def table(results: list[dict]) -> str:
    head = ("S", "transport", "threads", "tok/step", "TBT ms (med)", "TTFT ms (med)", "step ms", "compute ms/tok",
            "other ms/tok", "compute ms/step per stage", "wait ms/step per stage", "bytes/step per stage")
    rows = [head]
    for r in results:
        rows.append((str(r["stages"]), r["transport"], str(r["threads_per_stage"]), f"{r['tokens_per_step']:.3f}", f"{r['tbt_ms_median']:.1f}",
                     f"{r['ttft_ms_median']:.0f}", f"{r['step_ms']:.1f}", f"{r['compute_ms_per_token']:.1f}",
                     f"{r['other_ms_per_token']:.1f}", fmt_list(r["compute_ms_per_step"], ".1f"),
                     fmt_list(r["wait_ms_per_step"], ".1f"), fmt_list(r["bytes_per_step"], ".0f")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--stages", default="1,2,4")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--link-delay-ms", type=float, default=0.0, help="emulated per-message link latency")
    ap.add_argument("--s1-inproc", default="", metavar="THREADS",
                    help="also S=1 with the stage inside the driver process, once per torch thread count "
                         "listed (e.g. 1,2): the single-process baseline")
    ap.add_argument("--questions", type=Path, default=None)
    ap.add_argument("--json", action="store_true", help="print all results as JSON at the end")
    args = ap.parse_args()

    prompts = spread_prompts(args.questions, args.prompts)
    configs = [(1, "inproc", int(t)) for t in args.s1_inproc.split(",") if t]
    configs += [(int(s), "processes", 0) for s in args.stages.split(",")]
    results = []
    load_before = os.getloadavg()
    for S, transport, threads in configs:
        print(f"bench_pp: S={S} ({transport}) ...", file=sys.stderr, flush=True)
        results.append(run_config(args.model, S, transport, prompts, args.tokens, args.link_delay_ms, threads))
    load_after = os.getloadavg()
    print(f"mode pp, greedy, {len(prompts)} Spec-Bench prompts ({', '.join(g for g, _ in prompts)}; first turn, "
          f"chat template), {args.tokens} tokens each, link delay {args.link_delay_ms:g} ms/message")
    print(f"method: real run, this machine ({os.cpu_count()} CPU cores); stage processes on loopback, "
          f"cores/S torch threads each; per-stage figures are stage 1/2/.../S")
    print(f"load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f} (this benchmark "
          f"alone keeps about 1-2 busy; above {os.cpu_count()}, other work shared the cores and the times suffer)")
    print(table(results))
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
