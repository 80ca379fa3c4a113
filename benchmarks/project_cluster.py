"""Projected TBT of large targets split over S CPU nodes like this one (issue 46, item 4): step
counts + simulation.

Acceptance comes from real traces of the pair we have: `specpipe bench --oracle`'s method (the
draft and the trees run for real against oracle stages that answer with the Qwen2.5-Coder 1.5B
target's own greedy tokens), so each trace's steps, rows and hits are that pair's, standing in for
the large target and its 0.5B draft. Each trace is replayed (sim/events.py) with every stage one
node of a cost profile of the large target (`specpipe profile --synthetic`, this CPU), the stages
split by `--stage-layers balanced` on it, over 1 GbE and 10 GbE. `layers=auto` plans on that
profile. Sources: the 0.5B draft; the same with 20% of its expansions replaced by wrong tokens
(`--lower`: acceptance about 20% lower, the hit rate achieved is printed); the n-gram source.

  PYTHONPATH=. python benchmarks/project_cluster.py --model TARGET --draft DRAFT \
      --profiles benchmarks/results/profile_synthetic_qwen2.5-32b_t2_xeon.json \
                 benchmarks/results/profile_synthetic_llama-3.1-70b_t2_xeon.json \
      --stages 2,4,8,16 --prompts-per-group 1 --max-tokens 32 --out benchmarks/results/projection_32b_70b_xeon.json
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from specpipe.bench import offline
from specpipe.costs.balance import balanced_stage_layers
from specpipe.costs.profile import load_profile
from specpipe.costs.roofline import LINKS
from specpipe.engine.core import EngineCore
from specpipe.engine.engine import Engine
from specpipe.sampling import SamplingParams
from specpipe.sim.events import simulate
from specpipe.sim.oracle_pipeline import OraclePipeline
from specpipe.sim.trace import StepTracer
from specpipe.spec_decode.sources import NgramSource, TokenSource, WrappedSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import write_json  # noqa: E402

RUNS = {"pp": ("pp", 8, 4, 1), "tree": ("tree", 8, 7, 1), "specpipe": ("specpipe", 8, 4, 1),
        "auto": ("specpipe", 16, 4, "auto")}  # name -> (mode, width, depth, layers): §4.1's runs


class Weakened(WrappedSource):
    """A source whose proposals for a share `p` of the nodes it expands are wrong tokens (each
    candidate shifted by a constant), chosen by a hash of (request, node): the same draft with
    about p fewer hits, at the same cost."""

    def __init__(self, inner: TokenSource, p: float, vocab: int) -> None:
        super().__init__(inner, inner.name + f"-weakened{p:g}")
        self.p, self.vocab = p, vocab

    def _wrong(self, rid: int, node: int) -> bool:
        h = hashlib.blake2b(f"{rid}:{node}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") / 2**64 < self.p

    def _weaken(self, rid: int, out: dict) -> dict:
        return {node: ([((t + 7919) % self.vocab, s) for t, s in cands] if self._wrong(rid, node) else cands)
                for node, cands in out.items()}

    def propose(self, request_id, tree, rows, want, k):
        return self._weaken(request_id, self.inner.propose(request_id, tree, rows, want, k))

    def propose_many(self, calls):
        return [self._weaken(c.request_id, out) for c, out in zip(calls, self.inner.propose_many(calls))]


def oracle_trace(run: str, S: int, source, profile, counts, reqs_of, seqs):
    """One oracle run of every prompt (one at a time); its trace and its hit rate."""
    mode, width, depth, layers = RUNS[run]
    by_pid: dict[int, list[int]] = {}
    core = EngineCore(OraclePipeline(S, lambda pid: by_pid.get(pid, [])), mode, source if mode != "pp" else None,
                      width=width, depth=depth, layers=layers, max_num_seqs=1, max_waiting=64,
                      cost_profile=profile, stage_layers=counts)
    tracer = StepTracer(S, {"mode": mode, "label": run, "real": False, "width": width, "stage_layers": counts,
                            "source": core.source.name if core.source is not None else "none"})
    core.observer = tracer
    hits = verifications = 0
    for req in reqs_of():
        core.add_request(req)
        while core.has_work():
            for st in core.states.values():
                by_pid.setdefault(st.pid, seqs[st.req.request_id])
            core.step()
        if req.output_ids != seqs[req.request_id][len(req.prompt_ids):]:
            raise RuntimeError(f"{run} at S={S}: request {req.request_id} differs from the target's greedy output")
        hits, verifications = hits + req.stats.hits, verifications + req.stats.verifications
    return tracer.finish(), (hits / verifications if verifications else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the target whose greedy tokens the oracle answers with")
    ap.add_argument("--draft", required=True)
    ap.add_argument("--profiles", nargs="+", required=True, help="cost profiles of the large targets (with a draft)")
    ap.add_argument("--stages", default="2,4,8,16")
    ap.add_argument("--links", default="1gbe,10gbe")
    ap.add_argument("--prompts-per-group", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--driver-ms", type=float, default=0.3)
    ap.add_argument("--lower", type=float, default=0.2, help="share of the draft's expansions made wrong")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the references and the draft")
    ap.add_argument("--runs", default="pp,tree,specpipe,auto", help="of pp, tree, specpipe, auto (pp always)")
    ap.add_argument("--sources", default="draft,weakened,ngram", help="of draft, weakened, ngram")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)  # step counts do not depend on it; a shared machine's speed does
    t0 = time.perf_counter()
    stage_counts = [int(s) for s in args.stages.split(",")]
    links = [LINKS[name] for name in args.links.split(",")]
    profiles = {p: load_profile(p) for p in args.profiles}
    ns = SimpleNamespace(model=args.model, draft=args.draft, draft_vocab=None, draft_quantization=None,
                         stage_layers=None, tree_width=16, tree_depth=7, device="cpu", concurrency=1,
                         max_step_rows=64, cost_profile=None, transport="inproc", stage_threads=0, cluster="local",
                         ray_address="auto", dataset="specbench", dataset_path=None, groups=None,
                         prompts_per_group=args.prompts_per_group)
    prompts = offline.load_prompts(ns)
    runs = [offline.RunSpec("specpipe", (("layers", "auto"),))]
    engine = Engine(offline._config(ns, 1, runs, transport="inproc"))
    sampling = SamplingParams(max_tokens=args.max_tokens)

    from tqdm import tqdm

    refs = offline._references(engine, prompts, sampling, tqdm(disable=True))
    vocab = engine.checkpoint.config.vocab_size
    sources = {"draft": engine.source, f"draft, {args.lower:.0%} of expansions wrong":
               Weakened(engine.source, args.lower, vocab), "ngram": NgramSource()}
    wanted = set(args.sources.split(","))
    sources = {name: src for (key, (name, src)) in zip(("draft", "weakened", "ngram"), sources.items()) if key in wanted}
    run_names = [r for r in RUNS if r in {"pp", *args.runs.split(",")}]
    rows = []
    try:
        for S in stage_counts:
            for src_name, source in sources.items():
                for run in run_names:
                    if run == "pp" and src_name != next(iter(sources)):
                        continue  # pp has no source: once per S
                    # pp / tree / specpipe do not plan on the profile: one trace serves every profile.
                    for pi, (ppath, prof) in enumerate(profiles.items()):
                        if run != "auto" and pi > 0:
                            trace, hit = shared
                        else:
                            counts = balanced_stage_layers(prof, prof.num_layers, S, RUNS[run][1] if run != "pp" else 1)

                            def reqs_of():
                                return [engine.prompts.make_request(p["text"], sampling) for p in prompts]

                            seq_reqs = reqs_of()
                            seqs = {r.request_id: r.prompt_ids + ref for r, ref in zip(seq_reqs, refs)}
                            trace, hit = oracle_trace(run, S, source, prof, counts, lambda: seq_reqs, seqs)
                            shared = (trace, hit)
                        counts = balanced_stage_layers(prof, prof.num_layers, S, RUNS[run][1] if run != "pp" else 1)
                        for link in links:
                            sim = simulate(trace, prof, counts, link, args.driver_ms,
                                           draft_cost=source.runs_model and run != "pp").summary()
                            row = {"profile": prof.model.get("name", ppath), "S": S, "link": link.name,
                                   "source": "none" if run == "pp" else src_name, "run": run, "hit_rate": hit,
                                   "tokens_per_step": sim["tokens"] / max(sim["steps"], 1),
                                   "tbt_ms_median": sim["tbt_ms_median"], "tbt_ms_mean": sim["tbt_ms_mean"],
                                   "tok_s": 1e3 / sim["tbt_ms_mean"], "bound_by": sim["bottleneck"],
                                   "stage_layers": counts}
                            rows.append(row)
                    print(f"S={S} {src_name:32s} {run:8s} hit {hit if hit is None else round(hit, 3)} "
                          f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    finally:
        engine.close()
    for r in rows:  # ratio to pp on the same profile, S and link
        pp = next(x for x in rows if x["run"] == "pp" and (x["profile"], x["S"], x["link"]) ==
                  (r["profile"], r["S"], r["link"]))
        r["vs_pp"] = pp["tbt_ms_mean"] / r["tbt_ms_mean"]
    for r in rows:
        print(f"{r['profile']:28s} S={r['S']:2d} {r['link']:6s} {r['source'][:26]:26s} {r['run']:8s} "
              f"TBT {r['tbt_ms_mean']:8.1f} ms  {r['tok_s']:6.2f} tok/s  {r['vs_pp']:.2f}x pp  "
              f"({r['tokens_per_step']:.3f} tok/step, {r['bound_by']})")
    out = {"what": "projection: oracle step traces of the Qwen2.5-Coder 1.5B/0.5B pair replayed on synthetic "
                   "profiles of large targets (step count + simulation)",
           "prompts": len(prompts), "max_tokens": args.max_tokens, "tokens": sum(len(r) for r in refs),
           "driver_ms": args.driver_ms, "links": {l.name: [l.latency_ms, l.gbytes_per_s] for l in links},
           "profiles": list(profiles), "lower": args.lower, "rows": rows,
           "seconds": round(time.perf_counter() - t0, 1)}
    write_json(args.out, out)


if __name__ == "__main__":
    main()
