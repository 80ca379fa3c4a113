#!/usr/bin/env python3
"""--cluster ray on this machine: a planned split on mixed nodes, the backend's overhead, recovery.

Three measurements, each a real run (no simulation), Ray nodes started by ray.cluster_utils.Cluster
with their CPU affinity set as `taskset` on `ray start` would:

  mixed     three nodes: one alone on core 0, two sharing core 1 (each half a core). pp decode
            of one request with the planner's split, the even split (same counts on every node),
            and hand-picked splits, each once a round for `--rounds` rounds; tokens/s of each.
            One request's stages compute in turn, so nodes sharing a core are not slower for it;
            `--busy-core1` adds a busy loop on core 1, which makes them so (about half a core).
  overhead  two nodes, one core each: the same split as --cluster ray and as local stage processes
            (one thread per stage); ms per token of each.
  recovery  two nodes: a stage actor SIGKILLed mid-stream, `--trials` times over the modes; the
            time from the kill to the next token, tokens compared with an undisturbed run.

  python benchmarks/cluster_ray.py --model PATH --out benchmarks/results/cluster_ray.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

from specpipe.config import EngineConfig
from specpipe.engine.engine import Engine
from specpipe.sampling import SamplingParams

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring and tests."


def start_cluster(cores: list[set[int]]) -> Cluster:
    """A head without CPUs (it only holds the driver's actors) and one node per entry of `cores`,
    each started with that CPU affinity (inherited by its raylet and workers)."""
    mine = os.sched_getaffinity(0)
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        for cpus in cores:
            os.sched_setaffinity(0, cpus)
            c.add_node(num_cpus=len(cpus))
    finally:
        os.sched_setaffinity(0, mine)
    ray.init(address=c.address, log_to_driver=False)
    return c


def stop_cluster(c: Cluster) -> None:
    ray.shutdown()
    c.shutdown()


def decode_ms(engine: Engine, tokens: int, repeats: int) -> tuple[float, list[int]]:
    """Median ms per output token of one greedy request (prefill excluded: from the first token)."""
    times, ids = [], []
    for _ in range(repeats):
        stamps: list[float] = []
        out = engine.generate(PROMPT, SamplingParams(max_tokens=tokens), chat=True, ignore_eos=True,
                              on_text=lambda _t: stamps.append(time.perf_counter()))
        ids = out.token_ids
        if len(stamps) >= 2:
            times.append((stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1))
    return statistics.median(times), ids


def base(args, **extra) -> EngineConfig:
    return EngineConfig(model=args.model, max_context=1024, max_num_seqs=4, kv_memory="256MiB", **extra)


def busy_core(core: int) -> subprocess.Popen:
    """A process spinning on `core` for as long as it lives: whatever else runs there gets about
    half of it, as on a slower machine."""
    return subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"])


def mixed(args) -> dict:
    hog = busy_core(1) if args.busy_core1 else None
    c = start_cluster([{0}, {1}, {1}])
    out: dict = {"nodes": "core 0 alone; cores 1 shared by two nodes"
                          + ("; core 1 also runs a busy loop (its nodes get about half of it)" if hog else ""),
                 "rounds": args.rounds, "splits": {}}
    layers = num_layers(args)
    splits = [("planned", {}), ("even", {"stage_layers": "even"}),
              *[(f"hand {s}", {"stage_layers": s}) for s in args.hand]]
    try:
        # Every split once a round, `--rounds` rounds: this machine's pace drifts by more than the
        # splits differ, so each split's figure is the median of its rounds, taken in turn.
        for r in range(args.rounds):
            for label, extra in splits:
                kw = dict(mode="pp", cluster="ray", stages=3)
                if extra.get("stage_layers") == "even":
                    kw["stage_layers"] = [layers // 3 + (i < layers % 3) for i in range(3)]
                elif extra.get("stage_layers"):
                    counts = [int(x) for x in extra["stage_layers"].split(",")]
                    kw.update(stage_layers=counts, stages=len(counts))
                engine = Engine(base(args, **kw), progress=lambda _m: None)
                try:
                    ms, _ = decode_ms(engine, args.tokens, args.repeats)
                    plan = [f"{s.node.name} {s.start}-{s.end - 1}" for s in engine.cluster.plan.stages]
                finally:
                    engine.close()
                split = out["splits"].setdefault(label, {"ms_each_round": [], "plan": plan})
                split["ms_each_round"].append(ms)
                print(f"round {r + 1}, mixed {label}: {ms:.1f} ms/token  {plan}", file=sys.stderr, flush=True)
        for split in out["splits"].values():
            split["ms_per_token"] = statistics.median(split["ms_each_round"])
            split["tokens_per_s"] = 1e3 / split["ms_per_token"]
        s = out["splits"]
        best_hand = min((v["ms_per_token"] for k, v in s.items() if k.startswith("hand")), default=None)
        out["planned_vs_even"] = s["even"]["ms_per_token"] / s["planned"]["ms_per_token"]
        if best_hand:
            out["planned_vs_best_hand"] = best_hand / s["planned"]["ms_per_token"]
    finally:
        stop_cluster(c)
        if hog is not None:
            hog.kill()
            hog.wait()
    return out


def overhead(args) -> dict:
    c = start_cluster([{0}, {1}])
    out: dict = {}
    try:
        ids = {}
        for label, kw in [("local processes", dict(transport="processes", stage_threads=1)),
                          ("ray", dict(cluster="ray")), ("local processes again", dict(transport="processes",
                                                                                          stage_threads=1))]:
            engine = Engine(base(args, mode="pp", stages=2, **kw))
            try:
                L = engine.checkpoint.config.num_layers
                assert [s.end - s.start for s in engine.stage_specs] == [L - L // 2, L // 2] or kw.get("cluster")
                ms, ids[label] = decode_ms(engine, args.tokens, args.repeats)
            finally:
                engine.close()
            out[label] = ms
            print(f"overhead {label}: {ms:.2f} ms/token", file=sys.stderr)
        out["ray_vs_local"] = out["ray"] / statistics.mean([out["local processes"], out["local processes again"]])
        out["same_tokens"] = len({tuple(v) for v in ids.values()}) == 1
    finally:
        stop_cluster(c)
    return out


def recovery(args) -> dict:
    c = start_cluster([{0}, {1}])
    modes = ["pp", "specpipe", "specpipe-db"]
    trials, gaps = [], []
    L = num_layers(args)
    try:
        for mode in modes:
            kw = dict(mode=mode, cluster="ray", stages=2, stage_layers=[L - L // 2, L // 2], stage_timeout_s=10,
                      draft="ngram" if mode != "pp" else None,
                      # Kills a few dozen steps apart count as "in a row" (engine/restart.py): allow them all.
                      restart_stages=args.trials + 1)
            cfg = base(args, **kw)
            engine = Engine(cfg)
            try:
                want = engine.generate(PROMPT, SamplingParams(max_tokens=args.tokens), chat=True).token_ids
                for t in range(args.trials // len(modes)):
                    pids = engine.cluster.stage_pids()
                    stamps: list[float] = []
                    killed = {}

                    def on_text(_t, pids=pids, stamps=stamps, killed=killed):
                        stamps.append(time.perf_counter())
                        if len(stamps) == 8 and not killed:
                            killed["at"] = time.perf_counter()
                            os.kill(pids[t % 2], signal.SIGKILL)

                    got = engine.generate(PROMPT, SamplingParams(max_tokens=args.tokens), chat=True,
                                          on_text=on_text).token_ids
                    after = [s for s in stamps if s > killed.get("at", float("inf"))]
                    gap = (after[0] - killed["at"]) if after else None
                    trials.append({"mode": mode, "stage": t % 2 + 1, "same_tokens": got == want,
                                   "resume_s": gap, "restarts": engine.cluster.restarts})
                    gaps.append(gap)
                    print(f"recovery {mode} trial {t}: same={got == want} resume {gap:.2f} s", file=sys.stderr)
            finally:
                engine.close()
    finally:
        stop_cluster(c)
    ok = [g for g in gaps if g is not None]
    return {"trials": trials, "count": len(trials), "tokens_different": sum(not t["same_tokens"] for t in trials),
            "resume_s_median": statistics.median(ok) if ok else None, "resume_s_max": max(ok) if ok else None,
            "layers": L}


def num_layers(args) -> int:
    from specpipe.loader import open_checkpoint
    from specpipe.loader.default_model import default_model_path

    return open_checkpoint(args.model or default_model_path()).config.num_layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF or HF directory (default: the embedded model)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trials", type=int, default=12, help="recovery: kills in all, spread over the modes")
    p.add_argument("--hand", nargs="*", default=[], help="mixed: hand-picked layer counts, e.g. 28 20,4,4")
    p.add_argument("--rounds", type=int, default=3, help="mixed: every split once a round (medians)")
    p.add_argument("--busy-core1", action="store_true",
                   help="mixed: a busy loop on core 1 too, so its two nodes are slower than core 0's")
    p.add_argument("--only", nargs="*", default=["mixed", "overhead", "recovery"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    result = {"model": args.model or "embedded SmolLM2-135M", "cpu": _cpu(), "tokens": args.tokens}
    for part in args.only:
        result[part] = {"mixed": mixed, "overhead": overhead, "recovery": recovery}[part](args)
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v if k != "recovery" else {m: n for m, n in v.items() if m != "trials"}
                      for k, v in result.items()}, indent=1))


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
