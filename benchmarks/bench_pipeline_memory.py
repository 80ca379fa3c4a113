"""Peak resident memory of the whole process tree of `specpipe generate`, at several stage counts.

Method: real runs on this machine, one fresh `specpipe generate --json` per stage count (the
driver and, for S >= 2, one process per stage), sampled every 20 ms with psutil: the peak of
the tree's summed resident memory (RSS), each process's own peak, and the stages' weight bytes
from the --json stats. startup_s is the wall time from launch to the first request (the run's
wall time less TTFT and the decode after it): interpreter, imports, loading and KV allocation.
SPECPIPE_KERNEL=float32 in the environment measures the old dequantize-at-load path.

    PYTHONPATH=. python benchmarks/bench_pipeline_memory.py [--model FILE.gguf] [--stages 1 2 4]
        [--kv-memory 256MiB] [--tokens 16] [--out benchmarks/results/pipeline_memory.json]

Issue 19's goal: peak of the tree <= 1.3 x the file + 0.8 GB per process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_pair import TARGET, ensure_model  # noqa: E402

PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def tree_rss(root: psutil.Process) -> dict[int, int]:
    out = {}
    try:
        procs = [root] + root.children(recursive=True)
    except psutil.Error:  # the run has ended
        return out
    for p in procs:
        try:
            out[p.pid] = p.memory_info().rss
        except psutil.Error:
            pass
    return out


def one(model: str, stages: int, kv_memory: str, tokens: int) -> dict:
    exe = shutil.which("specpipe") or sys.exit("specpipe is not installed (./install.sh)")
    cmd = [exe, "generate", "--model", model, "--stages", str(stages), "--kv-memory", kv_memory,
           "--max-tokens", str(tokens), "--json", PROMPT]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)
    peak_sum, peaks, done = 0, {}, threading.Event()

    def sample() -> None:
        nonlocal peak_sum
        while not done.is_set():
            rss = tree_rss(root)
            peak_sum = max(peak_sum, sum(rss.values()))
            for pid, r in rss.items():
                peaks[pid] = max(peaks.get(pid, 0), r)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}")
    res = json.loads(out)
    st = res["stats"]
    decode_s = (st["ttft_ms"] + st["tbt_ms"] * max(0, len(res["token_ids"]) - 1)) / 1e3
    return {
        "stages": stages, "processes": len(peaks), "peak_tree_rss_gb": peak_sum / 1e9,
        "peak_rss_per_process_gb": sorted((round(v / 1e9, 3) for v in peaks.values()), reverse=True),
        "weight_bytes_per_stage_gb": [s["weight_bytes"] / 1e9 for s in st["stages"]],
        "startup_s": wall - decode_s, "wall_s": wall, "tbt_ms": st["tbt_ms"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the Qwen2.5-Coder-1.5B target)")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--kv-memory", default="256MiB")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = args.model or str(ensure_model(TARGET))
    file_gb = Path(model).stat().st_size / 1e9
    kernel = os.environ.get("SPECPIPE_KERNEL", "default")
    rows = []
    print(f"{Path(model).name}: {file_gb:.3f} GB; kernel {kernel}; --kv-memory {args.kv_memory}")
    print("S  procs  peak tree GB  goal GB  per-process peaks GB      weights/stage GB  startup s  TBT ms")
    for s in args.stages:
        r = one(model, s, args.kv_memory, args.tokens)
        r["goal_gb"] = 1.3 * file_gb + 0.8 * r["processes"]
        rows.append(r)
        print(f"{s:<2} {r['processes']:>5}  {r['peak_tree_rss_gb']:>12.2f}  {r['goal_gb']:>7.2f}  "
              f"{str(r['peak_rss_per_process_gb']):<25} {max(r['weight_bytes_per_stage_gb']):>16.3f}  "
              f"{r['startup_s']:>9.1f}  {r['tbt_ms']:>6.0f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": Path(model).name, "file_gb": file_gb, "kernel": kernel,
                                              "kv_memory": args.kv_memory, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
