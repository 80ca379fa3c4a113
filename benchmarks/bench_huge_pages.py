"""Weights on transparent huge pages against 4 KiB pages (loader/weight_memory.py), and packed
into one arena in read order (model/stage.py pack_weights) against left where each was read, real run.

Builds the same whole-model stage three times in one process: with SPECPIPE_HUGE_PAGES=0 (the
loader's buffers as plain bytearrays; the arena too), with huge pages asked for but each tensor left
in its own buffer (pack_weights skipped), and as build_stage builds it, then times a one-row
decode step (the stage's own StageWorker.step after a `--context`-token prompt, median of
`--repeats`) of each alternately for `--rounds` rounds. Reports each build's load time, resident
and huge-page memory, and the median step.

  PYTHONPATH=. python benchmarks/bench_huge_pages.py --model TARGET --threads 1 --rounds 5 \
      --out benchmarks/results/huge_pages_qwen1.5b_t1_xeon.json
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from specpipe.config import StageSpec
from specpipe.costs.measure import StageTimer
from specpipe.loader import open_checkpoint
import specpipe.model.stage as stage
from specpipe.model.stage import build_stage, weight_nbytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import cpu_name, resolve_model, write_json  # noqa: E402


def memory_mb() -> dict[str, int]:
    """This process's resident and anonymous-huge-page memory, MB (Linux's smaps_rollup)."""
    text = Path("/proc/self/smaps_rollup").read_text()
    return {k: int(re.search(k + r":\s+(\d+)", text).group(1)) // 1024 for k in ("Rss", "AnonHugePages")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    builds, timers = {}, {}
    pack = stage.pack_weights
    for name, flag, packed in (("4k_pages", "0", True), ("huge_pages_unpacked", "1", False), ("huge_pages", "1", True)):
        os.environ["SPECPIPE_HUGE_PAGES"] = flag
        stage.pack_weights = pack if packed else (lambda model: 0)
        before = memory_mb()
        t0 = time.perf_counter()
        ckpt = open_checkpoint(path)
        model = build_stage(ckpt, StageSpec.whole(ckpt.config))
        stage.pack_weights = pack
        load_s = time.perf_counter() - t0
        after = memory_mb()
        builds[name] = {"load_s": load_s, "weights_mb": weight_nbytes(model) / 1e6,
                        "rss_mb": after["Rss"] - before["Rss"],
                        "huge_pages_mb": after["AnonHugePages"] - before["AnonHugePages"]}
        print(f"{name}: loaded in {load_s:.2f} s, {builds[name]}", flush=True)
        timers[name] = StageTimer(model, [args.context], [1], torch.device("cpu"), torch.float32, lambda: None, 1)
    steps = {name: [] for name in timers}
    for r in range(args.rounds):
        for name, timer in timers.items():
            steps[name].append(timer.ms(1, args.context, args.repeats))
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in steps.items()), flush=True)
    med = {name: statistics.median(v) for name, v in steps.items()}
    speedup = med["4k_pages"] / med["huge_pages"]
    packing = med["huge_pages_unpacked"] / med["huge_pages"]
    print(f"{Path(path).name}, {args.threads} thread(s): one-row step {med['4k_pages']:.2f} ms on 4 KiB pages, "
          f"{med['huge_pages_unpacked']:.2f} ms on huge pages unpacked, {med['huge_pages']:.2f} ms on huge pages "
          f"packed ({speedup:.2f}x the 4 KiB pages, {packing:.2f}x unpacked)")
    write_json(args.out, {"what": "one-row decode step, weights on 4 KiB pages vs transparent huge pages, "
                                  "unpacked vs packed in read order (real run)",
                          "cpu": cpu_name(), "model": path, "threads": args.threads, "context": args.context,
                          "builds": builds, "step_ms": steps, "median_ms": med, "speedup": speedup,
                          "packing_speedup": packing})


if __name__ == "__main__":
    main()
