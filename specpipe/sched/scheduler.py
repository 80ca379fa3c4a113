"""The driver's per-step decisions: which requests run, how many rows each sends, who waits.

Pure Python, no torch. Every step the engine core asks each request's mode what it would send
(a `Want`) and gets back what it may send (a `Grant`):

  must rows  -- rows carrying committed tokens: a prompt chunk, a new root after a miss, the next
                token of plain PP. A request with no must rows granted makes no progress, so single
                rows come first, oldest request first: every decoding request moves each step, and
                a long prompt never stalls the others' decoding (it is prefilled in chunks).
  spec rows  -- speculative tree nodes. They only ever use the slack the single rows leave, of
                the row budget and of the KV pool, shared fairly (water-filling, leftovers rotating
                so that no request is always the one cut): alone, a request gets its full width;
                as the pipeline fills, every tree narrows; when the budget binds, no speculation.
                Prompt chunks and trees split that slack: trees may take up to half of it first
                (running requests keep their width while a prompt streams in, as vLLM schedules
                running requests' draft tokens before new prefills), chunks keep the other half.

Row budget (`step_rows`): rows entering stage 1 per step, which bounds every stage's rows per
step (rows only shrink on the way down). None = no budget (the single-request modes: exactly
the rows the mode asks for).

Fair admission: each request may carry a client tag (a server's API key or client address).
The next request admitted is the oldest waiting one of the client holding the fewest running
slots, so while another client waits no client holds more than its share (round-robin across
clients; with one client, or none, plain FIFO). A tagged client may also hold at most
`max_waiting_per_client` places of the waiting queue (default half of it), so one client cannot
fill the queue and have every other client refused; untagged requests (the Python API) share
the whole queue.

KV: the `BlockManager` holds, per request, blocks for everything sent and not pruned (in each pool:
sliding-window layers have their own, sched/block_manager.py). A request
is admitted (in that order, never overtaken) only while blocks remain above a small watermark; when a
running request's must rows do not fit, the newest running request is preempted (its KV freed at
every stage, recomputed later from its prompt and the tokens it already has) and goes back to the
front of the queue. Requests never share or corrupt each other's KV.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional

from specpipe.sched.block_manager import BlockManager


def per_client_default(max_waiting: int, per_client: Optional[int]) -> int:
    """Waiting places one client may hold: `per_client`, or half the queue (at least 1)."""
    if per_client is None:
        return max(1, max_waiting // 2)
    if not 1 <= per_client <= max_waiting:
        raise ValueError(f"max_waiting_per_client must be in [1, max_waiting={max_waiting}], got {per_client}")
    return per_client


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: the caller should retry later (HTTP 503 in a server)."""


@dataclass(frozen=True)
class Want:
    """What one request would send this step."""

    must: int = 0  # rows carrying committed tokens
    spec: int = 0  # speculative rows at full width
    chunkable: bool = False  # the must rows may be split over steps (a prompt)
    held: int = 0  # KV bound before this step: rows sent for it and not pruned


@dataclass(frozen=True)
class Grant:
    must: int = 0
    spec: int = 0

    @property
    def rows(self) -> int:
        return self.must + self.spec


@dataclass
class StepPlan:
    grants: dict[int, Grant] = field(default_factory=dict)  # running request -> its rows this step
    admitted: list[int] = field(default_factory=list)  # joined the running set this step
    preempted: list[int] = field(default_factory=list)  # KV taken back; waiting again, at the front


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, step_rows: Optional[int] = None,
                 max_waiting: int = 1024, watermark: float = 0.01,
                 max_waiting_per_client: Optional[int] = None) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if max_waiting < 1:
            # No request could ever join: callers that retry on QueueFull would spin forever.
            raise ValueError(f"max_waiting must be at least 1, got {max_waiting}")
        if step_rows is not None and step_rows < max_num_seqs:
            # Every running request must be able to send its one committed row in every step.
            raise ValueError(f"the row budget per step ({step_rows}) must be at least max_num_seqs ({max_num_seqs})")
        self.blocks = blocks
        self.max_num_seqs, self.step_rows, self.max_waiting = max_num_seqs, step_rows, max_waiting
        self.max_waiting_per_client = per_client_default(max_waiting, max_waiting_per_client)
        blocks.keep_free(watermark)
        self.waiting: deque[int] = deque()
        self.client: dict[int, Optional[Hashable]] = {}  # request -> its client tag (None: anonymous)
        self.running: list[int] = []  # admission order: the oldest first, preemption takes the last
        self._turn = 0  # rotates who gets the leftover speculative rows

    @property
    def watermark(self) -> int:
        """Blocks of the main pool that admission leaves free (headroom for running requests)."""
        return self.blocks.watermark

    @property
    def admissible_tokens(self) -> int:
        """The most KV slots a request can ever be admitted with: the pool above the watermark.
        Refuse anything larger up front, or it waits at the head of the queue forever."""
        return self.blocks.admissible_tokens()

    # -- queue ------------------------------------------------------------------------------------
    def add(self, rid: int, client: Optional[Hashable] = None) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting (the limit); try again later")
        if client is not None:
            mine = sum(1 for r in self.waiting if self.client.get(r) == client)
            if mine >= self.max_waiting_per_client:
                raise QueueFull(f"this client already has {mine} requests waiting (its limit, "
                                f"of {self.max_waiting} for everyone); try again later")
        self.waiting.append(rid)
        self.client[rid] = client

    def remove(self, rid: int) -> None:
        """A request finished or was aborted: it leaves the queues and its blocks are free."""
        if rid in self.running:
            self.running.remove(rid)
        elif rid in self.waiting:
            self.waiting.remove(rid)
        self.client.pop(rid, None)
        self.blocks.free(rid)

    def requeue(self, rid: int) -> None:
        """Back to the front of the queue (its KV at the stages failed or was preempted)."""
        if rid in self.running:
            self.running.remove(rid)
        self.blocks.free(rid)
        self.waiting.appendleft(rid)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------------
    def schedule(self, want_of: Callable[[int], Want]) -> StepPlan:
        plan = StepPlan()
        wants = {rid: want_of(rid) for rid in self.running}
        budget = self.step_rows if self.step_rows is not None else float("inf")
        musts: dict[int, int] = {}
        # 1. One committed row for every decoding request: a decode step for everyone.
        budget -= self._grant_musts(wants, musts, budget, chunks=False, plan=plan)
        # 2. Prompt chunks and speculation share the rest. The running requests' trees may take
        #    up to half of it before the chunks (so a long prompt streaming in does not cut every
        #    tree to nothing, as vLLM schedules running requests' draft tokens before new
        #    prefills), and the chunks always keep the other half (so no prompt starves).
        decoding = [w.spec for r, w in wants.items() if r in self.running and not w.chunkable]
        spec_first = min(sum(decoding), budget // 2) if self.step_rows is not None else 0
        used = self._grant_musts(wants, musts, budget - spec_first, chunks=True, plan=plan)
        used += self._admit(plan, want_of, wants, musts, budget - spec_first - used)
        specs = self._share_spec(wants, musts, budget - used)
        for rid in self.running:
            plan.grants[rid] = Grant(musts.get(rid, 0), specs.get(rid, 0))
        return plan

    def _grant_musts(self, wants: dict[int, Want], musts: dict[int, int], budget: float, chunks: bool,
                     plan: StepPlan) -> int:
        """Committed rows of the running requests of one kind (single rows, or prompt chunks),
        oldest first, within `budget`; returns the rows granted."""
        used = 0
        for rid in list(self.running):
            w = wants[rid]
            if rid not in self.running or w.chunkable != chunks or rid in musts:
                continue  # preempted a moment ago, or not this pass
            m = self._must(w, budget - used)
            if m and not self._make_room(rid, w.held + m, plan):
                continue  # it was preempted itself
            musts[rid] = m
            used += m
        return used

    def _must(self, w: Want, budget: float) -> int:
        if not w.must:
            return 0
        if w.chunkable:
            return int(min(w.must, budget))
        return w.must if w.must <= budget else 0  # a root and its rows go together or wait a step

    def _make_room(self, rid: int, tokens: int, plan: StepPlan) -> bool:
        """Reserve KV for `tokens` slots of `rid`, preempting the newest requests if need be.
        False when `rid` itself had to go."""
        while not self.blocks.fits(rid, tokens):
            victim = self.running[-1]
            self.requeue(victim)
            plan.preempted.append(victim)
            plan.grants.pop(victim, None)
            if victim == rid:
                return False
        self.blocks.reserve(rid, tokens)
        return True

    def _admit(self, plan: StepPlan, want_of: Callable[[int], Want], wants: dict[int, Want],
               musts: dict[int, int], budget: float) -> int:
        """Admission in fair order (see `_next_waiting`) while there is room for a request's first
        rows, a row budget left and KV above the watermark (headroom for the running requests'
        growth). Returns the rows granted."""
        while self.waiting and len(self.running) < self.max_num_seqs and budget >= 1:
            rid = self._next_waiting()
            if rid in plan.preempted:
                break  # it comes back next step, with its state rebuilt for recomputation
            w = wants[rid] = want_of(rid)
            m = self._must(w, budget)
            if not m or not self.blocks.fits(rid, w.held + m, above_watermark=True):
                self.blocks.free(rid)  # the cached blocks its lookup reads: looked up again next time
                break
            self.waiting.remove(rid)
            self.running.append(rid)
            self.blocks.reserve(rid, w.held + m)
            musts[rid] = m
            budget -= m
            plan.admitted.append(rid)
        return sum(musts[r] for r in plan.admitted)

    def _next_waiting(self) -> int:
        """The oldest waiting request of the client with the fewest running requests. When it does
        not fit, admission stops rather than let a smaller one pass it: a big request is never
        starved by a stream of small ones."""
        running = Counter(self.client.get(r) for r in self.running)
        best, fewest = self.waiting[0], running[self.client.get(self.waiting[0])]
        for rid in self.waiting:
            if fewest == 0:
                break
            n = running[self.client.get(rid)]
            if n < fewest:
                best, fewest = rid, n
        return best

    def _share_spec(self, wants: dict[int, Want], musts: dict[int, int], slack: float) -> dict[int, int]:
        """Water-fill the slack among the requests that want speculative rows; each grant is also
        limited by the KV blocks left (above the watermark)."""
        asking = [r for r in self.running if r in wants and wants[r].spec > 0]
        if not asking:
            return {}
        self._turn = (self._turn + 1) % len(asking)
        asking = asking[self._turn:] + asking[:self._turn]
        grants: dict[int, int] = {}
        left = list(asking)
        while left and slack >= 1:
            share, extra = divmod(int(min(slack, 1 << 30)), len(left))
            if share == 0:  # fewer rows than requests: one each, in rotated order
                for rid in left[:extra]:
                    grants[rid] = grants.get(rid, 0) + 1
                break
            done = []
            for rid in left:
                g = min(share, wants[rid].spec - grants.get(rid, 0))
                grants[rid] = grants.get(rid, 0) + g
                slack -= g
                if grants[rid] >= wants[rid].spec:
                    done.append(rid)
            if not done:
                break
            left = [r for r in left if r not in done]
        out = {}
        for rid in asking:  # rotated order: the KV left over is shared the same way
            g = grants.get(rid, 0)
            base = wants[rid].held + musts.get(rid, 0)
            g = min(g, max(0, self.blocks.room(rid) - base))  # the most rows whose blocks fit above the watermark
            if g:
                self.blocks.reserve(rid, base + g)
                out[rid] = g
        return out
