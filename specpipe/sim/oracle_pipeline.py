"""A step-exact stand-in for the stages when the target's output is already known.

For greedy decoding the committed sequence of a prompt is fixed (it is what `pp` produces), and
verification only ever reads the target's token at nodes on that committed path. So a pipeline
that delays rows by S - 1 steps, drops pruned rows exactly as the stages do, and answers each
row with the next committed token (any token for off-path rows, which are pruned before they
could become the root) reproduces the real pipeline's step counts and hit rates exactly, for any
S, without computing the target. The driver, the tree and the draft source run unchanged.

It also records, per step, how many rows each stage computed (the step tracer, sim/trace.py,
records the same and more for the time simulator, sim/events.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

from specpipe.messages import NO_PARENT, Control, Results, Rows
from specpipe.sim.inflight import InFlight, row_counts

OFF_PATH = -1  # target token reported for rows that are not on the committed path


class OraclePipeline:
    concurrent = False

    def __init__(self, num_stages: int, sequence: Sequence[int] | Callable[[int], Sequence[int]]) -> None:
        """`sequence`: prompt + greedy output of the target, the tokens every mode must commit;
        for many requests, a function from the request id the stages see (the pid) to its own."""
        self.num_stages = num_stages
        self._sequence = sequence if callable(sequence) else (lambda _rid, seq=list(sequence): seq)
        self._inflight = InFlight(num_stages)
        self._on_path: set[tuple[int, int]] = set()  # (request, node)
        self._control, self._incoming = Control(), []
        self.reported: list[dict] | None = None  # no real stages: reports are empty
        self.steps = 0
        self.rows_per_step: list[list[int]] = []  # step -> rows computed at each stage

    def submit(self, control: Control, rows: list[Rows]) -> None:
        self._control, self._incoming = control, list(rows)
        self.steps += 1

    def collect(self) -> list[Results]:
        computed = self._inflight.step(self._control, self._incoming)
        self.rows_per_step.append(row_counts(computed))
        self.reported = [] if self._control.report else None
        return [self._answer(rows) for rows in computed[-1]]

    def step(self, control: Control, rows: list[Rows]) -> list[Results]:
        self.submit(control, rows)
        return self.collect()

    def _answer(self, rows: Rows) -> Results:
        tokens, node_ids = [], []
        rid, seq = rows.request_id, self._sequence(rows.request_id)
        data = rows.data.tolist()
        picked = rows.head_rows if rows.head_rows is not None else range(len(rows))
        for i in range(len(rows)):
            n, parent, pos = rows.node_ids[i], rows.parent_ids[i], rows.positions[i]
            if (parent == NO_PARENT or (rid, parent) in self._on_path) and pos < len(seq) and data[i] == seq[pos]:
                self._on_path.add((rid, n))
        for i in picked:
            n, pos = rows.node_ids[i], rows.positions[i]
            ok = (rid, n) in self._on_path and pos + 1 < len(seq)
            node_ids.append(n)
            tokens.append(seq[pos + 1] if ok else OFF_PATH)
        return Results(rows.request_id, node_ids, tokens)

    def close(self) -> None:
        pass
