"""The engine core: one step loop for every mode and every number of requests (docs/design.md §5).

    add_request / abort                       (any time between steps)
    step():  schedule  ->  draft (tree mode)  ->  send Control + Rows of every request  ->
             draft for every request while the stages compute  ->  collect  ->
             route results by (request, node)  ->  verify  ->  draft new roots  ->  emit tokens

No mode owns the pipeline: each request is a small state machine (engine/modes/) that says what
it wants to send and what to do with its results, and the scheduler (sched/) decides who sends
how many rows. Releases, aborts, preemptions and stage statistics ride on the next ordinary step's
Control, so no step is ever spent (and no result swallowed) outside this loop.

Glossary:
  request id  -- the caller's id for a request, stable for its whole life.
  pid         -- pipeline id: the id the stages know it by. Fresh each time the request enters
                 the pipeline (after a preemption it is recomputed under a new pid), so rows of an
                 earlier incarnation still in flight can never be taken for the new one's.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional

from specpipe.config import BUDGETED_MODES, SPECULATIVE_MODES, ConfigError
from specpipe.engine.async_drafting import AsyncDrafting
from specpipe.engine.modes.base import AFTER, BEFORE, DURING, ModeState
from specpipe.engine.modes.draft_progress import CHECK_STATE
from specpipe.engine.modes.rounds import RoundsState
from specpipe.engine.modes.specpipe import AUTO, AutoPlan, SpecPipeState, block_rows
from specpipe.engine.observer import NO_OBSERVER, StepObserver
from specpipe.engine.prefix_sharing import PrefixSharing
from specpipe.penalties import PenaltyContext, paths_tensor
from specpipe.messages import Admit, Control, Pipeline, Prune, Rows, Share, StagesRestarted
from specpipe.request import Request
from specpipe.sched.block_manager import BlockManager, window_need
from specpipe.sched.prefix_cache import PrefixCache
from specpipe.sched.scheduler import QueueFull, Scheduler, Want
from specpipe.spec_decode.async_draft import AsyncDraft
from specpipe.spec_decode.planner import HitProfile, StepCost
from specpipe.spec_decode.sources import TokenSource

if TYPE_CHECKING:
    from specpipe.costs.profile import CostProfile

MAX_STAGE_KV_FAILURES = 3  # a request a stage could not hold this often ends with an error
MAX_DRAFT_RESTARTS = 3  # a request whose draft lost its KV this often goes on unspeculated
DRAFT_BOUND_WAIT_S = 0.001  # results waiting less than this after drafting: the draft was the bottleneck


def spec_reserve(mode: str, width: int, depth: int, num_stages: int, layers: int | str = 1) -> int:
    """The most speculative nodes (plus a new root) one request can hold at a stage at once."""
    if mode not in SPECULATIVE_MODES:
        return 0
    if mode == "tree":
        return width * depth + 1
    return block_rows(layers, width) * (num_stages + 1) + 1  # a block per step, for S + 1 steps


class EngineCore:
    def __init__(self, pipeline: Pipeline, mode: str, source: Optional[TokenSource] = None, *,
                 width: int = 8, depth: int = 4, layers: int | str = 1, kv_blocks: int = 1 << 16, block_size: int = 16,
                 max_num_seqs: int = 32, step_rows: Optional[int] = 64, max_waiting: int = 1024,
                 max_waiting_per_client: Optional[int] = None, pids: Optional[Iterator[int]] = None,
                 cost_profile: Optional["CostProfile"] = None, window_pool: Optional[tuple[int, int]] = None,
                 stage_layers: Optional[list[int]] = None, prefix_cache: Optional[PrefixCache] = None) -> None:
        """`cost_profile`: what `--layers-per-step auto` prices rows and draft forwards with, for
        stages of `stage_layers` layers each (default: the even split).
        `window_pool`: (window, blocks) of the stages' sliding-window KV pool, when they keep one.
        `prefix_cache`: reuse the KV of full blocks of committed tokens across requests, indexed
        here (one for every core of the same stages; ignored with a sliding-window pool, which
        forgets them: `prefix` is None where it is off)."""
        if mode in SPECULATIVE_MODES and source is None:
            raise ConfigError(f"mode {mode} needs a speculative source")
        self.pipe, self.mode, self.source = pipeline, mode, source
        self.width, self.depth, self.layers = width, depth, layers
        # --draft-async (an AsyncDraft source): specpipe modes draft off the critical path; tree
        # mode drafts its rounds before sending, through the same worker (engine/async_drafting.py)
        self.drafter = AsyncDrafting(source) if isinstance(source, AsyncDraft) and mode != "tree" else None
        self.auto_plan: Optional[AutoPlan] = None  # shared by every request in `--layers-per-step auto`
        if layers == AUTO and mode in SPECULATIVE_MODES and mode != "tree":
            draft_gates = source.runs_model and self.drafter is None  # (an async draft's forwards never gate a step)
            cost = (StepCost(cost_profile, pipeline.num_stages, draft_gates, stage_layers)
                    if cost_profile is not None else None)
            self.auto_plan = AutoPlan(HitProfile(width), pipeline.num_stages, cost)
        self.step_rows = step_rows if mode in BUDGETED_MODES else None
        window, window_blocks = window_pool or (None, 0)
        caching = prefix_cache is not None and not window_blocks
        blocks = BlockManager(kv_blocks, block_size, window, window_blocks, cache=prefix_cache if caching else None)
        self.scheduler = Scheduler(blocks, max_num_seqs, self.step_rows, max_waiting,
                                   max_waiting_per_client=max_waiting_per_client)
        self.prefix = PrefixSharing(blocks, mode, pipeline.num_stages) if caching else None
        self.requests: dict[int, Request] = {}
        self.states: dict[int, ModeState] = {}  # request id -> its current state machine
        self._pids = pids if pids is not None else itertools.count()
        self._release: list[int] = []  # pids whose KV every stage frees at the next step
        self._share: list[Share] = []  # blocks of released pids that join the prefix cache with it
        self._failures: dict[int, int] = {}
        self._ended: list[Request] = []
        self._draft_lost: list[int] = []  # request ids whose draft ran out of KV, waiting for room there
        self._report = False
        self.stage_stats: Optional[list[dict]] = None  # the stages' last report (cumulative)
        self.steps = 0
        self.draft_bound_steps = 0
        self.stage_restarts = 0  # times the stages were started again under this core
        self.observer: StepObserver = NO_OBSERVER  # e.g. sim.trace.StepTracer, to record every step

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id} is already in use")
        if not req.prompt_ids:
            raise ValueError(f"request {req.request_id}: the prompt is empty")
        need = len(req.prompt_ids) + req.sampling.max_tokens + self.spec_reserve()
        # What admission can grant, not the whole pool: admission keeps a watermark free, so a
        # request between the two would wait at the head of the queue forever (and all behind it).
        pool = self.scheduler.admissible_tokens
        if need > pool:
            raise ConfigError(
                f"request {req.request_id} needs up to {need} KV slots (prompt {len(req.prompt_ids)} + max tokens "
                f"{req.sampling.max_tokens} + speculative tree {self.spec_reserve()}), but the KV pool admits {pool}; "
                f"shorten it, lower --tree-width, or give the KV cache more memory (--kv-memory)")
        blocks = self.scheduler.blocks
        if blocks.window is not None:
            need_w = window_need(need, blocks.window, self.spec_reserve(), self.pipe.num_stages, self.step_rows)
            if need_w > blocks.window_admissible_tokens():
                raise ConfigError(
                    f"request {req.request_id} may need {need_w} slots of the sliding-window KV pool, which admits "
                    f"{blocks.window_admissible_tokens()}; shorten it, lower --max-step-rows or --tree-width, or "
                    f"give the KV cache more memory (--kv-memory)")
        # Build its state before the scheduler or the tables know it: if that fails, nothing refers
        # to a request without a state (the next schedule would die on it).
        state = self._new_state(req)
        try:
            self.scheduler.add(req.request_id, req.client)  # QueueFull when the waiting queue is at its bound
        except BaseException:
            state.finish()
            raise
        self.requests[req.request_id] = req
        self.states[req.request_id] = state
        self.observer.added(req)

    def follow_text(self, finished: list[Request]) -> list[Request]:
        """Detokenize what the last step committed, between steps (the step itself never does; a
        server does this on its output thread, AsyncEngine), streaming it to `on_text`; end the
        requests a stop string ended, and return those."""
        stopped = []
        for req in [*self.requests.values(), *finished]:
            out = req.output
            if out is None or out.kept is not None:
                continue
            piece = out.feed(req.output_ids[out.seen:], req.finish_reason)
            if out.kept is not None:
                if not req.finished:
                    self.abort(req.request_id, "stop")
                    stopped.append(req)
                req.keep(out.kept)
            if piece and req.on_text is not None:
                req.on_text(piece)
        return stopped

    def spec_reserve(self) -> int:
        return spec_reserve(self.mode, self.width, self.depth, self.pipe.num_stages, self.layers)

    def abort(self, request_id: int, reason: str = "abort", error: Optional[str] = None) -> None:
        """End a request now (what it decoded stays); its KV is freed on the next step."""
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            req.end(reason, error)
            self._retire(request_id)

    def run(self, requests: Iterable[Request], on_finish: Optional[Callable[[Request], None]] = None) -> None:
        """Serve `requests` together until all have finished: each joins as soon as the waiting
        queue has room, and the stages get every release before this returns. If a step fails,
        every request still here ends (error, or abort on Ctrl-C) before the exception goes on."""
        todo = list(requests)[::-1]
        try:
            while todo or self.has_work():
                while todo:
                    try:
                        self.add_request(todo[-1])
                    except QueueFull:
                        break
                    todo.pop()
                finished = self.step()
                for req in finished + self.follow_text(finished):
                    if on_finish is not None:
                        on_finish(req)
        except BaseException as e:
            for rid in list(self.requests):  # nothing may be left half-served
                self.abort(rid, "error" if isinstance(e, Exception) else "abort", str(e) or type(e).__name__)
            raise

    def has_work(self) -> bool:
        """Requests to serve, or a release/report still to deliver to the stages."""
        return self.scheduler.has_work() or bool(self._release) or self._report

    def request_stage_stats(self) -> None:
        """Ask the stages for their counters on the next step (read `stage_stats` after it)."""
        self._report = True

    # -- one pipeline step ----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One pipeline step; returns the requests that finished in it."""
        self._redraft()
        if self.drafter is not None:  # the draft's finished forward, if any, before the blocks are chosen
            self.drafter.poll(self, [self.states[rid] for rid in self.scheduler.running])
        plan = self.scheduler.schedule(self._want)
        for rid in plan.preempted:
            self._restart(rid)
        if self.prefix is not None:
            for rid in plan.admitted:
                self.prefix.admitted(self.states[rid])
        self._ended = []  # requests a fault of their own ended during this step
        running = [self.states[rid] for rid in self.scheduler.running]
        for st in running:
            self.own_fault(st, st.prepare, plan.grants[st.req.request_id], what="scheduling")
        self._draft(running, BEFORE)
        # Each request's part of the message is made whole before any of it is used, so one
        # that fails half-way (its grammar, say) ends alone and sends nothing.
        outgoing = [(st, out) for st in running
                    if self.alive(st) and (out := self.own_fault(st, self._outgoing, st, what="sending")) is not None]
        running = [st for st, _ in outgoing]
        rows = [r for _, (r, _, _, _) in outgoing if r is not None]
        control = Control(release=self._release, report=self._report, share=self._share,
                          evict=self.scheduler.blocks.take_evicted())
        self._share = []
        for _, (_, admit, prune, shares) in outgoing:
            if admit is not None:
                control.admit.append(admit)
            if prune is not None:
                control.prune.append(prune)
            control.share += shares
        self._release, self._report = [], False

        self.observer.submitted(self.pipe.steps + 1, control, rows, running)
        try:
            self.pipe.submit(control, rows)
        except StagesRestarted:
            return self._recompute_all()
        error: Optional[BaseException] = None
        drafters: list[ModeState] = []
        try:
            if self.drafter is None:
                drafters = self._draft(running, DURING)  # overlaps the stages' compute
        except BaseException as e:  # noqa: BLE001  (re-raised once the step is complete)
            # Finish the step first: collect and route its results, or the pipeline would stay a
            # step behind and these rows' results would be lost. A request whose drafting was cut
            # short only has fewer proposals (its tree grows less), never a wrong token.
            error = e
        t0 = time.perf_counter()
        try:
            results = self.pipe.collect()
        except StagesRestarted:
            return self._recompute_all()  # a drafting error of this step no longer matters
        # The results were already waiting when drafting ended: the draft, not the stages, set
        # this step's pace (only where the stages compute while the driver drafts).
        draft_bound = (bool(drafters) and self.pipe.concurrent
                       and time.perf_counter() - t0 < DRAFT_BOUND_WAIT_S)
        if draft_bound:
            self.draft_bound_steps += 1
        for st in drafters:
            st.draft_bound = draft_bound
            st.req.stats.draft_bound_steps += draft_bound
        self.steps += 1
        spans = []
        if control.report:
            spans = [r.pop("spans", []) for r in self.pipe.reported or []]
            self.stage_stats = self.pipe.reported
        self.observer.collected(spans)

        by_pid = {st.pid: st for st in running}
        for res in results:
            st = by_pid.get(res.request_id)
            if st is None or not self.alive(st):
                continue  # rows of a request that ended or was restarted while they travelled
            if res.failed:
                self._stage_kv_failed(st)
            else:
                self.own_fault(st, st.receive, res, what="reading its results")
        for st in running:
            if self.alive(st):
                if st.started:
                    st.req.stats.pipeline_steps += 1
                self.own_fault(st, st.verify, what="verifying")
        live = [st for st in running if self.alive(st)]
        if error is None and self.drafter is None:
            self._draft([st for st in live if not st.req.finished], AFTER)
        else:
            for st in live:  # drop a new root's draft call: the source may be in any state
                self.own_fault(st, st.drafting, AFTER)
        if CHECK_STATE:  # the tests: every speculative request's record obeys its invariants
            for st in live:
                if isinstance(st, SpecPipeState):
                    st.check()
        done = [st.req for st in live if st.req.finished]
        self.observer.verified([st.req for st in live])
        for req in done:
            self._retire(req.request_id)
        if error is not None:
            raise error
        return self._ended + done

    # -- internals ----------------------------------------------------------------------------------------
    def _want(self, rid: int) -> Want:
        """What the request would send, with its floor for the sliding-window pool: the committed
        positions it had sent S + 2 steps ago, which every stage has computed and settled since
        (a row sent at step t reaches the last stage at t + S - 1; sched/block_manager.py).
        Before its first rows, its cached prefix (engine/prefix_sharing.py)."""
        st = self.states[rid]
        self.scheduler.blocks.set_floor(rid, st.floors[0] if len(st.floors) == st.floors.maxlen else 0)
        if self.prefix is not None and not st.started and rid not in self.scheduler.running:
            self.prefix.lookup(st)
        return st.want()

    def _new_state(self, req: Request) -> ModeState:
        pid = next(self._pids)
        if self.mode not in SPECULATIVE_MODES:
            st = RoundsState(pid, req, None, 1, 0)
        elif self.mode == "tree":
            st = RoundsState(pid, req, self.source, self.width, self.depth)
        else:
            st = SpecPipeState(pid, req, self.source, self.width, self.layers, self.auto_plan)
        st.floors = deque(maxlen=self.pipe.num_stages + 2)  # see _want
        st.lagging = self.drafter is not None  # its draft may fall behind (modes/specpipe.py)
        return st

    def _draft(self, states: list[ModeState], phase: str) -> list[ModeState]:
        """Every request's source calls of one phase in one `propose_many` (one draft forward);
        repeated while some request has more (tree mode drafts its layers one after another).
        Returns the states that drafted."""
        drafted: dict[int, ModeState] = {}
        while self.source is not None:
            calls = [(st, c) for st in states
                     if self.alive(st) and (c := self.own_fault(st, st.drafting, phase)) is not None]
            if not calls:
                break
            for st, c in calls:  # a model draft masks its logits with the request's grammar
                g = st.req.grammar
                if g is not None and not g.closed:
                    c.masks = lambda nodes, g=g, tree=c.tree: g.masks(
                        [tree.path_tokens(n) if n in tree else None for n in nodes])
            t0 = time.perf_counter()
            outs = self.source.propose_many([c for _, c in calls])
            dt = time.perf_counter() - t0
            self.observer.drafted(phase, sum(len(c.rows.node_ids) for _, c in calls))
            for (st, call), props in zip(calls, outs):
                if st.req.grammar is not None and not st.req.grammar.closed:
                    props = self.own_fault(st, self.allowed_proposals, st, call.want, call.k, props)
                    if props is None:
                        continue  # the filter failed: the request ended with the cause
                self.own_fault(st, st.proposals, phase, props)
                st.req.stats.draft_s += dt / len(calls)
                st.req.stats.draft_calls += 1
                drafted[st.pid] = st
            self.draft_failed({st.pid: st for st, _ in calls})
        return list(drafted.values())

    def _outgoing(self, st: ModeState) -> tuple[Optional[Rows], Optional[Admit], Optional[Prune], list[Share]]:
        """One request's part of this step: its rows (masked), admit, pruning and shared blocks."""
        rows = st.send()
        if rows is not None:
            rows = self._penalized(st, self._masked(st, rows))
        admit, prune = st.control()
        st.floors.append(st.committed_sent())
        shares: list[Share] = []
        if self.prefix is not None:
            self.prefix.share(st, shares, final=False)
        return rows, admit, prune, shares

    @staticmethod
    def _masked(st: ModeState, rows: Rows) -> Rows:
        """Structured output: a token mask for every head row, from the grammar's state after the
        row's path (docs/design.md §20), so the last stage picks the target's token among the
        allowed ones for the committed path and every speculative row alike."""
        grammar = st.req.grammar
        if grammar is None or grammar.closed:
            return rows
        heads = rows.head_rows if rows.head_rows is not None else range(len(rows))
        paths = []
        for h in heads:
            node = rows.node_ids[h]
            paths.append(st.tree.path_tokens(node) if node in st.tree else None)
        rows.masks = grammar.masks(paths)
        return rows

    @staticmethod
    def _penalized(st: ModeState, rows: Rows) -> Rows:
        """Penalties: each head row's own path below the committed tokens, and those tokens
        counted once for all (penalties.py), so the last stage penalizes every row, speculative
        or not, as plain decoding would at its place."""
        params = st.req.sampling
        if not params.penalized:
            return rows
        heads = rows.head_rows if rows.head_rows is not None else range(len(rows))
        tree = st.tree
        if st.penalty_context is None:
            st.penalty_context = PenaltyContext(st.req.prompt_ids, params)
        st.penalty_context.follow(tree)
        rows.seen = st.penalty_context.seen()
        rows.paths = paths_tensor([tree.path_tokens(rows.node_ids[h]) if rows.node_ids[h] in tree else None
                                   for h in heads])
        return rows

    @staticmethod
    def allowed_proposals(st: ModeState, want, k: int, props: dict) -> dict:
        """A draft's proposals without the tokens the grammar forbids after their parent (such a
        node could never be committed, so it never takes a place in the tree), and with the
        token the grammar forces there first, for every node asked about (grammar/matcher.py)."""
        tree, grammar = st.tree, st.req.grammar
        out = dict(props)
        for n in dict.fromkeys([*want, *props]):
            if n in tree:
                out[n] = grammar.proposals(tree.path_tokens(n), props.get(n, []), k)
        return out

    # -- what engine/async_drafting.py uses (its DraftingCore): alive, own_fault, draft_failed,
    # allowed_proposals and observer; the rest of the core stays private to it ----------------------

    def draft_failed(self, by_pid: dict[int, ModeState]) -> None:
        """The draft's KV pool ran out for these requests: they go on unspeculated for now, and
        `_redraft` starts their drafting again once the draft has room (a few times at most)."""
        for pid in self.source.take_failures():
            st = by_pid.get(pid)
            if st is None or not self.alive(st):
                continue
            st.req.stats.draft_failures += 1
            if st.req.stats.draft_failures <= MAX_DRAFT_RESTARTS:
                self._draft_lost.append(st.req.request_id)

    def _redraft(self) -> None:
        """Requests whose draft lost its KV, where the draft now has room for them: recompute each
        under a new pid (the preemption path), which admits it to the draft again and feeds it
        prompt + output, so its speculation comes back. Oldest first, while there is room."""
        while self._draft_lost:
            req = self.requests.get(self._draft_lost[0])
            if req is not None and req.request_id in self.scheduler.running:  # (else ended or recomputed already)
                if not self.source.has_room(len(req.prompt_ids) + len(req.output_ids) + self.spec_reserve()):
                    return
                self.scheduler.requeue(req.request_id)
                self._restart(req.request_id)
            self._draft_lost.pop(0)

    def own_fault(self, st: ModeState, fn: Callable, *args, what: str = "drafting"):
        """Run one request's part of the step (its state machine, its grammar, its drafting).
        An error there (a NaN score from the draft, which `TokenTree.expand` refuses; a grammar
        that gives up) is that request's alone: it ends with the cause, and the step and every
        other request go on; its rows still in flight are dropped as results arrive. Only what
        fails outside these calls (the pipeline's submit and collect, the scheduler) is the
        engine's own fault."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001  (KeyboardInterrupt and the like still stop the step)
            st.req.end("error", f"{what} failed for this request: {type(e).__name__}: {e}")
            self._retire(st.req.request_id)
            self._ended.append(st.req)
            return None

    def alive(self, st: ModeState) -> bool:
        """The state still serves its request (not ended or restarted during this step)."""
        return self.states.get(st.req.request_id) is st

    def _retire(self, request_id: int) -> None:
        st = self.states.get(request_id)
        if st is not None and self.prefix is not None and request_id in self.scheduler.running:
            self.prefix.share(st, self._share, final=True)  # sent with its release
        self.scheduler.remove(request_id)
        self.requests.pop(request_id, None)
        st = self.states.pop(request_id, None)
        if st is not None:
            if st.started:
                self._release.append(st.pid)
            st.finish()
        self._failures.pop(request_id, None)

    def _restart(self, request_id: int) -> None:
        """Its KV was taken back (preemption) or lost at a stage: recompute it later under a new
        pid from its prompt and the tokens it already has (sampling is keyed by position, so
        the continuation is the same)."""
        old = self.states[request_id]
        if old.started:
            self._release.append(old.pid)
        old.finish()
        req = self.requests[request_id]
        req.stats.preemptions += 1
        self.states[request_id] = self._new_state(req)

    def _recompute_all(self) -> list[Request]:
        """The stages were started afresh and hold nothing: every request in the pipeline goes
        back to the front of the queue and is recomputed from prompt + output so far (the
        preemption path), so it loses no token and changes none."""
        for rid in list(self.scheduler.running)[::-1]:  # requeue puts each at the front
            self.scheduler.requeue(rid)
            self._restart(rid)
            self.requests[rid].stats.stage_restarts += 1
        self._release, self._share = [], []  # the new stages never knew the old pids
        self.scheduler.blocks.clear_cache()  # nor any cached block
        self._report = True  # the new stages' counters start afresh: report them on the next step
        self.stage_restarts += 1
        return self._ended  # requests a drafting fault ended before the failure

    def _stage_kv_failed(self, st: ModeState) -> None:
        rid = st.req.request_id
        if st.req.stats.cached_tokens:
            st.req.no_prefix_cache = True  # a stage lacked a block the driver thought cached
        n = self._failures[rid] = self._failures.get(rid, 0) + 1
        if n >= MAX_STAGE_KV_FAILURES:
            st.req.end("error", "a pipeline stage ran out of KV cache for this request")
            self._retire(rid)
            return
        self.scheduler.requeue(rid)
        self._restart(rid)
