"""A draft model as stored against its weights requantized by --draft-quantization: bytes held
and the time of a whole draft step, and the stage layer counts --stage-layers balanced picks.

Method: real run on this machine, both versions of the draft in one process, timed through the
stages' own step code (costs/measure.py StageTimer: n tree rows below a committed context),
interleaved for --rounds rounds (median of the rounds' medians), so that the machine's drift
falls on both alike. With --profile, also the balanced counts for each S and row count, and the
slowest stage's step there against the even split (arithmetic on the profile, no timing).

    PYTHONPATH=. python benchmarks/bench_draft_quantization.py --draft DRAFT.gguf [--quantization int4]
        [--rows 1 2 8] [--threads 2] [--profile PROFILE.json --stages 2 4 8] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics


def draft_steps(args) -> dict:
    import torch

    from specpipe.config import StageSpec
    from specpipe.costs.measure import StageTimer
    from specpipe.loader import open_checkpoint
    from specpipe.model.stage import build_stage, weight_nbytes

    torch.set_num_threads(args.threads)
    ckpt = open_checkpoint(args.draft)
    timers, out = {}, {}
    for name, quantization in (("as stored", None), (args.quantization, args.quantization)):
        model = build_stage(ckpt, StageSpec.whole(ckpt.config), "cpu", torch.float32,
                            quantization=quantization, requantize=quantization is not None)
        out[name] = {"weight_bytes": weight_nbytes(model)}
        timers[name] = StageTimer(model, [args.context], args.rows, torch.device("cpu"), torch.float32,
                                  lambda: None, 1)
    rounds = {name: [] for name in timers}
    for _ in range(args.rounds):
        for name, timer in timers.items():
            rounds[name].append([timer.ms(n, args.context, args.repeats) for n in args.rows])
    for name, runs in rounds.items():
        out[name]["step_ms"] = {n: statistics.median(col) for n, col in zip(args.rows, zip(*runs))}
        print(f"{name:10s} {out[name]['weight_bytes'] / 1e6:7.1f} MB  " +
              "  ".join(f"{n} rows {ms:6.2f} ms" for n, ms in out[name]["step_ms"].items()))
    return out


def balance(args) -> dict:
    from specpipe.costs.balance import balanced_stage_layers
    from specpipe.costs.profile import load_profile
    from specpipe.loader.partition import partition_layers

    profile = load_profile(args.profile)
    L, out = profile.num_layers, {}
    for S in args.stages:
        for n in args.rows:
            even = [s.end - s.start for s in partition_layers(L, S)]
            balanced = balanced_stage_layers(profile, L, S, rows=n)
            slowest = {name: max(profile.stage(k, s == S - 1, n, args.context) for s, k in enumerate(counts))
                       for name, counts in (("even", even), ("balanced", balanced))}
            out[f"S={S},rows={n}"] = {"even": even, "balanced": balanced, "slowest_stage_ms": slowest}
            print(f"S = {S}, {n} rows: balanced {','.join(map(str, balanced))} slowest stage "
                  f"{slowest['balanced']:.1f} ms; even {','.join(map(str, even))} {slowest['even']:.1f} ms")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", help="the draft model (GGUF)")
    p.add_argument("--quantization", default="int4", choices=["int8", "int4"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point and round (median)")
    p.add_argument("--profile", default=None, help="a cost profile: print the balanced stage layer counts")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not args.draft and not args.profile:
        p.error("give --draft, --profile or both")
    result = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
              "context": args.context, "method": "real run (draft steps); arithmetic on the profile (balance)"}
    if args.draft:
        result["draft"] = draft_steps(args)
    if args.profile:
        result["balance"] = balance(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
