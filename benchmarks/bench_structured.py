"""Structured output's cost and its effect on speculation.

1. Decode speed, constrained (a JSON schema) against unconstrained, in `pp` at S = 1: tokens per
   second between a request's first and last token (1000 / tbt_ms), the same prompts, runs
   interleaved (unconstrained, constrained) so that a shared machine's noise hits both alike.
2. Tokens committed per pipeline step in `specpipe` (S stages, the n-gram draft) with and
   without the schema, the same prompts.
3. The grammar's own cost, which a shared machine's noise does not blur: the time spent in the
   grammar's calls (masks along paths on the driver, the draft's candidates, applying masks at the
   last stage) per output token, against the decode time per token.

    PYTHONPATH=. python3 benchmarks/bench_structured.py --model ~/.cache/specpipe/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --max-tokens 48 --out benchmarks/results/structured_qwen1.5b_xeon.json
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.common import cpu_name, resolve_model, write_json
from specpipe import LLM, SamplingParams
from specpipe.grammar import StructuredOutput

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"], "properties": {
    "items": {"type": "array", "minItems": 3, "maxItems": 5, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "price", "tags"], "properties": {
            "name": {"type": "string", "maxLength": 24}, "price": {"type": "number"},
            "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}}}}}}}
PROMPTS = ["List three to five fruits with a price and tags, as JSON with an \"items\" array.",
           "Give a JSON inventory (\"items\": name, price, tags) of a small hardware shop."]


GRAMMAR_TIME: dict[str, float] = defaultdict(float)


def timed(owner, name: str, label: str) -> None:
    """Count the time spent in owner.name under `label`."""
    fn = getattr(owner, name)

    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            GRAMMAR_TIME[label] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def instrument() -> None:
    from specpipe.grammar.matcher import RequestGrammar
    from specpipe.worker import stage_worker

    timed(RequestGrammar, "masks", "driver_masks")
    timed(RequestGrammar, "proposals", "draft_candidates")
    timed(RequestGrammar, "accept", "commits")
    timed(stage_worker, "apply_masks", "stage_apply")


def run(llm: LLM, params: SamplingParams) -> list:
    return llm.generate(PROMPTS, [params] * len(PROMPTS), use_tqdm=False, chat=True)


def summary(outs) -> dict:
    tbt = [o.stats["tbt_ms"] for o in outs if o.stats["tbt_ms"]]
    tokens = sum(len(o.token_ids) for o in outs)
    steps = sum(o.stats["pipeline_steps"] for o in outs)
    return {"tokens": tokens, "tokens_per_s": round(1000 / statistics.mean(tbt), 2),
            "tokens_per_step": round(tokens / steps, 3), "finish": [o.finish_reason for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--stages", type=int, default=2, help="stages of the specpipe run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    model = resolve_model(a.model)
    free = SamplingParams(max_tokens=a.max_tokens)
    json_ = SamplingParams(max_tokens=a.max_tokens, structured=StructuredOutput(json_schema=SCHEMA))
    result = {"cpu": cpu_name(), "threads": torch.get_num_threads(), "model": model, "max_tokens": a.max_tokens}
    instrument()
    with LLM(model=model, transport="inproc") as llm:
        warm = dataclasses.replace(json_, max_tokens=4)
        run(llm, dataclasses.replace(free, max_tokens=4))  # warm up: kernels, the grammar's tokenizer view
        run(llm, warm)
        rates = {"free": [], "json": []}
        tokens, ms_per_token = 0, []
        GRAMMAR_TIME.clear()
        for _ in range(a.repeats):
            for k, p in (("free", free), ("json", json_)):
                s = summary(run(llm, p))
                rates[k].append(s["tokens_per_s"])
                if k == "json":
                    tokens += s["tokens"]
                print("pp", k, s, flush=True)
    pp = {k: round(statistics.median(v), 2) for k, v in rates.items()}
    result["pp_s1_tokens_per_s"] = {**pp, "ratio": round(pp["json"] / pp["free"], 3), "runs": rates}
    grammar_ms = {k: round(v * 1e3 / tokens, 3) for k, v in GRAMMAR_TIME.items()}
    result["pp_s1_grammar_ms_per_token"] = {**grammar_ms, "total": round(sum(grammar_ms.values()), 3),
                                            "decode_ms_per_token": round(1000 / pp["free"], 1)}
    print("grammar", result["pp_s1_grammar_ms_per_token"], flush=True)
    with LLM(model=model, stages=a.stages, mode="specpipe", draft="ngram", transport="inproc") as llm:
        GRAMMAR_TIME.clear()
        spec = {k: summary(run(llm, p)) for k, p in (("free", free), ("json", json_))}
    spec["grammar_ms_per_token"] = {k: round(v * 1e3 / spec["json"]["tokens"], 3) for k, v in GRAMMAR_TIME.items()}
    print("specpipe", spec, flush=True)
    result[f"specpipe_s{a.stages}_ngram"] = spec
    print(result)
    if a.out:
        write_json(a.out, result)


if __name__ == "__main__":
    main()
