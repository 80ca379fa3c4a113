"""Simulated time between tokens (TBT) at any stage count, from exact step traces and a measured
cost profile (method: simulation, specpipe/sim/timing.py).

  python benchmarks/bench_time.py --steps qwen_steps.json --profile qwen_profile.json [--link-ms 0.5]

TBT = (time of the last token - time of the first) / (tokens - 1), as everywhere in SpecPipe.
pp and specpipe replay their per-step row counts (specpipe drafts each new layer while the stages
compute, and after a miss drafts the new root before the next step, serially); tree replays its rounds: draft D layers one after another (draft(1 or 2 rows) +
(D-1) x draft(W)), then the round's batch crosses the S stages one after another.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specpipe.loader.partition import partition_layers  # noqa: E402
from specpipe.sim.timing import CostProfile, simulate, stage_ms  # noqa: E402


def tbt_steps(prompt: dict, layers: list[int], prof: CostProfile, link_ms: float, overlap: bool) -> float:
    S, rows = len(layers), prompt["rows_per_step"]
    # specpipe drafts a new root (and, with d layers per step, d - 1 layers below it) at once after
    # each miss, before the step can start (not overlapped); while the stages compute it makes
    # draft_calls / steps source calls per step on average (d for a block of d layers).
    misses = prompt["verifications"] - prompt["hits"] if overlap else 0
    calls = prompt.get("draft_calls", prompt["steps"]) / max(prompt["steps"], 1) if overlap else 1.0
    after_miss = prof.draft(1) + max(0.0, calls - 1) * prof.draft(8)
    after_first = simulate(rows[S:], layers, prof, link_ms, overlap_draft=overlap, extra_ms=misses * after_miss,
                           draft_calls=calls)
    return after_first / max(prompt["tokens"] - 1, 1)


def tbt_tree(prompt: dict, layers: list[int], prof: CostProfile, link_ms: float, depth: int, width: int) -> float:
    batches = [c[0] for c in prompt["rows_per_step"] if c[0] > 0]  # one batch enters per round
    S = len(layers)
    draft = prof.draft(1) + (depth - 1) * prof.draft(width)
    rounds = [draft + sum(stage_ms(prof, layers[s], s == S - 1, n) for s in range(S)) + S * link_ms
              for n in batches]
    return sum(rounds[1:]) / max(prompt["tokens"] - 1, 1)


def balanced(num_layers: int, S: int, prof: CostProfile) -> list[int]:
    """Layer counts minimising the slowest stage for one row: the last stage also runs the head."""
    if S == 1:
        return [num_layers]
    best = None
    for last in range(1, num_layers - S + 2):
        rest = [s.end - s.start for s in partition_layers(num_layers - last, S - 1)]
        worst = max(max(rest) * prof.layer(1), last * prof.layer(1) + prof.head(1))
        if best is None or worst < best[0]:
            best = (worst, rest + [last])
    return best[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", required=True, nargs="+", help="JSON files written by bench_specpipe.py --out")
    ap.add_argument("--profile", required=True, help="JSON written by profile_costs.py")
    ap.add_argument("--link-ms", type=float, default=0.0, help="one-way latency per step and hop")
    ap.add_argument("--draft-ratio", type=float, default=None,
                    help="what-if: scale the draft's measured costs so that one draft row costs this fraction "
                         "of one row through the whole target (measured here: ~0.4; 1B vs 70B: ~0.015)")
    ap.add_argument("--flat-rows", action="store_true",
                    help="what-if: a stage costs the same for 1..64 rows (an accelerator far from saturated), "
                         "keeping the measured 1-row costs")
    ap.add_argument("--balance", action="store_true",
                    help="give the last stage fewer layers so that its LM head does not make it the slowest "
                         "(what `--stage-layers` does in a real run); default: equal layer counts")
    args = ap.parse_args()
    results = [r for f in args.steps for r in json.loads(Path(f).read_text())["results"]]
    # A tree round's drafting and acceptance do not depend on S (it costs S steps whatever S is),
    # so a tree run at one S gives the exact step counts at every other S.
    stage_counts = sorted({r["stages"] for r in results})
    for r in [r for r in results if r["mode"] == "tree"]:
        for S in stage_counts:
            if not any(x["mode"] == "tree" and x["stages"] == S and (x["width"], x["depth"]) == (r["width"], r["depth"])
                       for x in results):
                rounds = sum(p["rounds"] for p in r["prompts"])
                results.append({**r, "stages": S, "steps": rounds * S, "tokens_per_step": r["tokens"] / (rounds * S)})
    order = {"pp": 0, "tree": 1, "specpipe": 2}
    results.sort(key=lambda r: (r["stages"], order[r["mode"]], r["width"],
                                r["depth"] if isinstance(r["depth"], int) else 99))  # auto last
    pj = json.loads(Path(args.profile).read_text())
    prof = CostProfile(**pj["profile"])
    L = pj["num_layers"]
    measured_ratio = prof.draft(1) / (L * prof.layer(1) + prof.head(1))
    if args.flat_rows:
        prof.layer_ms = [prof.layer_ms[0]] * len(prof.rows)
        prof.head_ms = [prof.head_ms[0]] * len(prof.rows)
        prof.draft_ms = [prof.draft_ms[0]] * len(prof.rows)
    if args.draft_ratio is not None:
        scale = args.draft_ratio / measured_ratio
        prof.draft_ms = [d * scale for d in prof.draft_ms]
    print(f"Simulated TBT (method: simulation from exact step traces; cost profile measured on {prof.device}, "
          f"context {prof.context}; link {args.link_ms} ms per hop). Each stage is one such device. "
          f"Draft/target cost per row: measured {measured_ratio:.3f}"
          + (f", scaled to {args.draft_ratio} (what-if)" if args.draft_ratio is not None else "")
          + ("; costs flat in rows (what-if)" if args.flat_rows else "") + ".")
    print(f"{'mode':9s} {'S':>2s} {'W':>3s} {'D/d':>4s} {'tok/step':>9s} {'TBT ms':>8s} {'vs pp':>6s}")
    pp_tbt: dict[int, float] = {}
    for r in results:
        S, mode, W, D = r["stages"], r["mode"], r["width"], r["depth"]
        layers = balanced(L, S, prof) if args.balance else [s.end - s.start for s in partition_layers(L, S)]
        if mode == "tree":
            vals = [tbt_tree(p, layers, prof, args.link_ms, D, W) for p in r["prompts"]]
        else:
            vals = [tbt_steps(p, layers, prof, args.link_ms, mode == "specpipe") for p in r["prompts"]]
        tbt = statistics.mean(vals)
        if mode == "pp":
            pp_tbt[S] = tbt
        ratio = pp_tbt[S] / tbt if S in pp_tbt else float("nan")
        print(f"{mode:9s} {S:2d} {W:3d} {D!s:>4s} {r['tokens_per_step']:9.3f} {tbt:8.1f} {ratio:6.2f}x")


if __name__ == "__main__":
    main()
