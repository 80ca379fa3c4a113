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

from specpipe.sim.cli import load_profile, parse_link
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", required=True, help="folder of traces from specpipe bench --oracle --trace-dir")
    ap.add_argument("--driver-ms", type=float, default=0.3, help="the driver's own time per step")
    ap.add_argument("--out", default=None, help="write all numbers as JSON here")
    args = ap.parse_args()
    traces = [Trace.load(p) for p in sorted(Path(args.traces).glob("trace_*.json"))]
    if not traces:
        sys.exit(f"no traces in {args.traces}")
    out = []
    for device, link_name in SETUPS:
        profile, link = load_profile(device), parse_link(link_name)
        for S in sorted({t.num_stages for t in traces}):
            runs = {t.meta["label"]: t for t in traces if t.num_stages == S}
            tbt = {label: group_tbt(t, simulate(t, profile, link=link, driver_ms=args.driver_ms))
                   for label, t in runs.items() if t.meta["mode"] in ("pp", "tree", "specpipe")}
            trees = [label for label in tbt if runs[label].meta["mode"] == "tree"]
            best_tree = min(trees, key=lambda label: tbt[label]["all"]) if trees else None
            specs = sorted(label for label in tbt if runs[label].meta["mode"] == "specpipe")
            print(f"\n### {device}, {link_name}, S = {S} (best tree: {best_tree}; paper: {PAPER.get(S, '-')})\n")
            head = "| group | pp ms | tree ms | " + " | ".join(f"{s} ms | vs pp | vs tree" for s in specs) + " |"
            print(head)
            print("|" + "---|" * (head.count("|") - 1))
            for g in ["all", *sorted(g for g in tbt.get("pp", {}) if g != "all")]:
                pp, tree = tbt["pp"][g], tbt[best_tree][g] if best_tree else None
                cells = [g, f"{pp:.1f}", f"{tree:.1f}" if tree else "-"]
                for s in specs:
                    v = tbt[s][g]
                    cells += [f"{v:.1f}", f"{pp / v:.2f}×", f"{tree / v:.2f}×" if tree else "-"]
                print("| " + " | ".join(cells) + " |")
            out.append({"device": device, "link": link_name, "stages": S, "best_tree": best_tree, "tbt_ms": tbt})
            batched = {t.meta["mode"]: t for t in runs.values() if t.meta["mode"] in ("pp-cb", "specpipe-db")}
            if len(batched) == 2:
                a, b = (simulate(batched[m], profile, link=link, driver_ms=args.driver_ms).summary()
                        for m in ("pp-cb", "specpipe-db"))
                print(f"\nmany requests ({batched['pp-cb'].meta.get('concurrency', '?')} at once): throughput "
                      f"pp-cb {a['throughput_tok_s']:.1f} / specpipe-db {b['throughput_tok_s']:.1f} tok/s "
                      f"({b['throughput_tok_s'] / a['throughput_tok_s']:.2f}×), median TBT {a['tbt_ms_median']:.1f} / "
                      f"{b['tbt_ms_median']:.1f} ms ({a['tbt_ms_median'] / b['tbt_ms_median']:.2f}×)")
                out[-1]["batched"] = {"pp-cb": a, "specpipe-db": b}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
