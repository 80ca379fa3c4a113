"""The one-row kernels' software prefetch distance (SP_PF_BYTES in ggml_matmul.c) against the real
Qwen2.5-Coder 1.5B file's matmuls (real runs, one thread): the library is built once per distance
(`python -m specpipe.kernels.native.build --define SP_PF_BYTES=N --out ...`), then each build in
turn, `--rounds` times, runs `stage_costs.py matmuls` in a process of its own
(SPECPIPE_NATIVE_LIBRARY), every quantized matmul called alone in model order from the stage's
packed weights; prints and records the median ms and GB/s of the layers' matmuls and the head's.

  PYTHONPATH=. python benchmarks/prefetch_distance.py --model TARGET --distances 1536,2048,2560,3072,4096 \
      --out benchmarks/results/prefetch_distance_qwen1.5b_xeon.json
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


def build(distance: int, out: Path) -> None:
    subprocess.run([sys.executable, "-m", "specpipe.kernels.native.build", "--define", f"SP_PF_BYTES={distance}",
                    "--out", str(out)], cwd=ROOT, check=True, capture_output=True)
    if not out.exists():
        raise SystemExit(f"the build at SP_PF_BYTES={distance} failed")


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
    ap.add_argument("--distances", default="1536,2048,2560,3072,4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--passes", type=int, default=3, help="passes over the model per process")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    distances = [int(d) for d in args.distances.split(",")]
    runs: dict[int, list] = {d: [] for d in distances}
    with tempfile.TemporaryDirectory() as tmp:
        libs = {d: Path(tmp) / f"pf{d}.so" for d in distances}
        for d, lib in libs.items():
            build(d, lib)
        for r in range(args.rounds):
            for d in distances:
                runs[d].append(measure(libs[d], args.model, args.passes))
                lay, lgb, head, hgb = runs[d][-1]
                print(f"round {r + 1}, {d} bytes: layers {lay:.1f} ms ({lgb:.2f} GB/s), head {head:.1f} ms ({hgb:.2f} GB/s)",
                      flush=True)
    rows = []
    for d in distances:
        med = [statistics.median(x[i] for x in runs[d]) for i in range(4)]
        rows.append({"distance": d, "layers_ms": med[0], "layers_gb_s": med[1], "head_ms": med[2], "head_gb_s": med[3],
                     "runs": runs[d]})
        print(f"{d:5d} bytes: layers {med[0]:.1f} ms ({med[1]:.2f} GB/s), head {med[2]:.1f} ms ({med[3]:.2f} GB/s)")
    write_json(args.out, {"what": "one-row matmuls of the real file by software prefetch distance (real run, 1 thread)",
                          "cpu": cpu_name(), "model": args.model, "rounds": args.rounds, "results": rows})


if __name__ == "__main__":
    main()
