#!/usr/bin/env python3
"""Milliseconds per call of the native GGUF matmul (specpipe.kernels.native) on real layer shapes.

For each weight shape N x K (Qwen2.5-1.5B and SmolLM2-135M projections), GGUF type (Q4_K, Q6_K,
Q4_1, Q8_0 by default), thread count (1, 2) and row count T (1 .. 64), one call of
``native.matmul(x (T, K), packed (N, row_bytes), qtype)`` is timed, next to:

  f32    -- torch ``F.linear`` on the dequantized float32 weight (what a stage runs today);
  int4mm -- ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (4-bit weights, one float scale and
            zero per 32 values: the Q4_1 layout in torch's packing), where it exists.

Weights are random: gguf.quants.quantize of Gaussian values for the 32-value types, random bytes
with small finite f16 scales for the K-quants (their timing does not depend on the values).
K-quants need K % 256 == 0, so they skip SmolLM2's K = 576 shapes (n/a).  Each figure is the
minimum over repeats filling about --seconds of calls after a warm-up (the minimum is the least
disturbed by other processes on a shared machine).

Usage:
  python benchmarks/bench_native_kernel.py [--threads 1 2] [--rows 1 2 4 8 16 32 64]
        [--types Q4_K Q6_K Q4_1 Q8_0] [--shapes qwen smollm2] [--seconds 0.3]
        [--out benchmarks/results/native_kernel_cpu.json]
Prints a Markdown table (ms per call) and the goal checks; saves everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import quants

from specpipe.kernels import native

Q = gguf.GGMLQuantizationType
SHAPES = {  # name: (N, K) of y = x @ W^T
    "qwen": [("qwen q/o 1536x1536", 1536, 1536), ("qwen k/v 256x1536", 256, 1536),
             ("qwen gate/up 8960x1536", 8960, 1536), ("qwen down 1536x8960", 1536, 8960)],
    "smollm2": [("smollm2 q/o 576x576", 576, 576), ("smollm2 k/v 192x576", 192, 576),
                ("smollm2 gate/up 1536x576", 1536, 576), ("smollm2 down 576x1536", 576, 1536)],
}
RESULTS = Path(__file__).resolve().parent / "results" / "native_kernel_cpu.json"


def random_packed(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    if block == 32:
        return np.ascontiguousarray(quants.quantize(rng.standard_normal((n, k), np.float32), qtype))
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    f16 = rng.uniform(0.0, 0.02, size=(n, k // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        raw[..., 208:210] = f16.reshape(n, k // block, 4)[..., :2]
    else:
        raw[..., 0:4] = f16.reshape(n, k // block, 4)
    return raw.reshape(n, -1)


def time_ms(fn, seconds: float) -> float:
    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    if once > seconds:  # slow baselines (int4mm at large shapes): two timed calls are enough
        return once * 1e3
    reps = max(3, min(200, int(seconds / max(once, 1e-6))))
    best = once
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def int4_weights(n: int, k: int, seed: int = 0):
    """torch's 4-bit CPU packing of random values with a scale and zero per 32 (None if absent)."""
    try:
        g = torch.Generator().manual_seed(seed)
        w = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 2)
        sz = torch.rand(k // 32, n, 2, generator=g) * 0.01
        x = torch.randn(1, k)
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)
        return packed, sz
    except Exception:  # pragma: no cover - older/other torch builds
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q4_1", "Q8_0"])
    ap.add_argument("--shapes", nargs="+", default=["qwen", "smollm2"], choices=sorted(SHAPES))
    ap.add_argument("--seconds", type=float, default=0.3, help="time budget per measurement")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    if not native.available():
        print(f"native library unavailable: {native.unavailable_reason()}", file=sys.stderr)
        return 1
    types = [Q[t] for t in args.types]
    shapes = [s for group in args.shapes for s in SHAPES[group]]
    rows_max = max(args.rows)
    records = []
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    saved_threads = torch.get_num_threads()
    for name, n, k in shapes:
        x_all = torch.randn(rows_max, k, generator=torch.Generator().manual_seed(0))
        packs = {q: torch.from_numpy(random_packed(q, n, k)) for q in types
                 if k % gguf.GGML_QUANT_SIZES[q][0] == 0}
        w32 = torch.randn(n, k) * 0.02
        i4 = None if args.no_baselines else int4_weights(n, k)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for t in args.rows:
                x = x_all[:t].contiguous()
                rec = {"shape": name, "n": n, "k": k, "threads": threads, "rows": t}
                if not args.no_baselines:
                    rec["f32_ms"] = time_ms(lambda: F.linear(x, w32), args.seconds)
                    if i4 is not None:
                        rec["int4mm_ms"] = time_ms(
                            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, i4[0], 32, i4[1]),
                            args.seconds)
                for q in types:
                    key = f"{q.name}_ms"
                    if q not in packs:
                        rec[key] = None
                        continue
                    out = torch.empty(t, n)
                    rec[key] = time_ms(lambda: native.matmul(x, packs[q], q, threads, out=out),
                                       args.seconds)
                records.append(rec)
                cells = " ".join(f"{c}={rec[c]:.3f}" for c in rec if c.endswith("_ms") and rec[c])
                print(f"# {name} threads={threads} T={t}: {cells}", file=sys.stderr, flush=True)
    torch.set_num_threads(saved_threads)

    cols = (["f32_ms"] + (["int4mm_ms"] if any("int4mm_ms" in r for r in records) else [])
            if not args.no_baselines else []) + [f"{q.name}_ms" for q in types]
    print(f"\nms per call (min over repeats), isa={native.isa()}, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}\n")
    print("| shape | threads | rows | " + " | ".join(c[:-3] for c in cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for r in records:
        cells = [("n/a" if r.get(c) is None else f"{r[c]:.3f}") for c in cols]
        print(f"| {r['shape']} | {r['threads']} | {r['rows']} | " + " | ".join(cells) + " |")

    goals = []
    for threads in args.threads:
        for q in types:
            by_t = {r["rows"]: r for r in records if r["shape"] == "qwen down 1536x8960"
                    and r["threads"] == threads and r.get(f"{q.name}_ms")}
            if 1 not in by_t:
                continue
            one = by_t[1][f"{q.name}_ms"]
            g = {"type": q.name, "threads": threads, "shape": "1536x8960", "ms_1": one,
                 "f32_ms_1": by_t[1].get("f32_ms")}
            for t in (8, 16):
                if t in by_t:
                    g[f"ratio_{t}"] = by_t[t][f"{q.name}_ms"] / one
            goals.append(g)
    if goals:
        print("\nGoals on qwen down 1536x8960 (N x K): 1 row far below float32; "
              "8 rows <= 1.6x, 16 rows <= 2.5x the 1-row time\n")
        print("| type | threads | 1 row ms | f32 1 row ms | 8 rows / 1 row | 16 rows / 1 row |")
        print("|---|---|---|---|---|---|")
        for g in goals:
            f32 = f"{g['f32_ms_1']:.3f}" if g.get("f32_ms_1") else "-"
            r8 = f"{g['ratio_8']:.2f}" if "ratio_8" in g else "-"
            r16 = f"{g['ratio_16']:.2f}" if "ratio_16" in g else "-"
            print(f"| {g['type']} | {g['threads']} | {g['ms_1']:.3f} | {f32} | {r8} | {r16} |")

    meta = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "isa": native.isa(), "openmp": native.has_openmp(), "torch": torch.__version__,
        "machine": platform.machine(), "cpu": _cpu_name(), "cpus": os.cpu_count(),
        "load_avg_start": load_start,
    }
    try:
        meta["load_avg_end"] = os.getloadavg()
    except OSError:
        pass
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "records": records, "goals": goals}, indent=1))
    print(f"\nsaved {args.out}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
