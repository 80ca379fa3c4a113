"""Time simulation of a pipeline from per-step row counts and measured per-row costs (SPEC §8).

The oracle pipeline (oracle_pipeline.py) records how many rows each stage computes at every step
of a real decode loop. This module turns those counts into time with a cost profile measured on
a real device:

  stage s at a step costs  layers_s * layer(n) [+ head(n) on the last stage]   for n rows;
  a step costs             max over stages (they run in parallel) + one link latency;
  specpipe drafts the layer it just sent while the stages compute: the step costs
                           max(stage costs, draft(n_new)) -- drafting overlaps;
  tree mode drafts each round's D layers before the round starts: its measured draft time
                           is added, not overlapped; pp has no draft.

The step is lock-step (every stage starts a step together), which is how the runtime runs.
`layer`, `head` and `draft` are piecewise-linear interpolations of the profile's measurements.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class CostProfile:
    """Measured milliseconds for n rows at a fixed context length, on one device."""

    device: str
    rows: list[int]  # measured row counts, ascending
    layer_ms: list[float]  # one target decoder layer
    head_ms: list[float]  # final norm + LM head of the target
    draft_ms: list[float] = field(default_factory=list)  # one forward of the draft source (0 if none)
    context: int = 0

    def _interp(self, table: Sequence[float], n: int) -> float:
        if n <= 0 or not table:
            return 0.0
        xs = self.rows
        if n <= xs[0]:
            return table[0] * n / xs[0] if xs[0] > 1 else table[0]
        i = bisect.bisect_left(xs, n)
        if i == len(xs):  # extrapolate linearly from the last two points
            i = len(xs) - 1
        x0, x1, y0, y1 = xs[i - 1], xs[i], table[i - 1], table[i]
        return y0 + (y1 - y0) * (n - x0) / (x1 - x0)

    def layer(self, n: int) -> float:
        return self._interp(self.layer_ms, n)

    def head(self, n: int) -> float:
        return self._interp(self.head_ms, n)

    def draft(self, n: int) -> float:
        return self._interp(self.draft_ms, n)


def stage_ms(profile: CostProfile, layers: int, last: bool, n: int) -> float:
    if n == 0:
        return 0.0
    return layers * profile.layer(n) + (profile.head(n) if last else 0.0)


def simulate(rows_per_step: Sequence[Sequence[int]], stage_layers: Sequence[int], profile: CostProfile,
             link_ms: float = 0.0, overlap_draft: bool = False, extra_ms: float = 0.0,
             draft_calls: float = 1.0) -> float:
    """Total milliseconds of one request's decode.

    rows_per_step[t][s]: rows stage s computed at step t. With `overlap_draft` (specpipe) the
    driver drafts the rows that entered stage 1 during the step, in `draft_calls` forwards one
    after another (a block of d layers: d calls). `extra_ms` adds serial time (tree mode's
    measured drafting, specpipe's drafting after a miss).
    """
    S = len(stage_layers)
    total = extra_ms
    for counts in rows_per_step:
        step = max(stage_ms(profile, stage_layers[s], s == S - 1, counts[s]) for s in range(S))
        if overlap_draft:
            calls = max(1.0, draft_calls)
            step = max(step, calls * profile.draft(max(1, round(counts[0] / calls))))
        total += step + link_ms
    return total
