"""Discrete-event simulation of an S-stage pipeline replaying a recorded trace (docs/design.md §10).

The trace (sim/trace.py) says what every step computed; a cost profile (costs/profile.py) says how
long that takes on one device; a link says how long messages travel. The simulator follows the
runtime's own rules (worker/stage_main.py, engine/core.py), event by event:

  submit(k)      = collect(k - 1) + driver + the draft forwards made before sending (serial)
  stage s, step k starts when three things are there: the step's control message from the driver,
                 its input (stage 1: the driver's rows; stage s > 1: what stage s - 1 computed at
                 step k - 1, sent when that finished) and its own step k - 1 being done;
                 it computes its rows (layers x layer cost, + LM head on the last stage for the
                 rows whose token is wanted)
  collect(k)     = max(last stage's results arriving at the driver,
                      submit(k) + the draft forwards made while the stages compute)
  --draft-async  the forwards started at step k run one after another on the draft's own timeline
                 from collect(k - 1) on, off the critical path; but a step that uses a forward's
                 proposals cannot be sent before that forward ended: submit(k) >= its end

So, unlike a lock-step model (every stage starting each step together, the step as long as its
slowest stage: what SpecPipe's first time estimates used), a stage that finished early does not
wait for the slowest stage of the last step, only for its own input; and the driver's and the
draft's own time are on the critical path where they really are. Tokens committed at step k are stamped collect(k).

Per-component busy time says what the bottleneck was: the busiest stage, the draft (forwards while
the stages compute plus those before sending), or the driver.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional, Sequence

from specpipe.costs.profile import NO_LINK, CostProfile, Link
from specpipe.loader.partition import partition_layers
from specpipe.sim.trace import Trace

TOKEN_BYTES = 8  # one token id on the wire into stage 1
CONTROL_BYTES = 64  # a control message or a result: a few integers


@dataclass
class SimResult:
    steps: int
    total_ms: float
    tokens: int
    token_times: dict[int, list[float]]  # request id -> ms at which each of its tokens was committed
    arrival_ms: dict[int, float]
    busy_ms: dict[str, float]  # "stage 1".."stage S", "draft", "driver" -> busy time
    spans: list[list[tuple[float, float]]] = field(default_factory=list)  # [step][stage] -> (start, end)
    collect_ms: list[float] = field(default_factory=list)

    def tbt_ms(self) -> list[float]:
        """Per request: (last token - first token) / (tokens - 1)."""
        return [(t[-1] - t[0]) / (len(t) - 1) for t in self.token_times.values() if len(t) > 1]

    def ttft_ms(self) -> list[float]:
        return [t[0] - self.arrival_ms.get(r, 0.0) for r, t in self.token_times.items() if t]

    def throughput_tok_s(self) -> float:
        first = min(self.arrival_ms.values(), default=0.0)
        last = max((t[-1] for t in self.token_times.values() if t), default=first)
        return self.tokens / (last - first) * 1e3 if last > first else 0.0

    def bottleneck(self) -> Optional[str]:
        return max(self.busy_ms, key=self.busy_ms.get) if self.busy_ms else None

    def summary(self) -> dict:
        tbt = self.tbt_ms()
        return {"steps": self.steps, "tokens": self.tokens, "total_ms": self.total_ms,
                "tbt_ms_median": statistics.median(tbt) if tbt else None,
                "tbt_ms_mean": statistics.mean(tbt) if tbt else None,
                "ttft_ms_median": statistics.median(self.ttft_ms()) if self.token_times else None,
                "throughput_tok_s": self.throughput_tok_s(),
                "utilization": {k: v / self.total_ms if self.total_ms else 0.0 for k, v in self.busy_ms.items()},
                "bottleneck": self.bottleneck()}


def default_layers(profile: CostProfile, num_stages: int) -> list[int]:
    if not profile.num_layers:
        raise ValueError("the profile does not say how many layers the model has; pass the stage layer counts")
    return [p.end - p.start for p in partition_layers(profile.num_layers, num_stages)]


def simulate(trace: Trace, profile: CostProfile, stage_layers: Optional[Sequence[int]] = None,
             link: Link = NO_LINK, driver_ms: float = 0.0, draft_cost: bool = True,
             keep_spans: bool = False) -> SimResult:
    """Replay `trace` on `profile` devices, one per stage, joined by `link`. `driver_ms`: the
    driver's own time per step (schedule, verify, messages). `draft_cost`: the trace's draft
    forwards cost the profile's draft forward (False for a source that costs ~nothing, n-gram)."""
    S = trace.num_stages
    if stage_layers is None:
        # The counts the traced run used, where it ran the profile's model; else the even split.
        traced = trace.meta.get("stage_layers")
        stage_layers = traced if traced and sum(traced) == profile.num_layers else default_layers(profile, S)
    layers = list(stage_layers)
    if len(layers) != S:
        raise ValueError(f"the trace has {S} stages but {len(layers)} stage layer counts were given")

    def draft(forwards: Sequence[int], context: int) -> float:
        return sum(profile.draft_forward(n, context) for n in forwards) if draft_cost else 0.0

    timed = trace.meta.get("arrivals") == "timed"
    arrival = {rid: r["arrival"] * 1e3 for rid, r in trace.requests.items()} if timed else {}
    added_at: dict[int, list[int]] = {}  # step -> requests added just before it (closed loop)
    for rid, r in trace.requests.items():
        added_at.setdefault(r.get("step", 0), []).append(rid)
    seen: set[int] = set()
    finish = [0.0] * S  # when each stage finished its previous step
    worked: list[Optional[float]] = [None] * S  # ... its previous step with rows
    collect = 0.0
    busy = {f"stage {s + 1}": 0.0 for s in range(S)} | {"draft": 0.0, "driver": 0.0}
    token_times: dict[int, list[float]] = {}
    last_tokens: dict[int, int] = {}
    spans, collects = [], []
    draft_free, async_ends = 0.0, []  # --draft-async: the draft's own timeline, its forwards' ends in order
    for k, step in enumerate(trace.steps):
        for rid in added_at.get(k, ()) if not timed else ():
            arrival[rid] = collect  # the engine was ready for it when the last step ended
        serial = draft(step.serial, step.context)
        submit = collect + driver_ms + serial
        if step.async_used:  # it uses proposals of forwards started earlier: they must have ended
            used, async_ends = async_ends[:step.async_used], async_ends[step.async_used:]
            submit = max(submit, *used)
        for rows in step.async_started:  # started now, after the proposals above were used
            draft_free = max(draft_free, collect + driver_ms) + draft([rows], step.context)
            async_ends.append(draft_free)
            busy["draft"] += draft([rows], step.context)
        new = [rid for rid in step.sent if rid not in seen]
        if new:  # a request's first rows cannot leave before it arrives
            submit = max(submit, max(arrival.get(rid, 0.0) for rid in new))
            seen.update(new)
        busy["driver"] += driver_ms
        busy["draft"] += serial
        control_at = submit + link.transfer_ms(CONTROL_BYTES)
        prev_out = submit + link.transfer_ms(CONTROL_BYTES + TOKEN_BYTES * step.rows[0])
        row_span, before = [], list(finish)
        for s in range(S):
            if s > 0:  # input: what stage s - 1 computed last step, sent when it finished
                prev_out = before[s - 1] + link.transfer_ms(CONTROL_BYTES + profile.row_bytes * step.rows[s])
            start = max(control_at, prev_out, before[s])
            cost = profile.stage(layers[s], s == S - 1, step.rows[s], *_contexts(trace, k, s), head=step.head_rows)
            if cost and worked[s] is not None:  # after an idle gap what it left in the caches has faded
                cost += profile.idle(layers[s], s == S - 1, start - worked[s])
            if cost:
                worked[s] = start + cost
            row_span.append((start, start + cost))
            busy[f"stage {s + 1}"] += cost
            finish[s] = start + cost
        overlapped = draft(step.overlapped, step.context)
        busy["draft"] += overlapped
        collect = max(finish[S - 1] + link.transfer_ms(CONTROL_BYTES), submit + overlapped)
        collects.append(collect)
        if keep_spans:
            spans.append(row_span)
        for rid, n in step.tokens.items():
            new = n - last_tokens.get(rid, 0)
            if new > 0:
                token_times.setdefault(rid, []).extend([collect] * new)
                last_tokens[rid] = n
    tokens = sum(len(t) for t in token_times.values())
    return SimResult(len(trace.steps), collect, tokens, token_times, arrival, busy, spans, collects)


def _contexts(trace: Trace, k: int, s: int) -> tuple[float, list[int]]:
    """The context stage s's rows at step k attend to, as the profile counts it (a row that
    attends to c tokens and itself is at context c), and the contexts of the requests beyond the
    first. A layer's attention costs each row its own context, so the rows are costed at their
    mean: a chain of n rows (a prompt chunk) after c tokens at c + (n - 1) / 2, a tree row at
    depth d at c + d - 1 — not every row at the batch's longest context. The rows stage s
    computes at step k entered stage 1 at step k - s: their contexts are that step's."""
    step = trace.steps[k]
    sent = trace.steps[max(k - s, 0)]
    groups = step.work[s] if step.work else []
    if not groups:
        return sent.context, []
    ctx = {g[0]: sent.contexts.get(g[0], sent.context) for g in groups}
    rows = sum(g[2] for g in groups)
    spread = sum(n * (ctx[r] + ((n - 1) / 2 if depth == 0 else depth - 1)) for r, depth, n, *_ in groups)
    mean = spread / rows if rows else max(ctx.values())
    return mean, sorted(ctx.values(), reverse=True)[1:]


def has_stage_spans(trace: Trace) -> bool:
    """Whether every step in which a stage computed has that stage's measured span."""
    return bool(trace.steps) and all(
        s.stage_spans and all(s.stage_spans[k] for k, rows in enumerate(s.rows) if rows > 0)
        for s in trace.steps if any(s.rows))


def measured(trace: Trace, origin_s: float = 0.0) -> SimResult:
    """The same figures from the trace's own wall clock (a real run): tokens stamped when their
    step's results were collected; stage spans as the stages measured them (when the trace has
    them). Times in ms after `origin_s` (seconds on the trace's clock)."""
    def ms(t: float) -> float:
        return (t - origin_s) * 1e3

    token_times: dict[int, list[float]] = {}
    last_tokens: dict[int, int] = {}
    spans = []
    for step in trace.steps:
        for rid, n in step.tokens.items():
            k = n - last_tokens.get(rid, 0)
            if k > 0:
                token_times.setdefault(rid, []).extend([ms(step.t_collect)] * k)
                last_tokens[rid] = n
        spans.append([(ms(sp[0]), ms(sp[1])) if sp else (ms(step.t_submit),) * 2
                      for sp in step.stage_spans or [[]] * trace.num_stages])
    arrival = {rid: ms(r["arrival"]) for rid, r in trace.requests.items()}
    total = ms(trace.steps[-1].t_end) if trace.steps else 0.0
    return SimResult(len(trace.steps), total, sum(len(t) for t in token_times.values()), token_times, arrival, {},
                     spans, collect_ms=[ms(s.t_collect) for s in trace.steps])
