#!/usr/bin/env python3
"""Milliseconds per call of a quantized projection on real layer shapes: the native GGUF matmul
(specpipe.kernels.native) against every other way to compute it on this CPU.

For each weight shape N x K (Qwen2.5-1.5B and SmolLM2-135M projections), GGUF type (Q4_K, Q6_K,
Q4_1, Q8_0 by default), thread count (1, 2) and row count T (1 .. 64), one call of
``native.matmul(x (T, K), packed (N, row_bytes), qtype)`` is timed, next to:

  f32    -- torch ``F.linear`` on a float32 weight (what the dequantized path runs);
  int4mm -- ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (4-bit weights, one float scale and
            zero per 32 values: the Q4_1 layout in torch's packing), where it exists;
  (--no-baselines leaves these two out)
  --registry: every other kernel of specpipe/kernels/registry.py that runs the type on a CPU
            (``dequant``, ``int4pack``: columns TYPE_KERNEL), ``f32tile`` (the batch-invariant
            float32 matmul in fixed 4-row calls) and, for Q8_0, ``Q8_0_int8pack`` (torch's
            ``_weight_int8pack_mm`` after requantizing to one scale per row: lossy, for
            comparison only, never used) — the measurement behind the registry's order;
  --alternatives: on the Qwen shapes, what else torch offers for a 4/8-bit layer, each with
            whether a row's result is the same bits alone as among others (which every kernel
            SpecPipe uses must be): ``compile-deq-q4g32`` / ``compile-deq-int8`` (torch.compile
            of dequantize-and-multiply: 4-bit codes with a scale per 32 values, Q4_0's content;
            int8 with a scale per row) and, when torchao is installed, ``torchao-int8dyn-int8w`` /
            ``torchao-int8dyn-int4w-g32`` (dynamic int8 activations with int8 per-row or int4
            per-32 weights);
  --float-only: only ``f32`` and ``f32tile`` (no native library needed).

Weights are random: gguf.quants.quantize of Gaussian values for the 32-value types, random bytes
with small finite f16 scales for the K-quants (their timing does not depend on the values).
K-quants need K % 256 == 0, so they skip SmolLM2's K = 576 shapes (n/a).  Each figure is the
minimum over repeats filling about --seconds of calls after a warm-up (the minimum is the least
disturbed by other processes on a shared machine).  SPECPIPE_NATIVE_ISA=portable|avx2|avx512vnni|amx
picks the native path to time.  For instruction counts under callgrind (no timing noise), see
benchmarks/native_kernel_cbench.c.

Usage:
  python benchmarks/bench_native_kernel.py [--threads 1 2] [--rows 1 2 4 8 16 32 64]
        [--types Q4_K Q6_K Q4_1 Q8_0] [--shapes qwen smollm2] [--seconds 0.3] [--no-baselines]
        [--registry] [--alternatives] [--float-only] [--out benchmarks/results/native_kernel_cpu.json]
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
from specpipe.kernels.ggml_types import LAYOUTS, LOWBIT_TYPES, dequantize
from specpipe.kernels.registry import kernels
from specpipe.kernels.torch_kernels import invariant_linear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cpu_name  # noqa: E402

Q = gguf.GGMLQuantizationType
SHAPES = {  # name: (N, K) of y = x @ W^T
    "qwen": [("qwen q/o 1536x1536", 1536, 1536), ("qwen k/v 256x1536", 256, 1536),
             ("qwen gate/up 8960x1536", 8960, 1536), ("qwen down 1536x8960", 1536, 8960)],
    "smollm2": [("smollm2 q/o 576x576", 576, 576), ("smollm2 k/v 192x576", 192, 576),
                ("smollm2 gate/up 1536x576", 1536, 576), ("smollm2 down 576x1536", 576, 1536)],
    # weights far past the last-level cache (60-250 MB): a decode's streaming, bytes / ms = GB/s
    "stream": [("stream 71680x1536", 71680, 1536)],
}
RESULTS = Path(__file__).resolve().parent / "results" / "native_kernel_cpu.json"


def random_packed(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    if qtype in LOWBIT_TYPES:  # random bytes, the scale fields finite (tests/lowbit_helpers.py does the same)
        lay = LAYOUTS[qtype]
        raw = rng.integers(0, 256, size=(n * k // block, nbytes), dtype=np.uint8)
        for f in ("d", "dmin"):
            if f in lay.fields:
                off = lay.fields[f][0]
                raw[:, off:off + 2] = rng.uniform(-0.02, 0.02, (len(raw), 1)).astype(np.float16).view(np.uint8)
        if qtype == Q.IQ1_M:
            raw[:, 55] = (raw[:, 55] & 0x3F) | 0x20
        if qtype == Q.MXFP4:
            raw[:, 0] = 120
        return raw.reshape(n, -1)
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


def registry_runs(types: list, packs: dict, n: int, k: int) -> list[tuple[str, object]]:
    """(column, x -> y) for --registry: the registry's other CPU kernels per type, and int8pack."""
    runs = []
    for q in types:
        if q not in packs:
            continue
        for kern in kernels():
            if kern.name != "native" and kern.supports(q, "cpu"):
                prep = kern.prepare(packs[q], q, n, k)
                runs.append((f"{q.name}_{kern.name}_ms", lambda x, mm=kern.matmul, prep=prep: mm(x, prep)))
        if q == Q.Q8_0:
            w = dequantize(packs[q], Q.Q8_0)
            scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
            w8 = torch.round(w / scale[:, None]).to(torch.int8)
            runs.append(("Q8_0_int8pack_ms", lambda x, w8=w8, s8=scale: torch.ops.aten._weight_int8pack_mm(x, w8, s8)))
    return runs


def alternatives(n: int, k: int) -> list[tuple[str, object]]:
    """(name, x -> y) for --alternatives (random weights of the shape)."""
    g = torch.Generator().manual_seed(n + k)
    q4 = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    s4 = torch.rand(n, k // 32, generator=g) * 0.002
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s8 = torch.rand(n, generator=g) * 0.002
    out = [("compile-deq-q4g32", torch.compile(lambda x: F.linear(x, ((q4.view(n, k // 32, 32).float() - 8)
                                                                      * s4[..., None]).view(n, k)))),
           ("compile-deq-int8", torch.compile(lambda x: F.linear(x, w8.float() * s8[:, None])))]
    try:
        from torchao.quantization import (Int8DynamicActivationInt8WeightConfig,
                                          Int8DynamicActivationIntxWeightConfig, quantize_)
        from torchao.quantization.granularity import PerGroup
    except ImportError:
        print("torchao is not installed: its entries are left out (pip install torchao)", file=sys.stderr, flush=True)
        return out
    for name, config in (("torchao-int8dyn-int8w", Int8DynamicActivationInt8WeightConfig()),
                         ("torchao-int8dyn-int4w-g32", Int8DynamicActivationIntxWeightConfig(
                             weight_dtype=torch.int4, weight_granularity=PerGroup(32)))):
        layer = torch.nn.Linear(k, n, bias=False)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n, k, generator=g) * 0.02)
        quantize_(layer, config)
        out.append((name, layer))
    return out


def rows_invariant(fn, k: int) -> bool:
    """A row's result is the same bits alone (and among 7 or 32 others) as among 63 others."""
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    full = fn(x)
    return all(torch.equal(fn(x[:t]), full[:t]) for t in (1, 8, 33))


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
    ap.add_argument("--no-baselines", action="store_true", help="leave out f32 and int4mm")
    ap.add_argument("--registry", action="store_true", help="also the registry's other kernels, f32tile and int8pack")
    ap.add_argument("--alternatives", action="store_true",
                    help="also torch.compile'd dequantize-and-multiply and torchao's kernels, on the Qwen shapes")
    ap.add_argument("--float-only", action="store_true", help="only float32 weights (f32 and f32tile)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()

    if not native.available() and not args.float_only:
        print(f"native library unavailable: {native.unavailable_reason()}", file=sys.stderr)
        return 1
    types = [] if args.float_only else [Q[t] for t in args.types]
    shapes = [s for group in args.shapes for s in SHAPES[group]]
    rows_max = max(args.rows)
    records = []
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    saved_threads = torch.get_num_threads()
    torch.set_grad_enabled(False)
    for name, n, k in shapes:
        x_all = torch.randn(rows_max, k, generator=torch.Generator().manual_seed(0))
        packs = {q: torch.from_numpy(random_packed(q, n, k)) for q in types
                 if k % gguf.GGML_QUANT_SIZES[q][0] == 0}
        w32 = torch.randn(n, k) * 0.02
        i4 = None if args.no_baselines or args.float_only else int4_weights(n, k)
        extra = registry_runs(types, packs, n, k) if args.registry else []
        alts = alternatives(n, k) if args.alternatives and name.startswith("qwen") else []
        invariant = {alt: rows_invariant(fn, k) for alt, fn in alts}
        for threads in args.threads:
            torch.set_num_threads(threads)
            for t in args.rows:
                x = x_all[:t].contiguous()
                rec = {"shape": name, "n": n, "k": k, "threads": threads, "rows": t}
                if not args.no_baselines or args.float_only:
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
                if args.registry or args.float_only:
                    rec["f32tile_ms"] = time_ms(lambda: invariant_linear(x, w32), args.seconds)
                for key, fn in extra:
                    rec[key] = time_ms(lambda: fn(x), args.seconds)
                for alt, fn in alts:
                    rec[f"{alt}_ms"] = time_ms(lambda: fn(x), args.seconds)
                    rec[f"{alt}_invariant"] = invariant[alt]
                records.append(rec)
                cells = " ".join(f"{c}={rec[c]:.3f}" for c in rec if c.endswith("_ms") and rec[c])
                print(f"# {name} threads={threads} T={t}: {cells}", file=sys.stderr, flush=True)
    torch.set_num_threads(saved_threads)

    cols = list(dict.fromkeys(c for r in records for c in r if c.endswith("_ms")))
    print(f"\nms per call (min over repeats), isa={native.isa() if native.available() else 'none'}, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}\n")
    print("| shape | threads | rows | " + " | ".join(c[:-3] for c in cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for r in records:
        cells = [("n/a" if r.get(c) is None else f"{r[c]:.3f}") for c in cols]
        print(f"| {r['shape']} | {r['threads']} | {r['rows']} | " + " | ".join(cells) + " |")
    for c in dict.fromkeys(c for r in records for c in r if c.endswith("_invariant")):
        same = all(r[c] for r in records if c in r)
        print(f"{c[:-len('_invariant')]}: a row's bits {'do not depend' if same else 'depend'} on the rows beside it")

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
        "isa": native.isa() if native.available() else None,
        "openmp": native.has_openmp() if native.available() else None, "torch": torch.__version__,
        "machine": platform.machine(), "cpu": cpu_name(), "cpus": os.cpu_count(),
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


if __name__ == "__main__":
    sys.exit(main())
