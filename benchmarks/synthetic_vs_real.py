"""Is a synthetic profile (random weights in the real block types, costs/synthetic.py) the real
file's? Profiles the real GGUF file and the synthetic checkpoint of its shapes alternately in one
process (`specpipe profile`'s stages and arithmetic, costs/measure.py), row count by row count,
`--rounds` times, and prints per row count the layer and head times of both and their ratio (from
the fastest round of each stage, and from the medians).

  PYTHONPATH=. python benchmarks/synthetic_vs_real.py --model TARGET --synthetic qwen2.5-coder-1.5b \
      --threads 1 --rounds 7 --out benchmarks/results/synthetic_vs_real_qwen1.5b_t1_xeon.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import sys
from pathlib import Path

import torch

from specpipe.costs import synthetic
from specpipe.config import StageSpec
from specpipe.costs.measure import StageTimer
from specpipe.loader import open_checkpoint
from specpipe.model.stage import build_stage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cpu_name, write_json  # noqa: E402


def structure(ckpt) -> list[str]:
    """The module types of a 2-layer middle stage (the fused native layer must be in both)."""
    model = build_stage(ckpt, StageSpec(0, 2, False, False))
    return sorted({type(m).__name__ for m in model.modules()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the real GGUF file")
    ap.add_argument("--synthetic", required=True, help="the preset (or config.json) of its shapes")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--contexts", default="256")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stage-layers", type=int, default=8, help="K: the middle stage a layer is measured on")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    rows = [int(x) for x in args.rows.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    real = open_checkpoint(args.model)
    name, cfg = synthetic.model_config(args.synthetic)
    synth = synthetic.SyntheticCheckpoint(name, cfg)
    same_types = all(real.load_packed(n) is None or real.load_packed(n)[0] == synth.types[n] for n in real.names())
    modules = {"real": structure(real), "synthetic": structure(synth)}
    print(f"types the same as the file's: {same_types}; stage modules the same: "
          f"{modules['real'] == modules['synthetic']} ({', '.join(modules['real'])})", flush=True)
    # Each model's stages as `specpipe profile` times them (costs/measure.py): a middle stage of
    # 1 and of K layers (a layer is the difference over K - 1) and a last stage of 1 layer (the
    # head is its difference from the 1-layer stage). Built once; then, row count by row count,
    # the two models' stages are timed alternately, `--rounds` times, so that both see the same
    # load. The fastest round of each stage is the least disturbed (this machine is shared).
    K, L = args.stage_layers, cfg.num_layers
    dev = torch.device("cpu")
    timers = {}
    for key, ckpt in (("real", real), ("synthetic", synth)):
        timers[key] = {k: StageTimer(build_stage(ckpt, StageSpec(a, b, False, last)), contexts, rows, dev,
                                     torch.float32, lambda: None, 1)
                       for k, (a, b, last) in {"one": (0, 1, False), "many": (0, K, False),
                                               "tail": (L - 1, L, True)}.items()}
    print(f"built both models' stages (1, {K} and 1 + head layers) in {time.perf_counter() - t0:.0f} s", flush=True)
    raw = {key: {(ctx, n, k): [] for ctx in contexts for n in rows for k in ("one", "many", "tail")} for key in timers}
    for r in range(args.rounds):
        for ctx in contexts:
            for n in rows:
                for key in (("real", "synthetic") if r % 2 == 0 else ("synthetic", "real")):
                    for k, timer in timers[key].items():
                        raw[key][ctx, n, k].append(timer.ms(n, ctx, args.repeats))
        print(f"round {r + 1}/{args.rounds} ({time.perf_counter() - t0:.0f} s)", flush=True)
    table = []
    for ctx in contexts:
        for n in rows:
            line = {"context": ctx, "rows": n}
            for key in raw:
                for stat, f in (("min", min), ("median", statistics.median)):
                    one, many, tail = (f(raw[key][ctx, n, k]) for k in ("one", "many", "tail"))
                    line[f"{key}_layer_ms_{stat}"] = (many - one) / (K - 1)
                    line[f"{key}_head_ms_{stat}"] = tail - one
                    line[f"{key}_stage{K}_ms_{stat}"] = many
            for what in ("layer", "head", f"stage{K}"):
                for stat in ("min", "median"):
                    line[f"{what}_ratio_{stat}"] = line[f"synthetic_{what}_ms_{stat}"] / line[f"real_{what}_ms_{stat}"]
            table.append(line)
            print(f"ctx {ctx:5d} rows {n:3d}: layer real {line['real_layer_ms_min']:.3f} synthetic "
                  f"{line['synthetic_layer_ms_min']:.3f} ms ({line['layer_ratio_min'] - 1:+.1%}; medians "
                  f"{line['layer_ratio_median'] - 1:+.1%}); head {line['real_head_ms_min']:.2f} / "
                  f"{line['synthetic_head_ms_min']:.2f} ms ({line['head_ratio_min'] - 1:+.1%}; "
                  f"{line['head_ratio_median'] - 1:+.1%}); {K}-layer stage {line[f'stage{K}_ratio_min'] - 1:+.1%} "
                  f"({line[f'stage{K}_ratio_median'] - 1:+.1%})", flush=True)
    model_name = cpu_name()
    out = {"what": "synthetic (random weights, real block types) vs real file profile, interleaved in one process",
           "model": args.model, "synthetic": args.synthetic, "cpu": model_name, "machine": platform.machine(),
           "threads": args.threads, "repeats": args.repeats, "rounds": args.rounds, "types_same": same_types,
           "stage_layers": K, "modules": modules, "table": table, "seconds": round(time.perf_counter() - t0, 1),
           "raw_ms": {key: {f"{ctx},{n},{k}": v for (ctx, n, k), v in d.items()} for key, d in raw.items()}}
    write_json(args.out, out)


if __name__ == "__main__":
    main()
