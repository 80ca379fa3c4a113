"""Many requests at once: `pp-cb` (continuous batching over the pipeline, as vLLM runs PP) against
`specpipe-db` (SpecPipe with dynamic batching), at several concurrency levels and stage counts.

  python benchmarks/bench_batch.py --pair qwen --out batch.json                   # (a) + (b)
  python benchmarks/bench_batch.py --pair qwen --real --stages 2,4 --concurrency 1,4,8 \\
         --requests 8 --max-tokens 16 --out batch_real.json                      # (c)

Methods (printed with every table):
  (a) step counts -- the engine core, the scheduler, the token trees and the draft model run for
      real; the stages are `OraclePipeline`, which delays and prunes rows exactly as S stages do
      and answers each request with the target's greedy tokens (computed for real once, cached).
      Exact for greedy decoding: every request's output is asserted equal to its reference.
      Concurrency n = at most n requests in the pipeline (`max_num_seqs`); all requests are queued
      at the start, and a waiting one joins as soon as another leaves.
  (b) time -- the per-step row counts of (a) replayed with a cost profile (profile_costs.py):
      a step costs max(slowest stage, the draft of the rows sent that step) + the serial drafts of
      new roots after misses + link latency. Once with the profile measured on this CPU, once with
      a what-if profile in which rows are nearly free (costs flat in rows, as on an accelerator far
      from saturation) and the draft costs 1.5% of the target per row (a 1B draft for a 70B target).
  (c) real run -- the same engine with S stage processes on this machine (the driver and every
      stage share its 2 cores), wall clock.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_specpipe import models, reference_outputs  # noqa: E402
from specbench import load_prompts  # noqa: E402
from specpipe.config import EngineConfig  # noqa: E402
from specpipe.engine.core import EngineCore  # noqa: E402
from specpipe.engine.sources import build_source  # noqa: E402
from specpipe.loader import open_checkpoint  # noqa: E402
from specpipe.loader.partition import partition_layers  # noqa: E402
from specpipe.request import Request  # noqa: E402
from specpipe.sampling import SamplingParams  # noqa: E402
from specpipe.sim.oracle_pipeline import OraclePipeline  # noqa: E402
from specpipe.sim.timing import CostProfile, stage_ms  # noqa: E402
from specpipe.spec_decode.sources import ProposeCall, TokenSource  # noqa: E402
from specpipe.tokenizer.tokenizer import Tokenizer  # noqa: E402

BLOCKS, BLOCK_SIZE = 4096, 16  # the driver's pool and the draft's: 65536 slots, never the limit here


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class CountingSource(TokenSource):
    """The draft source, counting the rows it takes in per phase of each step."""

    def __init__(self, inner: TokenSource) -> None:
        self.inner, self.name = inner, inner.name
        self.phase, self.rows = "", {}

    def start(self, rid):
        self.inner.start(rid)

    def propose(self, rid, tree, rows, want, k):
        return self.propose_many([ProposeCall(rid, tree, rows, want, k)])[0]

    def propose_many(self, calls):
        self.rows[self.phase] = self.rows.get(self.phase, 0) + sum(len(c.rows.node_ids) for c in calls)
        return self.inner.propose_many(calls)

    def observe(self, rid, commit, drop):
        self.inner.observe(rid, commit, drop)

    def finish(self, rid):
        self.inner.finish(rid)


class TracedCore(EngineCore):
    """The engine core, telling the counting source which phase each draft call belongs to."""

    def _draft(self, states, phase):
        if self.source is not None:
            self.source.phase = phase
        super()._draft(states, phase)


def run_steps(S: int, mode: str, n: int, prompts_ids, refs, source, args) -> dict:
    """(a): one configuration against the oracle stages; returns the trace."""
    seq_by_pid: dict[int, list[int]] = {}
    pipe = OraclePipeline(S, lambda pid: seq_by_pid[pid])
    counting = CountingSource(source) if source is not None else None
    core = TracedCore(pipe, mode, counting, width=args.width, kv_blocks=BLOCKS, block_size=BLOCK_SIZE,
                      max_num_seqs=n, step_rows=args.step_rows, max_waiting=len(prompts_ids))
    reqs = [Request(i, ids, SamplingParams(max_tokens=args.max_tokens), STOP_IDS) for i, ids in enumerate(prompts_ids)]
    for r in reqs:
        core.add_request(r)
    steps = []
    while core.has_work():
        for rid, st in core.states.items():  # pids change only on preemption; keep the map current
            seq_by_pid.setdefault(st.pid, prompts_ids[rid] + refs[rid])
        if counting is not None:
            counting.rows = {}
        core.step()
        steps.append({"rows": pipe.rows_per_step[-1],
                      "draft_during": counting.rows.get("while_computing", 0) if counting else 0,
                      "draft_after": counting.rows.get("after_verify", 0) if counting else 0,
                      "tokens": [len(r.output_ids) for r in reqs]})
    for r, ref in zip(reqs, refs):
        if r.output_ids != ref:
            raise SystemExit(f"{mode} S={S} n={n}: request {r.request_id} differs from its reference")
    tokens = sum(len(r.output_ids) for r in reqs)
    # Steps until the last token (the trailing step that only carries releases excluded).
    totals = [sum(st["tokens"]) for st in steps]
    busy = totals.index(totals[-1]) + 1
    return {"mode": mode, "stages": S, "concurrency": n, "tokens": tokens, "steps": busy,
            "tokens_per_step": tokens / busy, "preemptions": sum(r.stats.preemptions for r in reqs),
            "hit_rate": (sum(r.stats.hits for r in reqs) / v) if (v := sum(r.stats.verifications for r in reqs)) else None,
            "trace": steps[:busy]}


def simulate(run: dict, layers: list[int], prof: CostProfile, link_ms: float) -> dict:
    """(b): time of each step from its rows; throughput and per-request TBT from token times."""
    S, now, times = len(layers), 0.0, []
    for st in run["trace"]:
        stages = max(stage_ms(prof, layers[s], s == S - 1, st["rows"][s]) for s in range(S))
        now += max(stages, prof.draft(st["draft_during"])) + prof.draft(st["draft_after"]) + link_ms
        times.append(now)
    n_req = len(run["trace"][0]["tokens"])
    tbts = []
    for r in range(n_req):
        stamps, prev = [], 0
        for t, st in zip(times, run["trace"]):
            k = st["tokens"][r]
            stamps += [t] * (k - prev)  # tokens committed in the same step share its time
            prev = k
        if len(stamps) > 1:
            tbts.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return {"total_ms": now, "throughput_tok_s": run["tokens"] / now * 1e3,
            "tbt_ms_median": statistics.median(tbts), "tbt_ms_mean": statistics.mean(tbts)}


def what_if_profile(prof: CostProfile, num_layers: int) -> CostProfile:
    """Rows nearly free (flat costs) and a draft at 1.5% of the target per row."""
    whole = num_layers * prof.layer_ms[0] + prof.head_ms[0]
    n = len(prof.rows)
    return CostProfile(prof.device + " (what-if: rows free, draft 1.5%)", prof.rows, [prof.layer_ms[0]] * n,
                       [prof.head_ms[0]] * n, [0.015 * whole] * n, prof.context)


def run_real(S: int, mode: str, n: int, target, draft, prompts_ids, args) -> dict:
    """(c): real stage processes on this machine, wall clock."""
    from specpipe.engine.engine import Engine

    cfg = EngineConfig(model=str(target), mode=mode, stages=S, draft=draft if mode == "specpipe-db" else None,
                       tree_width=args.width, max_num_seqs=n, max_step_rows=args.step_rows, max_context=1024,
                       kv_memory="1GiB")
    engine = Engine(cfg)
    try:
        reqs = [engine.make_request(ids, SamplingParams(max_tokens=args.max_tokens)) for ids in prompts_ids]
        t0 = time.perf_counter()
        engine.run(reqs)
        wall = time.perf_counter() - t0
        core = engine.core()
    finally:
        engine.close()
    tokens = sum(len(r.output_ids) for r in reqs)
    tbts = [r.summary(S)["tbt_ms"] for r in reqs if r.summary(S)["tbt_ms"] is not None]
    return {"mode": mode, "stages": S, "concurrency": n, "tokens": tokens, "steps": core.steps,
            "tokens_per_step": tokens / core.steps, "wall_s": wall, "throughput_tok_s": tokens / wall,
            "tbt_ms_median": statistics.median(tbts), "outputs": [r.output_ids for r in reqs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=["qwen", "smollm2"], default="qwen")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--requests", type=int, default=32, help="Spec-Bench prompts, spread over the six groups")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--stages", default="4,8")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--width", type=int, default=8, help="W: the full tree width of a request alone")
    ap.add_argument("--step-rows", type=int, default=64, help="row budget per step (both modes)")
    ap.add_argument("--profile", default=None, help="cost profile JSON (profile_costs.py) for (b)")
    ap.add_argument("--link-ms", type=float, default=0.0)
    ap.add_argument("--real", action="store_true", help="(c) real stage processes instead of (a)+(b)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache/specpipe/bench"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", default=None,
                    help="earlier --out JSON: its configurations not run now are reported with these")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    global STOP_IDS
    target, draft = models(args)
    ckpt = open_checkpoint(target)
    tok = Tokenizer.from_path(target)
    STOP_IDS = frozenset(tok.eos_token_ids)
    per_group = -(-args.requests // 6)
    prompts = load_prompts(per_group)
    prompts = [prompts[g * per_group + i] for i in range(per_group) for g in range(6)][:args.requests]
    prompts_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p["text"]}]),
                              add_special_tokens=False) for p in prompts]
    stages = [int(s) for s in args.stages.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    results = []
    if args.real:
        for S in stages:
            for n in levels:
                for mode in ("pp-cb", "specpipe-db"):
                    r = run_real(S, mode, n, target, draft, prompts_ids, args)
                    results.append(r)
                    log(f"real {mode:11s} S={S} n={n:2d}: {r['tokens_per_step']:.3f} tok/step, "
                        f"{r['throughput_tok_s']:.2f} tok/s, TBT {r['tbt_ms_median']:.0f} ms")
            for n in levels:  # every mode and level must produce the same tokens
                outs = [r["outputs"] for r in results if r["stages"] == S and r["concurrency"] == n]
                assert all(o == outs[0] for o in outs), f"S={S} n={n}: outputs differ between modes"
    else:
        refs = reference_outputs(target, ckpt, prompts_ids, args.max_tokens, STOP_IDS, Path(args.cache_dir))
        source = build_source(draft, ckpt, tok, BLOCKS, BLOCK_SIZE)
        for S in stages:
            for n in levels:
                for mode in ("pp-cb", "specpipe-db"):
                    t0 = time.perf_counter()
                    r = run_steps(S, mode, n, prompts_ids, refs, source if mode == "specpipe-db" else None, args)
                    results.append(r)
                    log(f"{mode:11s} S={S} n={n:2d}: {r['tokens_per_step']:.3f} tok/step, hit rate "
                        f"{r['hit_rate']}, {r['preemptions']} preemptions ({time.perf_counter() - t0:.0f} s)")
                if args.out:
                    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}))
        if args.merge:
            done = {(r["stages"], r["concurrency"], r["mode"]) for r in results}
            results += [r for r in json.loads(Path(args.merge).read_text())["results"]
                        if (r["stages"], r["concurrency"], r["mode"]) not in done]
        report(results, args, ckpt.config.num_layers)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}))


def report(results: list[dict], args, num_layers: int) -> None:
    print(f"\n(a) Step counts (exact; real engine core + draft, oracle stages). {args.requests} Spec-Bench "
          f"requests, up to {args.max_tokens} greedy tokens, W={args.width}, row budget {args.step_rows}/step.")
    print(f"{'S':>2s} {'n':>3s} {'pp-cb tok/step':>15s} {'specpipe-db':>12s} {'ratio':>6s}")
    by = {(r["stages"], r["concurrency"], r["mode"]): r for r in results}
    for S, n in sorted({(r["stages"], r["concurrency"]) for r in results}):
        a, b = by[(S, n, "pp-cb")], by[(S, n, "specpipe-db")]
        print(f"{S:2d} {n:3d} {a['tokens_per_step']:15.3f} {b['tokens_per_step']:12.3f} "
              f"{b['tokens_per_step'] / a['tokens_per_step']:5.2f}x")
    if not args.profile:
        return
    pj = json.loads(Path(args.profile).read_text())
    measured = CostProfile(**pj["profile"])
    for prof in (measured, what_if_profile(measured, num_layers)):
        print(f"\n(b) Simulated time (profile: {prof.device}, context {prof.context}; link {args.link_ms} ms)")
        print(f"{'S':>2s} {'n':>3s} {'pp-cb tok/s':>12s} {'spdb tok/s':>11s} {'ratio':>6s} "
              f"{'pp-cb TBT':>10s} {'spdb TBT':>9s} {'ratio':>6s}")
        for S, n in sorted({(r["stages"], r["concurrency"]) for r in results}):
            layers = [s.end - s.start for s in partition_layers(num_layers, S)]
            a = simulate(by[(S, n, "pp-cb")], layers, prof, args.link_ms)
            b = simulate(by[(S, n, "specpipe-db")], layers, prof, args.link_ms)
            print(f"{S:2d} {n:3d} {a['throughput_tok_s']:12.2f} {b['throughput_tok_s']:11.2f} "
                  f"{b['throughput_tok_s'] / a['throughput_tok_s']:5.2f}x {a['tbt_ms_median']:10.0f} "
                  f"{b['tbt_ms_median']:9.0f} {a['tbt_ms_median'] / b['tbt_ms_median']:5.2f}x")


STOP_IDS: frozenset = frozenset()

if __name__ == "__main__":
    main()
