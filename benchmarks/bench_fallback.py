"""The three CPU paths of a GGUF model (docs/quantized_weights.md, "Without the native library"):
native (the library), the portable fallback (no library: packed blocks, the `dequant` kernel) and
float32 (SPECPIPE_KERNEL=float32: dequantized at load). One process per path and measurement:

  weights   the stage's parameter and buffer bytes (weight_nbytes), against the file's size
  matmuls   every projection and the LM head once on one row (a decode token's matmuls), best of N
  tokens    --tokens greedy tokens of `specpipe generate` per prompt, compared between the paths

    PYTHONPATH=. python benchmarks/bench_fallback.py [--model F.gguf] [--threads 1 2] [--tokens 32]

Real runs; the machine's load is printed beside them (a shared machine inflates every figure).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PATHS = {"native": {}, "fallback": {"SPECPIPE_NATIVE_LIBRARY": "/nonexistent"},
         "float32": {"SPECPIPE_NATIVE_LIBRARY": "/nonexistent", "SPECPIPE_KERNEL": "float32"}}
PROMPTS = ["The capital of France is", "Write a Python function that reverses a string.",
           "List three colours of the rainbow.", "Once upon a time"]

MATMULS = """
import json, os, sys, time, torch, torch.nn as nn
from specpipe.config import StageSpec
from specpipe.kernels.qlinear import QuantLinear
from specpipe.loader import open_checkpoint
from specpipe.model.stage import build_stage, weight_nbytes
path, threads, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
ckpt = open_checkpoint(path)
model = build_stage(ckpt, StageSpec(0, ckpt.config.num_layers, True, True), stack=False)
layers = [m for m in model.modules() if isinstance(m, (QuantLinear, nn.Linear))]
xs = [torch.randn(1, m.in_features) for m in layers]
def token():
    for m, x in zip(layers, xs):
        m(x)
token()
times = []
for _ in range(reps):
    t = time.perf_counter(); token(); times.append(time.perf_counter() - t)
print(json.dumps({"weights": weight_nbytes(model), "file": os.path.getsize(path), "ms": min(times) * 1e3,
                  "kernels": sorted({getattr(m, "kernel", "float32") for m in layers})}))
"""


def _env(extra: dict) -> dict:
    env = dict(os.environ, **extra)
    if "SPECPIPE_KERNEL" not in extra:
        env.pop("SPECPIPE_KERNEL", None)
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt (0: skip the comparison)")
    args = ap.parse_args()
    if args.model is None:
        from specpipe.loader.default_model import default_model_path
        args.model = str(default_model_path())
    print(f"model {args.model}; load average {os.getloadavg()[0]:.1f}")
    for threads in args.threads:
        for name, extra in PATHS.items():
            p = subprocess.run([sys.executable, "-c", MATMULS, args.model, str(threads), str(args.reps)],
                               capture_output=True, text=True, env=_env(extra), check=True)
            d = json.loads(p.stdout.splitlines()[-1])
            print(f"{threads} thread(s) {name:8s} {','.join(d['kernels']):8s} weights {d['weights'] / 2**20:.1f} MiB "
                  f"({d['weights'] / d['file']:.2f}x the file), matmuls per token {d['ms']:.1f} ms")
    if not args.tokens:
        return
    tokens: dict[str, dict[str, list[int]]] = {name: {} for name in PATHS}
    for prompt in PROMPTS:
        for name, extra in PATHS.items():
            p = subprocess.run([sys.executable, "-m", "specpipe.entrypoints.cli", "generate", "--model", args.model,
                                "--max-tokens", str(args.tokens), "--ignore-eos", "--json", "--quiet", prompt],
                               capture_output=True, text=True, env=_env(extra), check=True)
            tokens[name][prompt] = json.loads(p.stdout.splitlines()[-1])["token_ids"]
    for a, b in (("native", "fallback"), ("fallback", "float32")):
        for prompt in PROMPTS:
            x, y = tokens[a][prompt], tokens[b][prompt]
            first = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
            print(f"{a} vs {b}, {prompt!r}: " + (f"all {len(x)} equal" if first is None else f"first differs at token {first}"))
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
