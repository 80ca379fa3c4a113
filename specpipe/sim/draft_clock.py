"""When an asynchronous draft's forward would have finished, for oracle runs (`--draft-async`
under `specpipe bench --oracle`): the clock the simulator's time follows, kept as the run goes.

The oracle's stages take no time, so the engine cannot learn from a wall clock whether the draft
is done. This clock prices each step the oracle pipeline ran as its slowest stage (a cost profile's
stage for the rows each stage computed, plus the driver's time) and each draft forward by the
profile's draft, one forward after another; a forward's proposals are ready at the first step
that begins after it ends. The simulator (sim/events.py) then replays the trace with the same
rule on its own, exact times: a step that used a forward's proposals cannot start before that
forward ended, so an optimistic estimate here costs simulated time, never a wrong number.
"""

from __future__ import annotations

from typing import Sequence

from specpipe.costs.profile import CostProfile


class DraftClock:
    def __init__(self, profile: CostProfile, stage_layers: Sequence[int], pipe, driver_ms: float = 0.3) -> None:
        """`pipe`: the OraclePipeline (its rows_per_step grows by one entry per step)."""
        self.profile, self.layers, self.pipe, self.driver_ms = profile, list(stage_layers), pipe, driver_ms
        self.context = 1
        self._now, self._seen, self._free = 0.0, 0, 0.0

    def now_ms(self) -> float:
        steps = self.pipe.rows_per_step
        last = len(self.layers) - 1
        while self._seen < len(steps):
            rows = steps[self._seen]
            self._now += self.driver_ms + max(
                (self.profile.stage(self.layers[s], s == last, n, self.context) for s, n in enumerate(rows)),
                default=0.0)
            self._seen += 1
        return self._now

    def forward_done_ms(self, rows: int, context: int) -> float:
        self.context = context
        start = max(self.now_ms(), self._free)
        self._free = start + self.profile.draft_forward(rows, self.context)
        return self._free
