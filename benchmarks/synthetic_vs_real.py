"""Is a synthetic profile (random weights in the real block types, costs/synthetic.py) the real
file's? Profiles the real GGUF file and the synthetic checkpoint of its shapes alternately in one
process (`specpipe profile`'s method, costs/measure.py profile_stages), `--rounds` times each, and
prints per row count the median layer and head times of both and their ratio.

  PYTHONPATH=. python benchmarks/synthetic_vs_real.py --model TARGET --synthetic qwen2.5-coder-1.5b \
      --threads 2 --rounds 3 --out benchmarks/results/synthetic_vs_real_qwen1.5b_xeon.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

import torch

from specpipe.costs import synthetic
from specpipe.costs.measure import profile_stages
from specpipe.loader import open_checkpoint
from specpipe.model.stage import build_stage


def structure(ckpt) -> list[str]:
    """The module types of a 2-layer middle stage (the fused native layer must be in both)."""
    from specpipe.config import StageSpec

    model = build_stage(ckpt, StageSpec(0, 2, False, False))
    return sorted({type(m).__name__ for m in model.modules()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the real GGUF file")
    ap.add_argument("--synthetic", required=True, help="the preset (or config.json) of its shapes")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--contexts", default="256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(x) for x in args.rows.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    real = open_checkpoint(args.model)
    name, cfg = synthetic.model_config(args.synthetic)
    synth = synthetic.SyntheticCheckpoint(name, cfg)
    same_types = all(real.load_packed(n) is None or real.load_packed(n)[0] == synth.types[n] for n in real.names())
    modules = {"real": structure(real), "synthetic": structure(synth)}
    print(f"types the same as the file's: {same_types}; stage modules the same: "
          f"{modules['real'] == modules['synthetic']} ({', '.join(modules['real'])})", flush=True)
    runs: dict[str, list] = {"real": [], "synthetic": []}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for key, ckpt in (("real", real), ("synthetic", synth)) if r % 2 == 0 else (("synthetic", synth), ("real", real)):
            prof = profile_stages(lambda spec, c=ckpt: build_stage(c, spec), ckpt.config, rows, contexts, args.repeats,
                                  torch.device("cpu"), torch.float32)
            runs[key].append(prof)
            print(f"round {r + 1} {key}: layer ms {[round(x, 3) for x in prof.layer_ms[0]]}, "
                  f"head ms {[round(x, 2) for x in prof.head_ms]}", flush=True)
    table = []
    for ci, ctx in enumerate(contexts):
        for i, n in enumerate(rows):
            line = {"context": ctx, "rows": n}
            for key in runs:
                line[f"{key}_layer_ms"] = statistics.median(p.layer_ms[ci][i] for p in runs[key])
                line[f"{key}_head_ms"] = statistics.median(p.head_ms[i] for p in runs[key])
                line[f"{key}_overhead_ms"] = statistics.median(p.overhead_ms[i] for p in runs[key])
                line[f"{key}_stage8_ms"] = statistics.median(p.stage(8, False, n, ctx) for p in runs[key])
            for what in ("layer", "head", "stage8"):
                line[f"{what}_ratio"] = line[f"synthetic_{what}_ms"] / line[f"real_{what}_ms"]
            table.append(line)
            print(f"ctx {ctx:5d} rows {n:3d}: layer real {line['real_layer_ms']:.3f} synthetic "
                  f"{line['synthetic_layer_ms']:.3f} ({line['layer_ratio'] - 1:+.1%}); head {line['real_head_ms']:.2f} / "
                  f"{line['synthetic_head_ms']:.2f} ({line['head_ratio'] - 1:+.1%}); 8-layer stage "
                  f"{line['stage8_ratio'] - 1:+.1%}", flush=True)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), "?")
    out = {"what": "synthetic (random weights, real block types) vs real file profile, interleaved in one process",
           "model": args.model, "synthetic": args.synthetic, "cpu": model_name, "machine": platform.machine(),
           "threads": args.threads, "repeats": args.repeats, "rounds": args.rounds, "types_same": same_types,
           "modules": modules, "table": table, "seconds": round(time.perf_counter() - t0, 1),
           "profiles": {k: [p.to_json() for p in v] for k, v in runs.items()}}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
