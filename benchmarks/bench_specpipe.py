"""Step counts (and hit rates) of pp, tree and specpipe on Spec-Bench prompts.

Method, printed with every table:
  * reference: the target's greedy output, computed for real (in-process, one stage);
  * step counts: the decode loops, the token tree and the draft model run for real; the stages
    are replaced by OraclePipeline (specpipe/sim/oracle_pipeline.py), which delays and prunes
    rows exactly as the stages do and answers with the reference tokens. This is exact for greedy
    decoding (the committed tokens are asserted equal to the reference) and is validated against
    a real in-process pipeline run (--validate);
  * the per-stage row counts of every step are saved for the time simulator (bench_time.py).

  python benchmarks/bench_specpipe.py --pair qwen            # matched Qwen2.5-Coder 1.5B / 0.5B
  python benchmarks/bench_specpipe.py --pair smollm2 --draft ngram
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from specbench import load_prompts  # noqa: E402
from specpipe.config import StageSpec  # noqa: E402
from specpipe.engine.default_model import default_model_path  # noqa: E402
from specpipe.engine.engine import decode  # noqa: E402
from specpipe.engine.launcher import in_process  # noqa: E402
from specpipe.engine.sources import build_source  # noqa: E402
from specpipe.tokenizer.tokenizer import Tokenizer  # noqa: E402
from specpipe.loader import open_checkpoint  # noqa: E402
from specpipe.request import Request  # noqa: E402
from specpipe.sampling import SamplingParams  # noqa: E402
from specpipe.sim.oracle_pipeline import OraclePipeline  # noqa: E402

BLOCKS, BLOCK_SIZE = 256, 16  # KV pool per stage and for the draft: 4096 slots


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def models(args):
    if args.pair == "qwen":
        from model_pair import ensure_model_pair

        target, draft = ensure_model_pair()
        return target, str(draft) if args.draft is None else args.draft
    return default_model_path(), args.draft or "ngram"


def reference_outputs(target_path, ckpt, prompts_ids, max_tokens, stop_ids, cache_dir: Path) -> list[list[int]]:
    """Greedy outputs of the target, computed once and cached (keyed by model and prompts)."""
    key = hashlib.sha256(json.dumps([str(target_path), prompts_ids, max_tokens]).encode()).hexdigest()[:16]
    cache = cache_dir / f"reference-{key}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    pipe = in_process(ckpt, [StageSpec.whole(ckpt.config)], BLOCKS, BLOCK_SIZE, "cpu", torch.float32)
    outs = []
    for i, ids in enumerate(prompts_ids):
        t0 = time.perf_counter()
        req = Request(i, ids, SamplingParams(max_tokens=max_tokens), stop_ids)
        decode(pipe, req, "pp")
        outs.append(req.output_ids)
        log(f"  reference {i + 1}/{len(prompts_ids)}: {len(req.output_ids)} tokens in {time.perf_counter() - t0:.1f} s")
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(outs))
    return outs


def run_mode(pipe, mode, ids, max_tokens, stop_ids, source, width, depth) -> Request:
    """`depth`: D of a tree round in mode tree; layers per step d in specpipe (0 = 1)."""
    req = Request(0, ids, SamplingParams(max_tokens=max_tokens), stop_ids)
    if mode == "specpipe":
        decode(pipe, req, mode, source, width, layers=depth if depth == "auto" else max(1, depth))
    else:
        decode(pipe, req, mode, source, width, depth)
    return req


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=["qwen", "smollm2"], default="qwen")
    ap.add_argument("--draft", default=None, help="source spec (default: the pair's draft model; ngram for smollm2)")
    ap.add_argument("--prompts-per-group", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--stages", default="2,4,8")
    ap.add_argument("--widths", default="4,8,16", help="specpipe tree widths W")
    ap.add_argument("--width-stages", default="8", help="stage counts at which every W is run (others: --default-width)")
    ap.add_argument("--default-width", type=int, default=8)
    ap.add_argument("--trees", default="3x4,5x8,7x8,7x10", help="tree-mode DxW configurations (depth x width)")
    ap.add_argument("--configs", default=None,
                    help="explicit run list instead of the sweep, e.g. specpipe:8:8:4,tree:8:8:7,pp:2 (mode:S[:W[:D]]; "
                         "D = tree depth in tree, layers per step in specpipe)")
    ap.add_argument("--validate", action="store_true", help="check the oracle against a real in-process pipeline run")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache/specpipe/bench"))
    ap.add_argument("--out", default=None, help="write all results as JSON here")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    target_path, draft_spec = models(args)
    ckpt = open_checkpoint(target_path)
    tok = Tokenizer.from_path(target_path)
    stop_ids = frozenset(tok.eos_token_ids)
    prompts = load_prompts(args.prompts_per_group)
    prompts_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p["text"]}]),
                              add_special_tokens=False) for p in prompts]
    log(f"target {Path(target_path).name}, source {draft_spec}, {len(prompts)} prompts, {args.max_tokens} tokens")
    refs = reference_outputs(target_path, ckpt, prompts_ids, args.max_tokens, stop_ids, Path(args.cache_dir))
    source = build_source(draft_spec, ckpt, tok, BLOCKS, BLOCK_SIZE)
    stages = [int(s) for s in args.stages.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    width_stages = {int(s) for s in args.width_stages.split(",")}
    trees = [tuple(int(x) for x in t.split("x")) for t in args.trees.split(",")]

    configs = [("pp", s, 0, 0) for s in stages]
    configs += [("specpipe", s, w, 0) for s in stages for w in (widths if s in width_stages else [args.default_width])]
    configs += [("tree", s, w, d) for s in stages for d, w in trees]
    if args.configs:
        configs = []
        for item in args.configs.split(","):
            parts = item.split(":")
            configs.append((parts[0], *(x if x == "auto" else int(x) for x in parts[1:]), *([0] * (4 - len(parts)))))
    results = []
    tree_cache: dict = {}  # tree rounds do not depend on S: draft once, scale steps by S
    for mode, S, W, D in configs:
        t0 = time.perf_counter()
        rows = {"mode": mode, "stages": S, "width": W, "depth": D, "tokens": 0, "steps": 0, "hits": 0,
                "verifications": 0, "rounds": 0, "by_group": {}, "prompts": []}
        for i, (p, ids, ref) in enumerate(zip(prompts, prompts_ids, refs)):
            if mode == "tree" and (W, D, i) in tree_cache:
                req_stats, n = tree_cache[(W, D, i)]
                steps = req_stats["rounds"] * S
            else:
                pipe = OraclePipeline(S, ids + ref)
                req = run_mode(pipe, mode, ids, args.max_tokens, stop_ids, source, W, D)
                if req.output_ids != ref:
                    raise SystemExit(f"{mode} S={S} W={W} D={D}: output differs from the reference on prompt {i}")
                n, steps = len(req.output_ids), req.stats.pipeline_steps
                req_stats = {"hits": req.stats.hits, "verifications": req.stats.verifications, "rounds": req.stats.rounds,
                             "draft_calls": req.stats.draft_calls, "commits_per_step": req.stats.commits_per_step}
                # Rows each stage computed per step (the release step after the last token excluded):
                # the input of the time simulator.
                req_stats["rows_per_step"] = pipe.rows_per_step[:steps]
                if mode == "tree":
                    tree_cache[(W, D, i)] = (req_stats, n)
            rows["prompts"].append({"tokens": n, "steps": steps, **req_stats})
            log(f"    {mode} S={S} W={W} D={D} prompt {i + 1}/{len(prompts)}: {n} tokens, {steps} steps")
            rows["tokens"] += n
            rows["steps"] += steps
            for k in ("hits", "verifications", "rounds"):
                rows[k] += req_stats[k]
            g = rows["by_group"].setdefault(p["group"], [0, 0])
            g[0] += n
            g[1] += steps
        rows["tokens_per_step"] = rows["tokens"] / rows["steps"]
        rows["hit_rate"] = rows["hits"] / rows["verifications"] if rows["verifications"] else None
        rows["acceptance_length"] = rows["tokens"] / rows["rounds"] if mode == "tree" and rows["rounds"] else None
        rows["cap"] = sum(len(r) / (len(r) + S - 1) for r in refs) / len(refs)
        results.append(rows)
        log(f"{mode:9s} S={S} W={W:2d} D={D}: {rows['tokens_per_step']:.3f} tokens/step, "
            f"hit rate {rows['hit_rate'] if rows['hit_rate'] is None else round(rows['hit_rate'], 3)}, "
            f"{time.perf_counter() - t0:.0f} s")
        if args.out:  # after every configuration, so that an interrupted sweep keeps its results
            Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}))

    if args.validate:
        validate(ckpt, source, prompts_ids[0], refs[0], args.max_tokens, stop_ids, args.default_width)

    print(f"\nStep counts (method: real draft + tree + decode loop, oracle stages; exact for greedy). "
          f"{len(prompts)} Spec-Bench prompts, up to {args.max_tokens} tokens, source {draft_spec}")
    print(f"{'mode':9s} {'S':>2s} {'W':>3s} {'D/d':>4s} {'tok/step':>9s} {'cap':>6s} {'hit rate':>9s} {'accept':>7s}")
    for r in results:
        hr = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
        acc = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        print(f"{r['mode']:9s} {r['stages']:2d} {r['width']:3d} {r['depth']!s:>4s} {r['tokens_per_step']:9.3f} "
              f"{r['cap']:6.3f} {hr:>9s} {acc:>7s}")
    print("\nspecpipe tokens/step by group:")
    for r in results:
        if r["mode"] == "specpipe":
            groups = ", ".join(f"{g} {n / s:.2f}" for g, (n, s) in r["by_group"].items())
            print(f"  S={r['stages']} W={r['width']}: {groups}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}))
        log(f"wrote {args.out}")


def validate(ckpt, source, ids, ref, max_tokens, stop_ids, width) -> None:
    """Run specpipe on a real in-process pipeline at S=4 and compare with the oracle."""
    from specpipe.loader.partition import partition_layers

    pipe = in_process(ckpt, partition_layers(ckpt.config.num_layers, 4), BLOCKS, BLOCK_SIZE, "cpu", torch.float32)
    real = run_mode(pipe, "specpipe", ids, max_tokens, stop_ids, source, width, 0)
    oracle = run_mode(OraclePipeline(4, ids + ref), "specpipe", ids, max_tokens, stop_ids, source, width, 0)
    same = (real.output_ids, real.stats.pipeline_steps, real.stats.hits) == \
        (oracle.output_ids, oracle.stats.pipeline_steps, oracle.stats.hits)
    print(f"validation (S=4, W={width}, first prompt): real {real.stats.pipeline_steps} steps / "
          f"{real.stats.hits} hits, oracle {oracle.stats.pipeline_steps} steps / {oracle.stats.hits} hits: "
          f"{'identical' if same else 'DIFFERENT'}")
    if not same:
        raise SystemExit("oracle validation failed")


if __name__ == "__main__":
    main()
