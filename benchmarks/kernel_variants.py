"""Builds of the native kernels with compile-time settings changed (ggml_matmul.c's one-row paths:
SP_PF_BYTES, the prefetch distance; SP_STREAMS, the runs of rows read side by side; SP_PRIME, each
run's first lines fetched at the start) against the real Qwen2.5-Coder 1.5B file's matmuls (real
runs, one thread). The library is built once per variant (`python -m specpipe.kernels.native.build
--define NAME=VALUE ... --out ...`), then each build in turn, `--rounds` times, runs
`stage_costs.py matmuls` in a process of its own (SPECPIPE_NATIVE_LIBRARY): every quantized matmul
called alone in model order from the stage's packed weights. Prints and records the median ms and
GB/s of the layers' matmuls and the head's. A variant is a comma-separated list of defines; an
empty one is the library as shipped.

  PYTHONPATH=. python benchmarks/kernel_variants.py --model TARGET \
      --variants "SP_PF_BYTES=4096,SP_STREAMS=1,SP_PRIME=0" "SP_STREAMS=1,SP_PRIME=0" "SP_PRIME=0" "" \
      --out benchmarks/results/kernel_variants_qwen1.5b_xeon.json
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import cpu_name, write_json  # noqa: E402

LINE = re.compile(r"layers' matmuls ([\d.]+) ms for (\d+) MB \(([\d.]+) GB/s\); head ([\d.]+) ms for (\d+) MB \(([\d.]+) GB/s\)")


def build(variant: str, out: Path) -> None:
    defines = [arg for d in variant.split(",") if d.strip() for arg in ("--define", d.strip())]
    subprocess.run([sys.executable, "-m", "specpipe.kernels.native.build", *defines, "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    if not out.exists():
        raise SystemExit(f"the build of {variant or 'the defaults'} failed")


def measure(lib: Path, model: str, passes: int) -> tuple[float, float, float, float]:
    env = {**os.environ, "SPECPIPE_NATIVE_LIBRARY": str(lib), "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "benchmarks/stage_costs.py", "matmuls", "--model", model,
                          "--rounds", str(passes)], cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    m = LINE.search(res.stdout)
    if not m:
        raise SystemExit(f"unexpected output from stage_costs.py:\n{res.stdout}{res.stderr}")
    return float(m[1]), float(m[3]), float(m[4]), float(m[6])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--variants", nargs="+", required=True, help='e.g. "SP_PF_BYTES=4096,SP_STREAMS=1" ""')
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=3, help="passes over the model per process")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    names = [v or "defaults" for v in args.variants]
    runs: dict[str, list] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {n: Path(tmp) / f"variant{i}.so" for i, n in enumerate(names)}
        for v, n in zip(args.variants, names):
            build(v, libs[n])
        for r in range(args.rounds):
            for n in names:
                runs[n].append(measure(libs[n], args.model, args.passes))
                lay, lgb, head, hgb = runs[n][-1]
                print(f"round {r + 1}, {n}: layers {lay:.1f} ms ({lgb:.2f} GB/s), head {head:.1f} ms ({hgb:.2f} GB/s)",
                      flush=True)
    rows = []
    for n in names:
        med = [statistics.median(x[i] for x in runs[n]) for i in range(4)]
        rows.append({"variant": n, "layers_ms": med[0], "layers_gb_s": med[1], "head_ms": med[2], "head_gb_s": med[3],
                     "runs": runs[n]})
        print(f"{n}: layers {med[0]:.1f} ms ({med[1]:.2f} GB/s), head {med[2]:.1f} ms ({med[3]:.2f} GB/s)")
    write_json(args.out, {"what": "one-row matmuls of the real file by kernel build (real run, 1 thread)",
                          "cpu": cpu_name(), "model": args.model, "rounds": args.rounds, "results": rows})


if __name__ == "__main__":
    main()
