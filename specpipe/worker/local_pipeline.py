"""All stages in this process, stepped in exact lock-step: the reference pipeline.

It gives the same step-level behaviour as the multi-process runtime (same messages, same order),
so step counts, hit rates and losslessness can be tested at any S without spawning processes.
"""

from __future__ import annotations

from typing import Optional

from specpipe.messages import Control, Results, Rows
from specpipe.worker.stage_worker import StageWorker


class LocalPipeline:
    concurrent = False  # the stages compute inside collect()

    def __init__(self, workers: list[StageWorker]) -> None:
        self.workers = workers
        for i, w in enumerate(workers):  # rows reach stage i (0-based) i steps after they were sent
            w.slots.horizon = i + 1
        self.num_stages = len(workers)
        self.reported: Optional[list[dict]] = None
        self.steps = 0
        self._inbox: list[list[Rows]] = [[] for _ in workers]  # what each stage computes next

    def submit(self, control: Control, rows: list[Rows]) -> None:
        self._inbox[0] = list(rows)
        self._control = control
        self.steps += 1

    def step(self, control: Control, rows: list[Rows]) -> list[Results]:
        self.submit(control, rows)
        return self.collect()

    def collect(self) -> list[Results]:
        control = self._control
        results: list[Results] = []
        # Last stage first, so that each stage consumes what its predecessor produced last step.
        for s in reversed(range(self.num_stages)):
            out = self.workers[s].step(control, self._inbox[s])
            self._inbox[s] = []
            if s == self.num_stages - 1:
                results = out  # type: ignore[assignment]
            else:
                self._inbox[s + 1] = out  # type: ignore[assignment]
        # As the stage processes do: the report follows the step that asked for it.
        self.reported = [w.report() for w in self.workers] if control.report else None
        return results

    def close(self) -> None:
        self._inbox = [[] for _ in self.workers]
