"""Validate the event simulator (specpipe/sim/events.py) against real runs on this machine.

Where each stage has a core to itself when it computes (S = 1 and 2 on 2 cores; S = 3 for one
request, whose stages mostly take turns) and the n-gram source costs the driver little, the simulator's prediction from (a) the recorded trace, (b) a cost profile measured
on this CPU with the stages' thread count and (c) the driver's own time per step, measured on
oracle stages (no stage compute, the same prompts and modes) must come within 15% of the measured
TBT and throughput of the same run (each run three times: medians), for every mode, single
request and 8 at once. Nothing is
fitted to the real runs: the profile (stage steps through the stages' own code), the link (one
row decoding in pp through local stage processes: the gaps along its path between the stages'
own compute spans, `specpipe profile --probe-links`) and the driver time are measured separately.
The profile includes what a step costs more after its stage idled (`specpipe profile --idle-gaps`):
the simulator prices each step by the gap its stage waited, and the table also shows the error
without that (every step priced as if run back to back).
Real runs record the stages' spans too, so the script also says how their compute and hand-overs
compare with the profile and the link. The profile measures a layer on middle stages of 8 layers
and of the sizes the runs' stages have (`specpipe profile --stage-layers`): on a CPU whose caches
hold an 8-layer stage's KV but not a whole model's, a long context's layer costs more in the
larger stage.

  python benchmarks/validate_sim.py --out benchmarks/results/validate_sim_smollm2_epyc_zen5.json   # docs/benchmarks.md, 4.4

Run it on an idle machine: the real runs and the profiles are wall-clock measurements.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from specpipe.costs.profile import CostProfile, Link
from specpipe.loader import open_checkpoint
from specpipe.loader.default_model import default_model_path
from specpipe.loader.partition import partition_layers
from specpipe.sim.events import has_stage_spans, measured, simulate
from specpipe.sim.trace import Trace

SINGLE = "pp,tree:depth=4,specpipe,specpipe:layers=2"
PROFILES = 3  # profiles measured one after another; the costs used are their medians
REAL_RUNS = 3  # each real run is repeated; simulated and measured figures are medians over them
BATCHED = "pp-cb,specpipe-db"


def sh(*argv: str) -> None:
    print("$ specpipe " + " ".join(argv), file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "specpipe.entrypoints.cli", *argv], check=True, stdout=subprocess.DEVNULL)


def driver_ms(trace: Trace) -> float:
    """The driver's own time per step on oracle stages: wall time per step (the oracle's answer
    costs next to nothing)."""
    ends = [s.t_end for s in trace.steps]
    return statistics.median(b - a for a, b in zip(ends, ends[1:])) * 1e3


def diagnose(real: Trace, sim) -> dict:
    """From a real trace's stage spans: measured stage compute over what the profile predicts for
    the same steps, and the median hand-over: how long after the last of its prerequisites (its
    input's end at the stage before, one step earlier; its own previous step; the step's control
    leaving the driver) a stage s > 1 started, i.e. what the last message took."""
    if not has_stage_spans(real):
        return {}
    measured_ms = predicted_ms = 0.0
    handovers = []
    for k, step in enumerate(real.steps):
        before = real.steps[k - 1].stage_spans if k else None
        for s, rows in enumerate(step.rows):
            if rows and step.stage_spans[s]:
                measured_ms += (step.stage_spans[s][1] - step.stage_spans[s][0]) * 1e3
                predicted_ms += sim.spans[k][s][1] - sim.spans[k][s][0]
                if s and before and before[s - 1]:
                    ready = max(before[s - 1][1], before[s][1] if before[s] else 0.0, step.t_submit)
                    handovers.append((step.stage_spans[s][0] - ready) * 1e3)
    return {"compute_ratio": measured_ms / predicted_ms if predicted_ms else None,
            "handover_ms": statistics.median(handovers) if handovers else None}


def median_profile(profiles: list[CostProfile]) -> CostProfile:
    """Every cost the median of several measurements of the same points (on this VM profiles
    measured minutes apart differ by up to 20% at some points; their median is steadier)."""
    def med(*values):
        return statistics.median(values) if not isinstance(values[0], list) else [med(*v) for v in zip(*values)]

    out = CostProfile.from_json(profiles[0].to_json())
    for name in ("layer_ms", "head_ms", "overhead_ms", "request_ms", "request_overhead_ms", "idle_head_ms"):
        setattr(out, name, med(*(getattr(p, name) for p in profiles)))
    for size in out.layer_ms_by_stage:
        out.layer_ms_by_stage[size] = med(*(p.layer_ms_by_stage[size] for p in profiles))
    for size in out.head_ms_by_stage:
        out.head_ms_by_stage[size] = med(*(p.head_ms_by_stage[size] for p in profiles))
    for size in out.idle_layer_ms:
        out.idle_layer_ms[size] = med(*(p.idle_layer_ms[size] for p in profiles))
    for link in out.links:
        out.links[link]["latency_ms"] = med(*(p.links[link]["latency_ms"] for p in profiles))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--groups", default="summarization,rag,math_reasoning,mt_bench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--work", default=None, help="keep traces and profiles here (default: a temporary folder)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="specpipe-validate-"))
    work.mkdir(parents=True, exist_ok=True)
    common = ["--transport", "processes", "--stage-threads", "1", "--prompts-per-group", "2", "--groups", args.groups, "--max-tokens", str(args.max_tokens), "--no-progress"]
    # Every stage is a process with one thread: at S = 1 the stage and the driver each have a core;
    # at S = 2 the two stages do, and the driver shares (there are only two).
    num_layers = open_checkpoint(default_model_path()).config.num_layers
    sizes = sorted({8} | {spec.end - spec.start for S in (1, 2, 3) for spec in partition_layers(num_layers, S)})
    for i in range(PROFILES):
        path = work / f"profile{i + 1}.json"
        if not path.exists():
            sh("profile", "--threads", "1", "--rows", "1,2,4,8,16,32,64,128,256", "--contexts", "64,256,512",
               "--stage-layers", ",".join(map(str, sizes)), "--repeats", "9", "--probe-links", "1,2,3",
               "--out", str(path))
    profile = median_profile([CostProfile.load(work / f"profile{i + 1}.json") for i in range(PROFILES)])
    profile.save(work / "profile.json")  # the one the predictions use
    # The same without the idle tables: every step priced as if the stage had run back to back.
    back_to_back = CostProfile.from_json({**profile.to_json(), "idle_gaps_ms": [], "idle_layer_ms": {}, "idle_head_ms": []})
    # Single requests at S = 3 too: one request's stages mostly take turns, so three stage processes
    # fit two cores; eight requests keep every stage busy, which three stages on two cores cannot be.
    cases = [("single", SINGLE, "1", "1,2,3"), ("batched", BATCHED, "8", "1,2")]
    real_dirs = ["real"] + [f"real{i + 1}" for i in range(1, REAL_RUNS)]
    for kind, runs, conc, stages in cases:
        for method in ("oracle", *real_dirs):
            out = work / f"{kind}_{method}"
            if not out.exists():
                sh("bench", "--runs", runs, "--stages", stages, "--concurrency", conc, "--trace-dir", str(out),
                   *(["--oracle"] if method == "oracle" else []), *common)
    rows = []
    for kind, *_ in cases:
        for path in sorted((work / f"{kind}_real").glob("trace_*.json")):
            oracle = Trace.load(work / f"{kind}_oracle" / path.name)
            drv = driver_ms(oracle)
            runs = []  # (trace, simulation, its summary, the measured summary) of each repetition
            for d in real_dirs:
                real = Trace.load(work / f"{kind}_{d}" / path.name)
                S = real.num_stages
                # The link measured while the stages compute (as they do in these runs); older
                # profiles have only the idle one.
                link = Link(**profile.links.get(f"loopback-s{S}-busy", profile.links[f"loopback-s{S}"]))
                result = simulate(real, profile, link=link, driver_ms=drv, draft_cost=False, keep_spans=True)
                busy = simulate(real, back_to_back, link=link, driver_ms=drv, draft_cost=False)
                runs.append((real, result, result.summary(), measured(real).summary(), busy.summary()))

            def med(i: int, key: str) -> float:
                return statistics.median(r[i][key] for r in runs)

            real, result = runs[0][:2]
            row = {"case": kind, "run": real.meta["label"], "stages": S, "driver_ms": drv, "link_ms": link.latency_ms,
                   "repetitions": len(runs), "tbt_sim": med(2, "tbt_ms_median"), "tbt_real": med(3, "tbt_ms_median"),
                   "tbt_real_each": [r[3]["tbt_ms_median"] for r in runs],
                   "tput_sim": med(2, "throughput_tok_s"), "tput_real": med(3, "throughput_tok_s"),
                   "tbt_sim_back_to_back": med(4, "tbt_ms_median"), "tput_sim_back_to_back": med(4, "throughput_tok_s"),
                   "bottleneck": runs[0][2]["bottleneck"], "utilization": runs[0][2]["utilization"],
                   **diagnose(real, result)}
            row["tbt_err"] = row["tbt_sim"] / row["tbt_real"] - 1
            row["tput_err"] = row["tput_sim"] / row["tput_real"] - 1
            row["tbt_err_back_to_back"] = row["tbt_sim_back_to_back"] / row["tbt_real"] - 1
            rows.append(row)
    print("\nSimulated vs measured (real runs on this machine; profile and driver time measured separately)")
    print(f"{'case':8s} {'run':22s} {'S':>2s} {'driver':>7s} {'TBT sim':>8s} {'real':>7s} {'err':>7s} "
          f"{'tok/s sim':>10s} {'real':>7s} {'err':>7s}  {'TBT err, no idle':>16s}  bound by")
    for r in rows:
        print(f"{r['case']:8s} {r['run']:22s} {r['stages']:2d} {r['driver_ms']:7.2f} {r['tbt_sim']:8.1f} "
              f"{r['tbt_real']:7.1f} {r['tbt_err']:+7.1%} {r['tput_sim']:10.1f} {r['tput_real']:7.1f} "
              f"{r['tput_err']:+7.1%}  {r['tbt_err_back_to_back']:+16.1%}  {r['bottleneck']}")
    worst = max(max(abs(r["tbt_err"]), abs(r["tput_err"])) for r in rows)
    print("\nWhere the time went (the stages' own spans): their compute against the profile's, and the "
          "hand-over between stages (one stage's end to the next one's start on the same rows) against the link")
    for r in rows:
        if r.get("compute_ratio") is not None:
            hand = f"{r['handover_ms']:.2f} ms" if r.get("handover_ms") is not None else "-"
            print(f"{r['case']:8s} {r['run']:22s} {r['stages']:2d}  compute real/profile {r['compute_ratio']:.2f}  "
                  f"hand-over {hand} (link {r['link_ms']:.2f} ms)")
    print(f"\nlargest error {worst:.1%} ({'within' if worst <= 0.15 else 'OUTSIDE'} 15%)")
    if args.out:
        Path(args.out).write_text(json.dumps({"work": str(work), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
