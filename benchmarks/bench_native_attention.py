#!/usr/bin/env python3
"""Microseconds per call of the native attention (specpipe.kernels.native.attention) for T rows
(a decode row, or a tree layer's rows): Hq query heads over Hkv KV heads of D values, C visible
slots, no mask; the median of --calls calls after a warm-up, with the thread count the engine
would choose (or --threads).

    PYTHONPATH=. python benchmarks/bench_native_attention.py [--heads 9 3] [--dim 64]
        [--slots 100 1000] [--rows 1] [--threads 1] [--calls 3000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from specpipe.kernels import native


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, nargs=2, default=[9, 3], metavar=("HQ", "HKV"))
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--slots", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--threads", type=int, default=None, help="default: the engine's choice")
    ap.add_argument("--calls", type=int, default=3000)
    args = ap.parse_args()
    if not native.available():
        print(f"native library unavailable: {native.unavailable_reason()}", file=sys.stderr)
        return 1
    hq, hkv = args.heads
    g = torch.Generator().manual_seed(0)
    print(f"isa {native.isa()}, {hq} query heads over {hkv} KV heads of {args.dim}")
    for t, c in ((t, c) for t in args.rows for c in args.slots):
        q = torch.randn(t, hq, args.dim, generator=g)
        k, v = torch.randn(c, hkv, args.dim, generator=g), torch.randn(c, hkv, args.dim, generator=g)
        native.attention(q, k, v, None, 0.125, args.threads)  # warm-up
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            native.attention(q, k, v, None, 0.125, args.threads)
            times.append(time.perf_counter() - t0)
        print(f"{t} rows, {c} slots: {statistics.median(times) * 1e6:.1f} us per call (median of {args.calls})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
