"""A sparse model's cost profile at its full expert count, from one measured with fewer experts
of the same shape (benchmarks/moe_row_cost.py `NAME:eN`, where the whole layer does not fit this
machine's memory): an extrapolation by the bytes a step reads, stated as such in the profile.

W rows of a random router read about D(W) = E (1 - (1 - k/E)^W) distinct experts of E. With N < E
experts the same rows read fewer (the measured experts_read r(W)); every row still runs k experts,
so the arithmetic is the same and what differs is the experts streamed from memory. Each missing
expert is priced at the one-row step's streaming pace (the bytes a one-row step reads over its ms):

    ms_E(W) = ms_N(W) + (D(W) - r(W)) x expert_bytes / (bytes_read(1) / ms_N(1))

  PYTHONPATH=. python benchmarks/moe_full_experts.py --measured benchmarks/results/moe_row_cost_epyc.json \
      --preset deepseek-v3:e64 --experts 256 --profile benchmarks/results/profile_synthetic_deepseek-v3_e64_moe.json \
      --out benchmarks/results/profile_synthetic_deepseek-v3_moe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specpipe.costs import synthetic  # noqa: E402
from specpipe.costs.profile import CostProfile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", required=True, help="moe_row_cost.py's JSON")
    ap.add_argument("--preset", required=True, help="the NAME:eN it measured")
    ap.add_argument("--experts", type=int, required=True, help="the full expert count")
    ap.add_argument("--profile", required=True, help="the profile moe_row_cost.py wrote for that preset")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = next(r for r in json.loads(Path(args.measured).read_text())["results"] if r["preset"] == args.preset)
    prof = CostProfile.load(args.profile)
    rows = result["rows"]["random"]
    k, expert = result["top_k"], result["expert_bytes"]
    pace = rows[0]["bytes_read"] / rows[0]["ms"]  # bytes a ms, one row
    E = args.experts
    full = [E * (1 - (1 - k / E) ** r["rows"]) for r in rows]
    layer = [r["ms"] + max(0.0, d - r["experts_read"]) * expert / pace for r, d in zip(rows, full)]
    base = args.preset.partition(":e")[0]
    _, cfg = synthetic.model_config(base)
    ckpt = synthetic.SyntheticCheckpoint(base, cfg)
    wb = synthetic.weight_bytes(ckpt, ckpt.nbytes)
    model = {**prof.model, "name": f"synthetic-{base}", "num_experts": E, "layer_bytes_mean": wb["layer_bytes_mean"],
             "total_bytes": wb["total_bytes"]}
    note = (f"EXTRAPOLATED to {E} experts from {result['num_experts']} measured (benchmarks/moe_full_experts.py): "
            f"each expert the full layer's rows would read beyond the measured ones priced at the one-row "
            f"step's pace, {pace / 1e6:.2f} GB/s, {expert / 1e6:.1f} MB an expert; experts_read is "
            f"E (1 - (1 - k/E)^W)")
    out = replace(prof, layer_ms=[layer], experts_read=full, model=model, assumptions=[*prof.assumptions, note])
    out.save(args.out)
    for r, d, ms in zip(rows, full, layer):
        print(f"{r['rows']:3d} rows: measured {r['ms']:8.1f} ms ({r['experts_read']:5.1f} of {result['num_experts']}) "
              f"-> {ms:8.1f} ms ({d:5.1f} of {E})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
