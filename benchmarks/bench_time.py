"""Simulated time between tokens (TBT) at any stage count, from exact step traces and a measured
cost profile (method: simulation, specpipe/sim/timing.py).

  python benchmarks/bench_time.py --steps qwen_steps.json --profile qwen_profile.json [--link-ms 0.5]

TBT = (time of the last token - time of the first) / (tokens - 1), as everywhere in SpecPipe.
pp and specpipe replay their per-step row counts (specpipe drafts each new layer while the stages
compute); tree replays its rounds: draft D layers one after another (draft(1 or 2 rows) +
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
    after_first = simulate(rows[S:], layers, prof, link_ms, overlap_draft=overlap)
    return after_first / max(prompt["tokens"] - 1, 1)


def tbt_tree(prompt: dict, layers: list[int], prof: CostProfile, link_ms: float, depth: int, width: int) -> float:
    batches = [c[0] for c in prompt["rows_per_step"] if c[0] > 0]  # one batch enters per round
    S = len(layers)
    draft = prof.draft(1) + (depth - 1) * prof.draft(width)
    rounds = [draft + sum(stage_ms(prof, layers[s], s == S - 1, n) for s in range(S)) + S * link_ms
              for n in batches]
    return sum(rounds[1:]) / max(prompt["tokens"] - 1, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", required=True, help="JSON written by bench_specpipe.py --out")
    ap.add_argument("--profile", required=True, help="JSON written by profile_costs.py")
    ap.add_argument("--link-ms", type=float, default=0.0, help="one-way latency per step and hop")
    args = ap.parse_args()
    steps = json.loads(Path(args.steps).read_text())
    pj = json.loads(Path(args.profile).read_text())
    prof = CostProfile(**pj["profile"])
    L = pj["num_layers"]
    print(f"Simulated TBT (method: simulation from exact step traces; cost profile measured on {prof.device}, "
          f"context {prof.context}; link {args.link_ms} ms per hop). Each stage is one such device.")
    print(f"{'mode':9s} {'S':>2s} {'W':>3s} {'D':>2s} {'tok/step':>9s} {'TBT ms':>8s} {'vs pp':>6s}")
    pp_tbt: dict[int, float] = {}
    for r in steps["results"]:
        S, mode, W, D = r["stages"], r["mode"], r["width"], r["depth"]
        layers = [s.end - s.start for s in partition_layers(L, S)]
        if mode == "tree":
            vals = [tbt_tree(p, layers, prof, args.link_ms, D, W) for p in r["prompts"]]
        else:
            vals = [tbt_steps(p, layers, prof, args.link_ms, mode == "specpipe") for p in r["prompts"]]
        tbt = statistics.mean(vals)
        if mode == "pp":
            pp_tbt[S] = tbt
        ratio = pp_tbt[S] / tbt if S in pp_tbt else float("nan")
        print(f"{mode:9s} {S:2d} {W:3d} {D:2d} {r['tokens_per_step']:9.3f} {tbt:8.1f} {ratio:6.2f}x")


if __name__ == "__main__":
    main()
