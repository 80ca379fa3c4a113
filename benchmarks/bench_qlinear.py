"""Time each quantized-matmul kernel on real layer shapes at 1-16 rows (CPU, this machine).

Method: real run, the fastest of repeated calls after a warm-up (up to 0.25 s or 50 calls), torch's thread count as set (the
machine's cores unless --threads). Weights: random data quantized with gguf-py (Q4_0, Q4_1,
Q8_0) or random valid blocks (Q4_K, Q6_K), which run exactly like real ones.
Kernels: float32 = F.linear on a float32 copy (today's path, no padding); float32-tile =
the batch-invariant padded F.linear; dequant / int4pack / native = kernels/registry.py;
int8pack = torch's _weight_int8pack_mm after requantizing Q8_0 to one scale per row (lossy:
measured for comparison only, never used).
--alternatives adds, on the Qwen shapes, what else torch offers for a 4/8-bit layer (random
weights of the same shape; each entry also says whether a row's result is the same bits alone
as among others, which every kernel SpecPipe uses must be):
  compile-deq-q4g32 / compile-deq-int8 -- torch.compile of dequantize-and-multiply (4-bit codes
                with a scale per 32 values, Q4_0's content; int8 with a scale per row);
  torchao-int8dyn-int8w / torchao-int8dyn-int4w-g32 -- torchao's dynamic int8 activations with
                int8 per-row or int4 per-32 weights (`quantize_`), when torchao is installed.

    PYTHONPATH=. python benchmarks/bench_qlinear.py [--threads 2] [--rows 1,2,8,16] [--float-only]
        [--alternatives] [--out benchmarks/results/qlinear_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from specpipe.kernels.ggml_types import BLOCKS, dequantize
from specpipe.kernels.registry import kernels
from specpipe.kernels.torch_kernels import invariant_linear

Q = gguf.GGMLQuantizationType
SHAPES = {"qwen1.5b": [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960)],
          "smollm2": [(576, 576), (192, 576), (1536, 576), (576, 1536)]}
ROWS = (1, 2, 8, 16)
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K, Q.Q8_0)


def packed_rows(qtype: Q, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    if qtype in (Q.Q4_K, Q.Q6_K):
        bs, ts = BLOCKS[qtype]
        raw = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
        for off in ((0, 2) if qtype == Q.Q4_K else (208,)):  # finite, small f16 scales
            raw[:, off:off + 2] = rng.uniform(0, 0.01, (len(raw), 1)).astype(np.float16).view(np.uint8)
        return torch.from_numpy(raw.reshape(n, -1))
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w, qtype)))


def timed(fn, budget_s: float = 0.25) -> float:
    fn()
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3  # other work on a shared machine only adds time: the minimum is the kernel


def int8_per_row(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = dequantize(packed, Q.Q8_0)
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def alternatives(n: int, k: int) -> list[tuple[str, object]]:
    """(name, callable x -> y) for the --alternatives entries above."""
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
        print("torchao is not installed: its entries are left out (pip install torchao)", flush=True)
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    p.add_argument("--float-only", action="store_true", help="only float32 weights (plain and batch-invariant)")
    p.add_argument("--alternatives", action="store_true",
                   help="also torch.compile'd dequantize-and-multiply and torchao's kernels, on the Qwen shapes")
    p.add_argument("--out", default="benchmarks/results/qlinear_cpu.json")
    args = p.parse_args()
    rows = tuple(int(t) for t in args.rows.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    results = []
    with torch.inference_mode():
        for model, shapes in SHAPES.items():
            for n, k in shapes:
                w32 = torch.randn(n, k) * 0.02
                for t in rows:
                    x = torch.randn(t, k)
                    results.append(dict(model=model, n=n, k=k, rows=t, qtype="F32", kernel="float32",
                                        ms=timed(lambda: F.linear(x, w32))))
                    results.append(dict(model=model, n=n, k=k, rows=t, qtype="F32", kernel="float32-tile",
                                        ms=timed(lambda: invariant_linear(x, w32))))
                for name, fn in alternatives(n, k) if args.alternatives and model == "qwen1.5b" else ():
                    invariant = rows_invariant(fn, k)
                    for t in rows:
                        x = torch.randn(t, k)
                        ms = timed(lambda: fn(x))
                        results.append(dict(model=model, n=n, k=k, rows=t, qtype="-", kernel=name, ms=ms,
                                            invariant=invariant))
                        print(f"{model:9s} {n:5d}x{k:<5d} {name:26s} T={t:2d} {ms:8.3f} ms"
                              f"{'' if invariant else '  (rows not batch-invariant)'}", flush=True)
                for qtype in () if args.float_only else TYPES:
                    if k % BLOCKS[qtype][0]:
                        continue  # K-quants need rows of 256: SmolLM2's 576 does not fit them
                    packed = packed_rows(qtype, n, k, rng)
                    runs = [(kern.name, kern.matmul, kern.prepare(packed, qtype, n, k))
                            for kern in kernels() if kern.supports(qtype, "cpu")]
                    if qtype == Q.Q8_0:
                        w8, s8 = int8_per_row(packed)
                        runs.append(("int8pack", lambda x, prep: torch.ops.aten._weight_int8pack_mm(x, *prep), (w8, s8)))
                    for name, mm, prep in runs:
                        for t in rows:
                            x = torch.randn(t, k)
                            ms = timed(lambda: mm(x, prep))
                            results.append(dict(model=model, n=n, k=k, rows=t, qtype=qtype.name, kernel=name, ms=ms))
                            print(f"{model:9s} {n:5d}x{k:<5d} {qtype.name:5s} {name:12s} T={t:2d} {ms:8.3f} ms", flush=True)
    print("\nms per call (fastest of the repeats); columns: rows")
    keys = sorted({(r["model"], r["n"], r["k"], r["qtype"], r["kernel"]) for r in results},
                  key=lambda key: (key[0], -key[1] * key[2], key[3], key[4]))
    print(f"{'model':9s} {'shape':11s} {'type':5s} {'kernel':26s} " + " ".join(f"{t:>8d}" for t in rows))
    for key in keys:
        row = {r["rows"]: r["ms"] for r in results if (r["model"], r["n"], r["k"], r["qtype"], r["kernel"]) == key}
        print(f"{key[0]:9s} {key[1]:5d}x{key[2]:<5d} {key[3]:5s} {key[4]:26s} " + " ".join(f"{row[t]:8.3f}" for t in rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                          "threads": torch.get_num_threads(), "torch": torch.__version__,
                                          "results": results}, indent=1))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
