"""Sliding-window KV on a real model: what the window pool saves, and that it changes no token.

Method (real run, stages in this process): one long request (Spec-Bench prompts joined to about
`--prompt-tokens` tokens) decodes `--tokens` greedy tokens twice: `pp` at S = 1, where every
layer keeps the whole context (no row budget, so no window pool), and `--mode` (a serving mode)
at `--stages`, where the sliding-window layers keep their KV in a pool of their own. The tokens
must be equal. During the second run every stage's blocks in use are read after each step;
reported: the peak blocks of each pool, the KV bytes they hold against the bytes the same
context needs with every layer in the main pool, the time per decoded token of each run, and
(arithmetic on the engine's own pool sizing, no run) how many tokens the main pool holds under
the same `--kv-memory` with and without the window pool.

    PYTHONPATH=. python benchmarks/bench_sliding_window_kv.py --model gemma3-270m --prompt-tokens 2048 --tokens 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch

from benchmarks.common import encode_prompt, resolve_model
from specpipe.bench.datasets import load_prompts
from specpipe.config import EngineConfig
from specpipe.engine.core import spec_reserve
from specpipe.engine.engine import Engine
from specpipe.engine.kv_pool import pool_blocks
from specpipe.loader import open_checkpoint
from specpipe.loader.partition import partition_layers
from specpipe.sampling import SamplingParams
from specpipe.tokenizer.tokenizer import Tokenizer


def run(config: EngineConfig, prompt: list[int], tokens: int) -> tuple[list[int], dict, float]:
    """Decode one request step by step; returns its tokens, each stage's peak blocks per pool, and
    seconds per token after the prompt."""
    engine = Engine(config)
    core = engine.core()
    req = engine.prompts.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=tokens), chat=False)
    core.add_request(req)
    peaks: dict[str, list[int]] = {"main": [0] * config.stages, "window": [0] * config.stages}
    first = None
    t0 = time.perf_counter()
    while core.has_work():
        core.step()
        if first is None and req.output_ids:
            first = time.perf_counter()
        for i, w in enumerate(engine.pipeline.workers):
            peaks["main"][i] = max(peaks["main"][i], w.slots.blocks_in_use())
            if w.slots.window is not None:
                peaks["window"][i] = max(peaks["window"][i], w.slots.window.blocks_in_use())
    per_token = (time.perf_counter() - (first or t0)) / max(1, len(req.output_ids) - 1)
    info = {"num_blocks": engine.num_blocks, "window_blocks": engine.window_blocks, "peaks": peaks}
    engine.close()
    return req.output_ids, info, per_token


ENGINE_OPTIONS = {"--mode": "specpipe-db", "--draft": "ngram", "--stages": 2, "--kv-memory": "256MiB",
                  "--max-context": 32768, "--max-num-seqs": 8}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma3-270m", help="a GGUF file, or gemma3-270m")
    for flag, default in ENGINE_OPTIONS.items():  # the second run's EngineConfig, as its CLI names them
        p.add_argument(flag, type=type(default), default=default)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    path = resolve_model(a.model)
    tok = Tokenizer.from_path(path)
    prompt: list[int] = []
    for q in load_prompts(80):
        prompt += encode_prompt(tok, q["text"])[1 if prompt else 0:]
        if len(prompt) >= a.prompt_tokens:
            break
    prompt = prompt[:a.prompt_tokens]
    base = dict(model=path, transport="inproc", kv_memory=a.kv_memory, max_context=a.max_context,
                max_num_seqs=a.max_num_seqs)
    want, _, ref_s = run(EngineConfig(**base, mode="pp", stages=1), prompt, a.tokens)
    config = EngineConfig(**base, mode=a.mode, draft=a.draft, stages=a.stages)
    got, info, got_s = run(config, prompt, a.tokens)

    cfg = open_checkpoint(path).config
    specs = partition_layers(cfg.num_layers, a.stages)
    reserve = spec_reserve(a.mode, config.tree_width, config.tree_depth, a.stages, config.layers_per_step)
    with_window = pool_blocks(config, cfg, specs, reserve)
    without = pool_blocks(config, dataclasses.replace(cfg, sliding_layers=()), specs, reserve)
    layer_block = 2 * cfg.num_kv_heads * cfg.head_dim * 4 * config.block_size  # float32 K and V
    sliding = [sum(cfg.is_sliding(i) for i in range(s.start, s.end)) for s in specs]
    held = [(m * (s.end - s.start - n) + w * n) * layer_block
            for s, n, m, w in zip(specs, sliding, info["peaks"]["main"], info["peaks"]["window"])]
    whole = [m * (s.end - s.start) * layer_block for s, m in zip(specs, info["peaks"]["main"])]
    out = {
        "model": path.rsplit("/", 1)[-1], "mode": a.mode, "stages": a.stages, "draft": a.draft,
        "prompt_tokens": len(prompt), "tokens": len(got), "equal_to_pp": got == want,
        "sliding_window": cfg.sliding_window, "sliding_layers": len(cfg.sliding_layers), "layers": cfg.num_layers,
        "peak_blocks": info["peaks"], "block_size": config.block_size,
        "kv_bytes_held": held, "kv_bytes_whole_context": whole,
        "pp_s1_ms_per_token": ref_s * 1e3, "mode_ms_per_token": got_s * 1e3,
        "kv_memory": a.kv_memory, "max_num_seqs": a.max_num_seqs,
        "main_pool_tokens_with_window_pool": with_window.blocks * config.block_size,
        "window_pool_tokens": with_window.window_blocks * config.block_size,
        "main_pool_tokens_without": without.blocks * config.block_size,
    }
    print(json.dumps(out, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
