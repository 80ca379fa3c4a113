"""A step-by-step record of a run: the input of the event simulator (sim/events.py) and of the
pipeline timeline pictures (`specpipe bench --trace FILE`).

Per pipeline step it holds what the time of that step depends on, and nothing about the device:

  rows         rows each stage computed (followed from the driver's messages, sim/inflight.py)
  head_rows    the last stage's rows whose target token was wanted: the LM head computes only
               those (a prompt chunk wants at most its last row); None (traces written before
               this field) = every row
  context      the longest context among the requests in the pipeline (attention reads it)
  contexts     request id -> the context its rows attend to (a prompt chunk: the tokens before
               it; tree nodes: the committed tokens), for requests that sent rows this step
  serial       the draft forwards the driver made before sending this step, one row count per
               forward (after the previous step's verification: new roots, tree rounds)
  overlapped   the draft forwards made while the stages computed this step
  async_started, async_used
               --draft-async: the forwards started before this step was sent (rows each), off the
               critical path, and how many of the earlier forwards' proposals this step used
               (forwards are used in the order they started)
  tokens       request id -> tokens it had committed when the step ended
  work         per stage, what its rows were: [request id, tree depth, rows, rows pruned later]
               (depth: below the request's root at this step, 0 for committed tokens, prompt
               chunks and new roots); for the pipeline timeline pictures
  hits/misses  verifications this step
  t_submit, t_collect, t_end
               wall-clock seconds since the trace began (real runs; the oracle's are meaningless)
  stage_spans  per stage, [start, end] of its compute in this step (seconds since the trace
               began, as the stage measured them; [] when it computed nothing). Real runs only,
               from the stages' reports (the bench asks for one after every request). Stage and
               driver clocks agree on one machine; across machines the spans are shifted by the
               hosts' clock offsets.

A trace is written as JSON: {"format": ..., "meta": {...}, "requests": {...}, "steps": [...]}.
meta["arrivals"] == "timed" marks an open-loop run (requests arrive on their own clock, e.g. a
load test); otherwise a request is taken to arrive when the engine added it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from specpipe.costs.profile import read_json
from specpipe.engine.async_drafting import ASYNC
from specpipe.engine.modes.base import DURING
from specpipe.engine.observer import StepObserver
from specpipe.messages import Control, Rows
from specpipe.sim.inflight import InFlight, row_counts

FORMAT = "specpipe-trace/1"


@dataclass
class StepRecord:
    rows: list[int]
    context: int
    serial: list[int] = field(default_factory=list)
    overlapped: list[int] = field(default_factory=list)
    async_started: list[int] = field(default_factory=list)
    async_used: int = 0
    tokens: dict[int, int] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    sent: dict[int, int] = field(default_factory=dict)  # request id -> rows it sent into stage 1
    work: list[list[list[int]]] = field(default_factory=list)  # [stage] -> [[request, depth, rows, pruned]]
    contexts: dict[int, int] = field(default_factory=dict)
    t_submit: float = 0.0
    t_collect: float = 0.0
    t_end: float = 0.0
    head_rows: Optional[int] = None
    stage_spans: list[list[float]] = field(default_factory=list)


@dataclass
class Trace:
    meta: dict[str, Any]
    # id -> arrival (s, wall clock), prompt_tokens, step (the first step it could be in)
    requests: dict[int, dict[str, Any]] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return int(self.meta["stages"])

    def only(self, request_id: int) -> "Trace":
        """The steps in which this request alone was in the pipeline (one prompt of a run that
        served its requests one after another)."""
        steps = [s for s in self.steps if set(s.tokens) == {request_id}]
        return Trace(self.meta, {request_id: self.requests[request_id]}, steps)

    def save(self, path: str | Path) -> None:
        data = {"format": FORMAT, "meta": self.meta, "requests": self.requests,
                "steps": [asdict(s) for s in self.steps]}
        Path(path).write_text(json.dumps(data) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        data = read_json(path, "trace")
        if data.get("format") != FORMAT:
            raise ValueError(f"{path} is not a SpecPipe trace (format {data.get('format')!r})")
        steps = []
        for s in data["steps"]:
            s["tokens"] = {int(k): v for k, v in s["tokens"].items()}
            s["sent"] = {int(k): v for k, v in s.get("sent", {}).items()}
            s["contexts"] = {int(k): v for k, v in s.get("contexts", {}).items()}
            steps.append(StepRecord(**s))
        return cls(data["meta"], {int(k): v for k, v in data["requests"].items()}, steps)


class StepTracer(StepObserver):
    """Attached to an EngineCore (`core.observer = StepTracer(...)`), which calls it at each phase
    of a step. Costs a few dictionary updates per step."""

    def __init__(self, num_stages: int, meta: Optional[dict[str, Any]] = None) -> None:
        self.trace = Trace({"stages": num_stages, **(meta or {})})
        self._inflight = InFlight(num_stages)
        self._t0 = time.perf_counter()
        self._serial: list[int] = []  # draft forwards since the last submit
        self._async_started: list[int] = []  # --draft-async forwards started since the last submit
        self._async_used = 0  # and earlier ones whose proposals were used
        self._step: Optional[StepRecord] = None
        self._checked: dict[int, tuple[int, int]] = {}  # request id -> (verifications, hits) at submit
        self._nodes: list[list[list[tuple[int, int, int]]]] = []  # [step][stage] -> (pid, node, depth)
        self._pid_request: dict[int, int] = {}
        self._by_pipe_step: dict[int, StepRecord] = {}  # the pipeline's step number -> its record

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def added(self, req) -> None:
        """`step`: the first step it could be in (a closed-loop run adds a request when the
        engine is ready for it; the simulator starts it there, whatever the wall clock said)."""
        self.trace.requests[req.request_id] = {"arrival": req.arrival - self._t0, "prompt_tokens": len(req.prompt_ids),
                                               "step": len(self.trace.steps)}

    def drafted(self, phase: str, rows_per_forward: int) -> None:
        if phase == ASYNC:
            self._async_started.append(rows_per_forward)
        elif phase == DURING and self._step is not None:
            self._step.overlapped.append(rows_per_forward)
        else:
            self._serial.append(rows_per_forward)

    def draft_ready(self) -> None:
        self._async_used += 1

    def submitted(self, pipe_step: int, control: Control, rows: list[Rows], running: list) -> None:
        """Every request in this step: its pid, the position of its last committed token (the
        root, for depths) and its verification counters before this step (for its hits)."""
        for st in running:
            self._pid_request[st.pid] = st.req.request_id
        self._roots = {st.pid: st.req.context_len - 1 for st in running}
        self._checked = {st.req.request_id: (st.req.stats.verifications, st.req.stats.hits) for st in running}
        computed = self._inflight.step(control, rows)
        self._nodes.append([[(r.request_id, n, self._depth(r.request_id, p)) for r in batch
                             for n, p in zip(r.node_ids, r.positions)] for batch in computed])
        contexts = {self._pid_request.get(r.request_id, r.request_id): min(r.positions) for r in rows if len(r)}
        context = max(contexts.values(), default=max((pos + 1 for pos in self._roots.values()), default=0))
        self._step = StepRecord(row_counts(computed), context, serial=self._serial, t_submit=self.now(),
                                head_rows=sum(len(r) if r.head_rows is None else len(r.head_rows) for r in computed[-1]),
                                sent={self._pid_request.get(r.request_id, r.request_id): len(r) for r in rows},
                                contexts=contexts)
        self._step.async_started, self._step.async_used = self._async_started, self._async_used
        self._serial, self._async_started, self._async_used = [], [], 0
        self._by_pipe_step[pipe_step] = self._step

    def collected(self, stage_spans: list[list[tuple[int, int, int]]]) -> None:
        """The stages' compute spans from a report (per stage, (pipeline step, start, end ns)) go
        to the steps they timed, which may be earlier ones."""
        self._step.t_collect = self.now()
        S = self.trace.num_stages
        for s, stage in enumerate(stage_spans):
            for step, start, end in stage:
                record = self._by_pipe_step.get(step)
                if record is not None:
                    if not record.stage_spans:
                        record.stage_spans = [[] for _ in range(S)]
                    record.stage_spans[s] = [start / 1e9 - self._t0, end / 1e9 - self._t0]

    def _depth(self, pid: int, position: int) -> int:
        """Depth below the request's root at this step (0 once the root has reached it)."""
        root = self._roots.get(pid)
        return max(0, position - root) if root is not None else 0

    def verified(self, requests: list) -> None:
        """The step's requests after verification: tokens they hold, hits and misses of the step."""
        step = self._step
        step.tokens = {r.request_id: len(r.output_ids) for r in requests}
        before = [self._checked.get(r.request_id, (0, 0)) for r in requests]
        step.hits = sum(r.stats.hits for r in requests) - sum(h for _, h in before)
        step.misses = sum(r.stats.verifications for r in requests) - sum(v for v, _ in before) - step.hits
        step.t_end = self.now()
        self.trace.steps.append(step)
        self._step = None

    def finish(self) -> Trace:
        """The trace, with each step's work filled in: which rows were pruned later is known
        only now."""
        dropped = self._inflight.dropped
        for step, stages in zip(self.trace.steps, self._nodes):
            step.work = []
            for nodes in stages:
                groups: dict[tuple[int, int], list[int]] = {}
                for pid, node, depth in nodes:
                    g = groups.setdefault((self._pid_request.get(pid, pid), depth), [0, 0])
                    g[0] += 1
                    g[1] += (pid, node) in dropped
                step.work.append([[rid, depth, n, wasted] for (rid, depth), (n, wasted) in sorted(groups.items())])
        return self.trace
