"""How well the draft knows the target's next token, measured on the target's own greedy outputs.

For every position of every reference answer (the target's greedy tokens, computed once and cached
as `specpipe bench --oracle` does), the draft proposes its top-K children given the true prefix
(one teacher-forced forward per prompt). This prints:

  * the hit ceiling by width: how often the target's token is among the draft's top w (w = 1 ... K),
    i.e. the hit rate of a tree that always holds w children of every node on the true path;
  * a reliability table: for the proposed children binned by draft probability, how often the
    target chose them. A calibrated draft has acceptance = probability in every bin; where the
    draft is overconfident, cumulative draft scores under-weight the alternatives.

    python benchmarks/draft_calibration.py --model TARGET.gguf --draft DRAFT.gguf \\
        --prompts-per-group 2 --max-tokens 48 --out results/draft_calibration.json
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specpipe.bench import offline  # noqa: E402
from specpipe.messages import NO_PARENT  # noqa: E402
from specpipe.spec_decode.sources import ProposeCall, SourceRows  # noqa: E402
from specpipe.spec_decode.tree import TokenTree  # noqa: E402

BINS = [0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0001]


def positions(source, rid: int, prompt: list[int], answer: list[int], k: int) -> list[tuple[int, list]]:
    """(target token, the draft's top-k [(token, logprob)]) for every answer position."""
    seq = prompt + answer
    rows = SourceRows(list(range(len(seq))), [NO_PARENT] + list(range(len(seq) - 1)), list(range(len(seq))), seq)
    want = list(range(len(prompt) - 1, len(seq) - 1))
    source.start(rid)
    try:
        props = source.propose_many([ProposeCall(rid, TokenTree(prompt, k), rows, want, k)])[0]
    finally:
        source.finish(rid)
    return [(seq[n + 1], props[n]) for n in want]


def analyse(samples: list[tuple[int, list]], k: int) -> dict:
    ranks = [next((i for i, (t, _) in enumerate(props) if t == target), k) for target, props in samples]
    ceiling = {w: sum(r < w for r in ranks) / len(ranks) for w in range(1, k + 1)}
    bins = [{"p_lo": lo, "p_hi": min(hi, 1.0), "proposed": 0, "accepted": 0, "p_sum": 0.0}
            for lo, hi in zip(BINS, BINS[1:])]
    for target, props in samples:
        for token, lp in props:
            p = math.exp(lp)
            b = bins[min(bisect.bisect_right(BINS, p), len(bins)) - 1]
            b["proposed"] += 1
            b["accepted"] += token == target
            b["p_sum"] += p
    for b in bins:
        n = b.pop("proposed")
        b.update(proposed=n, mean_p=b.pop("p_sum") / n if n else None, acceptance=b["accepted"] / n if n else None)
    return {"positions": len(ranks), "ceiling_by_width": ceiling, "reliability": bins}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    offline.add_arguments(p)
    p.add_argument("--top-k", type=int, default=16, help="proposals per position to look at (default 16)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    from tqdm import tqdm

    from specpipe.engine.engine import Engine
    from specpipe.sampling import SamplingParams

    prompts = offline.load_prompts(args)
    engine = Engine(offline._config(args, 1, [], transport="inproc"))
    try:
        source = engine._source()
        if not hasattr(source, "model"):
            raise SystemExit("--draft must name a draft model (the n-gram table has no probabilities)")
        sampling = SamplingParams(max_tokens=args.max_tokens)
        with tqdm(total=len(prompts), unit="prompt", file=sys.stderr) as bar:
            refs = offline._references(engine, prompts, sampling, bar)
            by_group: dict[str, list] = {}
            for prompt, ref in zip(prompts, refs):
                req = engine.prompts.make_request(prompt["text"], sampling)
                by_group.setdefault(prompt["group"], []).extend(
                    positions(source, req.request_id, req.prompt_ids, ref, args.top_k))
                bar.update(1)
    finally:
        engine.close()
    report = {"model": args.model, "draft": args.draft, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "all": analyse([s for g in by_group.values() for s in g], args.top_k),
              "groups": {g: analyse(s, args.top_k)["ceiling_by_width"] for g, s in by_group.items()}}
    a = report["all"]
    print(f"{a['positions']} positions; the target's token among the draft's top w:")
    print("  " + "  ".join(f"w={w}: {a['ceiling_by_width'][w]:.3f}" for w in (1, 2, 4, 8, 12, 16) if w <= args.top_k))
    for g, c in report["groups"].items():
        print(f"  {g:15s} " + "  ".join(f"{c[w]:.3f}" for w in (1, 2, 4, 8, 12, 16) if w <= args.top_k))
    print("draft probability -> how often the target chose that child:")
    for b in a["reliability"]:
        if b["proposed"]:
            print(f"  [{b['p_lo']:.2f}, {b['p_hi']:.2f}): {b['proposed']:5d} proposed, mean p {b['mean_p']:.3f}, "
                  f"accepted {b['acceptance']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
