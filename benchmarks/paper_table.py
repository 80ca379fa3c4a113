"""The paper's table in simulation (issue 9): single-request TBT of specpipe against pp and the
best tree per Spec-Bench group, and specpipe-db against pp-cb, at 8 and 14 stages, on the
accelerator roofline profiles, from step traces recorded with the real Qwen pair.

Method: simulation (specpipe/sim/events.py). The traces come from
  specpipe bench --oracle --model TARGET --draft DRAFT --runs ... --stages 8,14 --trace-dir DIR
(the draft model and the token trees run for real, the stages are oracle stages: exact for greedy
decoding); each stage is one device of the roofline profile (Llama-3.1-70B layers, 80 over S
stages), the draft is the profile's Llama-3.2-1B on one such device, and stages are joined by
the chosen link. The trace's steps, rows per stage, draft forwards and hits are the Qwen pair's.

  python benchmarks/paper_table.py --traces benchmarks/results/traces_qwen --driver-ms 0.3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from specpipe.costs.profile import load_profile
from specpipe.sim.cli import parse_link
from specpipe.sim.events import simulate
from specpipe.sim.trace import Trace

SETUPS = [("a100-80gb", "10gbe"), ("a100-80gb", "ib-100g"), ("a100-80gb", "nvlink3"),
          ("h100-80gb", "10gbe"), ("h100-80gb", "ib-100g"), ("h100-80gb", "nvlink4")]
PAPER = {8: "4.19–5.53× over PP, 2.08–2.38× over tree", 14: "4.46–7.79× over PP, 2.2–2.69× over tree"}


def group_tbt(trace: Trace, sim) -> dict[str, float]:
    """Mean per-request TBT by prompt group (and 'all')."""
    groups = trace.meta.get("groups", {})
    by: dict[str, list[float]] = {}
    for rid, times in sim.token_times.items():
        if len(times) > 1:
            tbt = (times[-1] - times[0]) / (len(times) - 1)
            by.setdefault(groups.get(str(rid), "all"), []).append(tbt)
            if groups:
                by.setdefault("all", []).append(tbt)
    return {g: statistics.mean(v) for g, v in by.items()}


def single_table(device, link_name, S, runs, profile, link, driver_ms) -> dict:
    """TBT per group of pp, the best tree and every specpipe run, printed as a Markdown table."""
    tbt = {label: group_tbt(t, simulate(t, profile, link=link, driver_ms=driver_ms)) for label, t in runs.items()}
    trees = [label for label in tbt if runs[label].meta["mode"] == "tree"]
    best_tree = min(trees, key=lambda label: tbt[label]["all"]) if trees else None
    specs = sorted(label for label in tbt if runs[label].meta["mode"] == "specpipe")
    print(f"\n### {device}, {link_name}, S = {S} (best tree: {best_tree}; paper: {PAPER.get(S, '-')})\n")
    head = "| group | pp ms | tree ms | " + " | ".join(f"{s} ms | vs pp | vs tree" for s in specs) + " |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for g in ["all", *sorted(g for g in tbt["pp"] if g != "all")]:
        pp, tree = tbt["pp"][g], tbt[best_tree][g] if best_tree else None
        cells = [g, f"{pp:.1f}", f"{tree:.1f}" if tree else "-"]
        for s in specs:
            v = tbt[s][g]
            cells += [f"{v:.1f}", f"{pp / v:.2f}×", f"{tree / v:.2f}×" if tree else "-"]
        print("| " + " | ".join(cells) + " |")
    return {"device": device, "link": link_name, "stages": S, "best_tree": best_tree, "tbt_ms": tbt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", required=True, nargs="+",
                    help="folders of traces from specpipe bench --oracle --trace-dir (single and batched runs)")
    ap.add_argument("--driver-ms", type=float, default=0.3, help="the driver's own time per step")
    ap.add_argument("--out", default=None, help="write all numbers as JSON here")
    ap.add_argument("--plots", default=None, help="draw the S = 8 pictures (H100, InfiniBand) into this folder")
    ap.add_argument("--steps", default=None, help="the result JSON of the same `specpipe bench --oracle` run "
                                                  "(tokens per step against S)")
    args = ap.parse_args()
    traces = [Trace.load(p) for d in args.traces for p in sorted(Path(d).glob("trace_*.json"))]
    if not traces:
        sys.exit(f"no traces in {args.traces}")
    out = []
    for device, link_name in SETUPS:
        profile, link = load_profile(device), parse_link(link_name)
        for S in sorted({t.num_stages for t in traces}):
            at_s = [t for t in traces if t.num_stages == S]
            single = {t.meta["label"]: t for t in at_s if t.meta["mode"] in ("pp", "tree", "specpipe")}
            if "pp" in single:
                out.append(single_table(device, link_name, S, single, profile, link, args.driver_ms))
            for c in sorted({t.meta.get("concurrency", 1) for t in at_s if t.meta["mode"] == "pp-cb"}):
                batched = {t.meta["mode"]: t for t in at_s
                           if t.meta["mode"] in ("pp-cb", "specpipe-db") and t.meta.get("concurrency", 1) == c}
                if len(batched) < 2:
                    continue
                a, b = (simulate(batched[m], profile, link=link, driver_ms=args.driver_ms).summary()
                        for m in ("pp-cb", "specpipe-db"))
                print(f"\n{device}, {link_name}, S = {S}, {c} requests at once: throughput "
                      f"pp-cb {a['throughput_tok_s']:.1f} / specpipe-db {b['throughput_tok_s']:.1f} tok/s "
                      f"({b['throughput_tok_s'] / a['throughput_tok_s']:.2f}×), median TBT {a['tbt_ms_median']:.1f} / "
                      f"{b['tbt_ms_median']:.1f} ms ({a['tbt_ms_median'] / b['tbt_ms_median']:.2f}×)")
                out.append({"device": device, "link": link_name, "stages": S, "concurrency": c,
                            "pp-cb": a, "specpipe-db": b})
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if args.plots:
        draw(traces, Path(args.plots), args.driver_ms, args.steps)


def draw(traces: list[Trace], out: Path, driver_ms: float, steps_json: str | None) -> None:
    """The pipeline timeline of one prompt (the first of the math group, where specpipe's tree
    hits most) for pp, the best tree and specpipe at S = 8 on the H100 profile over InfiniBand;
    the simulated TBT of every request per mode; tokens per step against S."""
    from specpipe.bench import plots

    profile, link = load_profile("h100-80gb"), parse_link("ib-100g")
    s8 = {t.meta["label"]: t for t in traces if t.num_stages == 8 and t.meta["mode"] in ("pp", "tree", "specpipe")}
    def first_math(t: Trace) -> int:  # request ids differ between runs; the prompt is the same
        return min(int(r) for r, g in t.meta["groups"].items() if g == "math_reasoning")

    panels = [(label, t.only(first_math(t))) for label, t in sorted(s8.items())]
    plots.timeline(panels, profile, out / "timeline_qwen_s8_h100.png", link=link, driver_ms=driver_ms,
                   max_ms=400.0)
    plots.tbt_distributions([{"label": label, "tbt_ms": simulate(t, profile, link=link, driver_ms=driver_ms).tbt_ms()}
                             for label, t in sorted(s8.items())], out / "tbt_qwen_s8_h100.png")
    if steps_json:
        runs = json.loads(Path(steps_json).read_text())["runs"]
        plots.tokens_per_step_vs_stages([{"label": r["label"], "stages": r["stages"],
                                          "tokens_per_step": r["all"]["tokens_per_step"]} for r in runs],
                                        out / "tokens_per_step_qwen.png")
    print(f"pictures in {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
