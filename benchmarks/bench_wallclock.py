"""Wall-clock TBT of pp, tree and specpipe, measured for real on this machine (method: real run).

For each S, one Engine (the driver in this process, S stage processes on loopback) serves every
mode on the same prompts in one run, so the ratios are fair; one untimed warm-up request first.
On a 2-core machine the S stage processes and the driver (which runs the draft model) share the
two cores, so drafting cannot really overlap the stages here: see docs/benchmarks.md.

  python benchmarks/bench_wallclock.py --pair qwen --stages 2,4 --prompts-per-group 1 --tokens 16
  python benchmarks/bench_wallclock.py --pair smollm2 --stages 2 --prompts-per-group 3 --tokens 64 \
      --groups summarization,rag,math_reasoning,mt_bench --layers 1,2,3,4,auto
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from specbench import load_prompts  # noqa: E402
from specpipe.engine.default_model import default_model_path  # noqa: E402
from specpipe.config import EngineConfig  # noqa: E402
from specpipe.engine.engine import Engine  # noqa: E402
from specpipe.sampling import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=["qwen", "smollm2"], default="qwen")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--prompts-per-group", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--specpipe-width", type=int, default=8)
    ap.add_argument("--tree", default="7x8", help="tree mode DxW")
    ap.add_argument("--layers", default="1", help="specpipe layers per step to run, e.g. 1,2,3,auto (default 1)")
    ap.add_argument("--groups", default=None, help="Spec-Bench groups to use (default: all six)")
    ap.add_argument("--link-delay-ms", type=float, default=0.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.pair == "qwen":
        from model_pair import ensure_model_pair

        target, draft = ensure_model_pair()
        draft = args.draft or str(draft)
    else:
        target, draft = default_model_path(), args.draft or "ngram"
    depth, width = (int(x) for x in args.tree.split("x"))
    prompts = load_prompts(args.prompts_per_group)
    if args.groups:
        prompts = [p for p in prompts if p["group"] in args.groups.split(",")]
    layers = [x if x == "auto" else int(x) for x in args.layers.split(",")]
    modes = [("pp", {}), ("tree", dict(tree_depth=depth, tree_width=width))]
    modes += [("specpipe", dict(tree_width=args.specpipe_width, layers_per_step=d)) for d in layers]
    rows = []
    for S in (int(s) for s in args.stages.split(",")):
        cfg = EngineConfig(model=str(target), mode="specpipe", stages=S, draft=draft, transport="processes",
                           tree_width=args.specpipe_width, link_delay_ms=args.link_delay_ms,
                           stage_timeout_s=600)
        engine = Engine(cfg, progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
        try:
            engine.generate(prompts[0]["text"], SamplingParams(max_tokens=4), mode="pp")  # warm-up
            for mode, kw in modes:
                tbts, ttfts, steps, tokens = [], [], 0, 0
                for p in prompts:
                    r = engine.generate(p["text"], SamplingParams(max_tokens=args.tokens), mode=mode, **kw)
                    s = r.stats
                    if s["tbt_ms"] is not None:
                        tbts.append(s["tbt_ms"])
                    ttfts.append(s["ttft_ms"])
                    steps += s["pipeline_steps"]
                    tokens += len(r.token_ids)
                    print(f"  S={S} {mode:8s} {kw.get('layers_per_step', '')!s:4s} {p['group']:14s} {len(r.token_ids):3d} tokens, "
                          f"TBT {s['tbt_ms'] or 0:7.0f} ms, TTFT {s['ttft_ms']:6.0f} ms", file=sys.stderr, flush=True)
                rows.append({"stages": S, "mode": mode, "tokens_per_step": tokens / steps,
                             "tbt_ms": statistics.median(tbts), "ttft_ms": statistics.median(ttfts), **kw})
        finally:
            engine.close()
    print(f"\nReal runs on this machine (2 CPU cores shared by {args.stages} stage processes and the driver), "
          f"{len(prompts)} Spec-Bench prompts x {args.tokens} tokens, greedy; target {Path(target).name}, source {draft}")
    print(f"{'S':>2s} {'mode':9s} {'d':>4s} {'tok/step':>9s} {'TBT ms':>8s} {'TTFT ms':>8s} {'TBT vs pp':>10s}")
    for r in rows:
        pp = next(x for x in rows if x["stages"] == r["stages"] and x["mode"] == "pp")
        print(f"{r['stages']:2d} {r['mode']:9s} {r.get('layers_per_step', '')!s:>4s} {r['tokens_per_step']:9.3f} "
              f"{r['tbt_ms']:8.0f} {r['ttft_ms']:8.0f} {pp['tbt_ms'] / r['tbt_ms']:9.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
