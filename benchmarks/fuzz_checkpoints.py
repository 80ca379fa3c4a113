"""Checkpoint fuzzing, the long run: every mutation of tests/loader/checkpoint_fuzz.py (hostile
header fields, cuts, N random bit flips per format), each loaded and run (a prefill and a decode
row) in a child process under a deadline and a memory limit, with the count of each outcome.

    python benchmarks/fuzz_checkpoints.py --flips 500 --seed 0

Outcomes: loaded, refused (one CheckpointError), crash (any other exception, or the child died),
allocation (MemoryError under the limit, or tracemalloc's peak far above the file's size), hang
(no answer within --deadline seconds). Anything but loaded/refused is listed by mutation name.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "loader"))  # a test tool, not the package's
from checkpoint_fuzz import mutations, try_load  # noqa: E402


def _worker(conn, work: str, flips: int, seed: int, limit_bytes: int) -> None:
    todo = mutations(Path(work) / "seeds", flips, seed)
    try_load(Path(work) / "seeds" / "seed.gguf")  # imports and caches before the limit
    vm = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (vm + limit_bytes, resource.RLIM_INFINITY))
    while True:
        i = conn.recv()
        if i is None:
            return
        d = Path(work) / f"w{i % 2}"
        d.mkdir(exist_ok=True)
        conn.send(try_load(todo[i].apply(d)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flips", type=int, default=500, help="random bit flips per format")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=20.0, help="seconds one load may take")
    ap.add_argument("--memory-limit-mib", type=int, default=1024, help="address space a load may add")
    args = ap.parse_args()
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory() as work:
        names = [m.name for m in mutations(Path(work) / "names", args.flips, args.seed)]
        counts: collections.Counter = collections.Counter()
        bad, proc, conn = [], None, None
        t0 = time.perf_counter()
        for i, name in enumerate(names):
            if proc is None:
                conn, child = ctx.Pipe()
                proc = ctx.Process(target=_worker, daemon=True,
                                   args=(child, work, args.flips, args.seed, args.memory_limit_mib << 20))
                proc.start()
            conn.send(i)
            # The first answer of a new child includes its imports and seed files.
            if conn.poll(args.deadline + (60 if i == 0 or counts["restarts"] else 0)):
                try:
                    outcome, detail = conn.recv()
                except EOFError:
                    outcome, detail = "crash", f"child died (exit code {proc.exitcode})"
            else:
                outcome, detail = "hang", f"no answer in {args.deadline} s"
            if outcome in ("hang", "crash") and detail.startswith(("no answer", "child died")):
                proc.kill()
                proc.join()
                proc = None
                counts["restarts"] += 1
            counts[outcome] += 1
            if outcome not in ("loaded", "refused"):
                bad.append(f"{outcome:10} {name}: {detail}")
        if proc is not None:
            conn.send(None)
            proc.join()
        elapsed = time.perf_counter() - t0

    def kind(name: str) -> str:  # gguf field / cut / flip, st header / cut / flip, config, index
        first, _, rest = name.partition(" ")
        return first.split("=")[0] + (" " + rest.split("@")[0] if rest.startswith(("cut", "flip")) else "")
    kinds = collections.Counter(kind(n) for n in names)
    print(f"{len(names)} mutations in {elapsed:.0f} s (seed {args.seed}, {args.flips} bit flips per format)")
    print("by kind:", ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())))
    for outcome in ("loaded", "refused", "crash", "allocation", "hang"):
        print(f"  {outcome:10} {counts[outcome]}")
    for line in bad:
        print(line)
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
