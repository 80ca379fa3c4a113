"""Resident memory and decode speed of one process holding a whole GGUF model, per weight path.

Method: real run on this machine, one fresh process per (model, path) so that memory is not
shared between them. Paths: float32 = every weight dequantized to float32 at load (SpecPipe
before weights stayed packed), then the packed path with the registry's default kernels, and
with int4pack preferred. Reported: the file's size, the stage's weight bytes (weight_nbytes),
resident memory before the load (after a one-layer warm-up load) and after it (VmRSS), the peak (VmHWM), and decode ms per
token (the fastest and the median of --tokens single-row forwards after a 16-token prompt).

    PYTHONPATH=. python benchmarks/bench_quant_load.py [--model FILE.gguf ...] [--tokens 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PATHS = ("float32", None, "int4pack")  # the kernel argument of build_stage


def status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def one(model: str, kernel: str | None, tokens: int, threads: int) -> dict:
    import torch

    from specpipe.config import StageSpec
    from specpipe.loader import open_checkpoint
    from specpipe.model.runner import run_rows
    from specpipe.model.stage import build_stage, weight_nbytes

    torch.set_num_threads(threads)
    ckpt = open_checkpoint(model)
    # Building a first stage loads code and initialises libraries (about 75 MB, once per
    # process): build and drop a one-layer stage first, so that the difference is the weights.
    del_me = build_stage(ckpt, StageSpec(0, 1, False, False), kernel=kernel)
    del del_me
    base = status_kib("VmRSS")
    t0 = time.perf_counter()
    stage = build_stage(ckpt, StageSpec.whole(ckpt.config), kernel=kernel)
    load_s = time.perf_counter() - t0
    rss, peak = status_kib("VmRSS"), status_kib("VmHWM")
    kinds = sorted({m.kernel for m in stage.modules() if isinstance(getattr(m, "kernel", None), str)})
    kv = stage.make_kv_cache(64)
    n = 16
    run_rows(stage, kv, torch.arange(100, 100 + n), list(range(n)), list(range(n)), list(range(n)), None, [n - 1])
    times = []
    for i in range(tokens):
        pos = n + i
        t0 = time.perf_counter()
        run_rows(stage, kv, torch.tensor([200 + i]), [pos], [pos], list(range(pos + 1)), None)
        times.append(time.perf_counter() - t0)
    return {"model": Path(model).name, "path": kernel or "default", "kernels": kinds,
            "file_mb": round(os.path.getsize(model) / 1e6, 1), "weights_mb": round(weight_nbytes(stage) / 1e6, 1),
            "rss_before_load_mb": round(base / 1024, 1), "rss_after_load_mb": round(rss / 1024, 1),
            "rss_peak_mb": round(peak / 1024, 1), "load_s": round(load_s, 2), "threads": torch.get_num_threads(),
            "decode_ms_min": round(min(times) * 1e3, 1), "decode_ms_median": round(statistics.median(times) * 1e3, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", action="append", default=None)
    p.add_argument("--path", action="append", default=None, help="float32 | default | int4pack (default: all)")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared machine more threads wait on each other)")
    p.add_argument("--out", default="benchmarks/results/quant_load_cpu.json")
    p.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # child process: MODEL PATH
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], None if args.one[1] == "default" else args.one[1], args.tokens, args.threads)))
        return
    if not args.model:
        from specpipe.loader.default_model import default_model_path

        args.model = [str(default_model_path())]
    results = []
    for model in args.model:
        for path in args.path or [k or "default" for k in PATHS]:
            out = subprocess.run([sys.executable, __file__, "--one", model, path, "--tokens", str(args.tokens),
                                  "--threads", str(args.threads)],
                                 capture_output=True, text=True)
            if out.returncode:
                print(f"{Path(model).name} {path}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
