"""The element-wise median of several `specpipe profile` runs of the same model on the same device:
on a shared machine one run's point can be a load burst's (a layer at 4 rows dearer than at 8);
the median of three runs keeps each point's typical value. Every table (layer, head, draft,
overhead, per request) is taken point by point; the rest of the file is the first run's, with a
line in its assumptions saying so.

  PYTHONPATH=. python benchmarks/median_profile.py run1.json run2.json run3.json --out profile.json
"""

from __future__ import annotations

import argparse
import statistics

from specpipe.costs.profile import CostProfile


def median_profile(profiles: list[CostProfile]) -> CostProfile:
    first = profiles[0]
    for p in profiles[1:]:
        if (p.rows, p.contexts, p.num_layers) != (first.rows, first.contexts, first.num_layers):
            raise ValueError("the profiles must be of the same model, rows and contexts")

    def med(values):
        if isinstance(values[0], list):
            return [med(list(col)) for col in zip(*values)]
        return statistics.median(values)

    data = first.to_json()
    for key in ("layer_ms", "head_ms", "draft_ms", "overhead_ms", "request_ms", "request_overhead_ms"):
        values = [getattr(p, key) for p in profiles]
        if values[0] not in ([], None):
            data[key] = med(values)
    data["layer_ms_by_stage"] = {k: med([p.layer_ms_by_stage[k] for p in profiles]) for k in first.layer_ms_by_stage}
    data["assumptions"] = [f"the element-wise median of {len(profiles)} runs of this command "
                           "(benchmarks/median_profile.py)", *first.assumptions]
    return CostProfile.from_json(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profiles", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    prof = median_profile([CostProfile.load(p) for p in args.profiles])
    prof.save(args.out)
    print(f"wrote {args.out}: layer ms {[round(x, 2) for x in prof.layer_ms[0]]}, head ms "
          f"{[round(x, 1) for x in prof.head_ms]}, draft ms {[round(x, 1) for x in (prof.draft_ms or [[]])[0]]}")


if __name__ == "__main__":
    main()
