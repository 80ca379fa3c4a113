"""Which rows each stage holds at each step, from the messages the driver sends alone.

At step k stage s computes what stage s - 1 computed at step k - 1 (stage 1: what the driver sent
at step k), minus the rows that this step's pruning drops and the requests it releases. Both the
oracle stages (oracle_pipeline.py) and the step tracer (trace.py) follow the rows this way, so a
recorded trace says how many rows every stage computed without asking the stages.
"""

from __future__ import annotations

from collections import deque

from specpipe.messages import Control, Rows


class InFlight:
    def __init__(self, num_stages: int) -> None:
        self._stages: deque[list[Rows]] = deque([[] for _ in range(num_stages)], maxlen=num_stages)
        self.dropped: set[tuple[int, int]] = set()  # (request, node): pruned, never committed
        self._released: set[int] = set()

    def step(self, control: Control, incoming: list[Rows]) -> list[list[Rows]]:
        """Advance one step; returns the rows each stage computes in it. The last stage's leave
        the pipeline (their results go to the driver)."""
        for p in control.prune:
            self.dropped.update((p.request_id, n) for n in p.drop)
        self._released.update(control.release)
        self._stages.appendleft(list(incoming))  # what stage s held is at stage s + 1 now
        for s, batch in enumerate(self._stages):
            kept = []
            for rows in batch:
                if rows.request_id in self._released:
                    continue  # a stage drops the rows of a released request
                rid = rows.request_id
                keep = [i for i, n in enumerate(rows.node_ids) if (rid, n) not in self.dropped]
                kept.append(rows.select(keep) if len(keep) < len(rows) else rows)
            self._stages[s] = [r for r in kept if len(r)]
        computed = [list(batch) for batch in self._stages]
        self._stages[-1] = []  # they leave the pipeline
        return computed


def row_counts(computed: list[list[Rows]]) -> list[int]:
    return [sum(len(r) for r in batch) for batch in computed]
