"""Modes `specpipe` and `specpipe-db` (docs/design.md §4-§6): every pipeline step a block of the request's
dynamic token tree enters stage 1, and what left the last stage is verified.

The block is d layers deep (`--layers-per-step d`; d = 1 is the paper's method, one layer per
step): layer i + 1 is the global top-W children of layer i by cumulative draft score. A block
that enters at step t leaves the last stage at the end of step t + S - 1, so from then on d
layers leave per step and up to d tokens are committed per step, as far as the target agrees.

One step of one request:
  1. send the pruning message of the last verification to every stage and the block to stage 1.
     The block is chosen now, after that verification, from the nodes drafted ahead while the
     stages computed and from the source's proposals for nodes already in the pipeline, so
     pruning never leaves a layer thin: it is topped up to its width (spec_decode/block.py).
     Under specpipe-db the scheduler may grant fewer rows than the block holds (the tree narrows
     as the pipeline fills); what is not sent is dropped and drafted again later;
  2. while the stages compute, draft ahead: the source takes in what was sent and proposes its
     children, and the next block's layers are drafted one after another below it (d source
     calls, each one forward for all requests; the last layer is not taken in yet);
  3. when the root's target token is known, verify it, and go on down while the children the
     target chose were computed too: a hit makes the matching child the root and prunes its
     siblings' subtrees; a miss makes the target's token a fresh root that must cross the whole
     pipeline;
  4. after a miss the new root and d layers below it are drafted at once (d source calls on the
     critical path), so they enter stage 1 together in the next step.

`--layers-per-step auto`: the block's depth d and width w are planned per request and step
(spec_decode/planner.py): the (d, w) with the most expected tokens per unit of step time, from the
hit rate the target has given the engine's requests so far (at any width up to W, from where its
tokens ranked among the source's proposals) and, with a cost profile, what the stages' rows and
the d draft forwards cost. Without a profile rows are taken as nearly free (an accelerator) and
the deepest block of AUTO_MAX_LAYERS wins; either way the depth backs off a layer whenever drafting
outlasted the stages' compute (the draft set the pace) and creeps back after two steps that were
not draft-bound. Under specpipe-db the scheduler's grant caps the block as for a fixed d. Where
the plan is not to draft at all (a draft dearer than what its hits save; see the planner), the
request stops drafting for good and goes on as pp: the source forgets it, its steps count as
block "0x0", and its verifications no longer feed the shared hit profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from specpipe.engine.modes.base import AFTER, DURING, ModeState
from specpipe.engine.modes.draft_progress import DraftProgress, Phase, check_counters
from specpipe.engine.rows import concat_rows, node_rows, source_rows
from specpipe.messages import Rows
from specpipe.sched.scheduler import Want
from specpipe.spec_decode.block import BlockShape, Pick, select_block, take_block
from specpipe.spec_decode.planner import HitProfile, StepCost, plan_block
from specpipe.spec_decode.sources import ProposeCall

AUTO = "auto"
AUTO_MAX_LAYERS = 8
AUTO_WIDTH_SHARES = (1, 2, 4)  # auto tries W, W/2 and W/4 nodes per layer
AUTO_CALM_STEPS = 2  # steps not draft-bound before the depth may grow again by one


def block_rows(layers: int | str, width: int) -> int:
    """The most nodes one block can hold."""
    return (AUTO_MAX_LAYERS if layers == AUTO else layers) * width


@dataclass
class AutoPlan:
    """What `--layers-per-step auto` plans with, shared by the requests of one engine core."""

    hits: HitProfile
    num_stages: int
    cost: Optional[StepCost] = None  # None: rows nearly free, drafting hidden


class SpecPipeState(ModeState):
    def __init__(self, pid, req, source, width: int, layers: int | str = 1, auto: Optional[AutoPlan] = None) -> None:
        super().__init__(pid, req, source, width)
        if (layers == AUTO) != (auto is not None):
            raise ValueError("--layers-per-step auto needs an AutoPlan (and only auto takes one)")
        self.auto = auto
        self.layers = 1 if auto else int(layers)  # d: the block's depth now
        self.block_width = width  # w: nodes per layer of the block (auto: planned, at most W)
        self._cap, self._calm = AUTO_MAX_LAYERS, 0  # auto: the depth drafting allows, steps since it bound
        self.d = DraftProgress()  # what its drafting has done so far (modes/draft_progress.py)
        self._calls = None  # the drafting in progress: a generator of source calls
        self._phase: Optional[str] = None
        self._call: Optional[ProposeCall] = None
        self._picks: Optional[list[Pick]] = None  # the block `want` chose this step, for `send`
        if auto:
            self._replan()

    @property
    def lagging(self) -> bool:
        return self.d.lagging

    @lagging.setter
    def lagging(self, value: bool) -> None:
        self.d.lagging = value

    @property
    def phase(self) -> Phase:
        return self.d.phase(self.prefill.left(), self.source is not None)

    def check(self) -> None:
        """The record's invariants and the request's counters (engine/core.py runs this after
        every step under SPECPIPE_CHECK_STATE)."""
        self.d.check(self.tree, self.prefill.left(), self.req.request_id)
        check_counters(self.req.stats, self.req.request_id)

    def shape(self) -> BlockShape:
        return BlockShape(self.layers, self.layers * self.block_width, self.block_width)

    def want(self) -> Want:
        if self.prefill.left():
            return Want(must=self.prefill.left(), chunkable=True, held=self.held)
        self._picks = select_block(self.tree, self.d.props, self.d.sent, self.shape())
        return Want(must=len(self.d.new_root) if self.d.new_root is not None else 0, spec=len(self._picks),
                    held=self.held)

    def send(self) -> Optional[Rows]:
        g, tree = self.grant, self.tree
        if self.prefill.left():
            if not g.must:
                return None
            start = self.prefill.sent
            chunk = self.prefill.take(g.must)
            # The source computes its own KV: with a cached prefix its first chunk starts at 0. (A
            # lagging draft, --draft-async, may not have taken in the last chunk yet: it gets both.)
            rows = self.prefill.rows(0 if start == self.prefill.cached else start, self.prefill.sent)
            self.d.chunk = source_rows(concat_rows(self._pending_chunk(), rows))
            if not self.prefill.left():
                self.d.sent.add(tree.root_id)
            return self._sent(chunk)
        rows = None
        if self.d.new_root is not None:
            if not g.must:
                return None  # its children cannot go before it
            rows, self.d.new_root = self.d.new_root, None
            self.d.sent.add(tree.root_id)
        # The grant may cap the block: the picks are in choice order, so a prefix is the block a
        # smaller cap would have chosen.
        picks = self._picks if self._picks is not None else select_block(tree, self.d.props, self.d.sent, self.shape())
        self._picks = None
        block = take_block(tree, picks[:g.spec]) if g.spec else []
        self._discard_unsent(keep={n.node_id for n in block})
        if block:
            self.d.block_sent(tree, [n.node_id for n in block])
            self.req.stats.drafted += len(block)
            shape = f"{self.layers}x{self.block_width}"
            self.req.stats.block_shapes[shape] = self.req.stats.block_shapes.get(shape, 0) + 1
            rows = concat_rows(rows, node_rows(self.pid, block))
        elif self.auto and self.layers == 0:
            self.req.stats.block_shapes["0x0"] = self.req.stats.block_shapes.get("0x0", 0) + 1
        self.req.stats.live_nodes_sum += tree.num_live()
        return self._sent(rows)

    # -- drafting -----------------------------------------------------------------------------------
    def drafting(self, phase: str) -> Optional[ProposeCall]:
        if self._phase != phase:  # a new phase starts its own drafting (a cut-short one is dropped)
            self._phase, self._calls, self._call = phase, None, None
            if self.source is not None and not self.req.finished and (
                    phase == DURING or (phase == AFTER and self.d.new_root is not None)):
                self._calls = self._draft_ahead()
                self._advance(None)
        return self._call

    def proposals(self, phase: str, props: dict) -> None:
        self.d.taken_in(self._call)  # the source answered: it has the call's rows
        self.d.props.update(props)
        self._advance(props)

    def _pending_chunk(self) -> Optional[Rows]:
        c = self.d.chunk
        if c is None:
            return None
        return Rows(self.pid, list(c.node_ids), list(c.parent_ids), list(c.positions), c.tokens)

    # -- drafting with --draft-async (engine/async_drafting.py) -------------------------------------------
    def async_call(self) -> Optional[ProposeCall]:
        """The next source call of a draft-ahead from the tree as it is now: the layer the
        proposals so far allow is added, and the call takes in what the draft has not seen. Its
        answer comes a step or more later (`async_proposals`), so the drafting is not resumed:
        the next call starts afresh from the tree as it will be then."""
        self.d.lagging = True
        if self.source is None or self.req.finished:
            return None
        self._phase, self._calls, self._call = None, self._draft_ahead(), None
        self._advance(None)
        call, self._calls, self._call = self._call, None, None
        if call is not None:
            self.d.taken_in(call)  # the draft takes it in before any later pruning message
        return call

    def async_proposals(self, call: ProposeCall, props: dict) -> None:
        """A forward's answer, steps after its call: keep the proposals of nodes still live."""
        self.d.props.update({n: p for n, p in props.items() if n in self.tree})

    def _advance(self, props) -> None:
        try:
            self._call = self._calls.send(props) if props is not None else next(self._calls)
        except StopIteration:
            self._calls = self._call = None

    def _draft_ahead(self):
        """Source calls (a generator: yields a call, receives its proposals) until the tree holds
        d layers below the deepest layer in the pipeline. Each call takes in what the source has
        not seen (what was sent, then each new layer) except the deepest layer: its children
        would lie beyond the next block."""
        tree = self.tree
        if self.d.chunk is not None:  # a prompt chunk; the source proposes for the root once it is in
            chunk = self.d.chunk  # pending until a call carrying it is taken in (DraftProgress.taken_in)
            done = tree.root_id in self.d.sent
            want = [tree.root_id] if done and tree.root_id in chunk.node_ids else []  # (a lagging draft: the root may have moved on)
            yield ProposeCall(self.pid, tree, chunk, want, self.width)
            if not done:
                return
        target = max((tree.depth_of(n) for n in self.d.sent if n in tree), default=0) + self.layers
        while True:
            call = self._unfed_call(target - 1)
            if call is not None:
                yield call
            if tree.max_depth() >= target:
                return
            frontier = [n.node_id for n in tree.frontier() if n.node_id in self.d.props]
            if not frontier or not tree.expand({n: self.d.props[n] for n in frontier}):
                return

    def _unfed_call(self, max_depth: int) -> Optional[ProposeCall]:
        """One call taking in every node (the root included) the source has not seen, down to
        `max_depth`, parents first, and asking for all their children."""
        tree, rows, caught_up = self.tree, None, set()
        if tree.root_id not in self.d.fed and self.d.new_root is None and tree.root_id not in self.d.sent:
            return None  # the prompt is still coming in
        if self.d.behind:  # a lagging draft catches up on the committed tokens it missed, in order
            nodes, parents, positions, tokens = (list(x) for x in zip(*self.d.behind))
            rows = Rows(self.pid, nodes, parents, positions, torch.tensor(tokens, dtype=torch.long))
            caught_up = set(nodes)
        if tree.root_id not in self.d.fed:
            root = self.d.new_root if self.d.new_root is not None else node_rows(self.pid, [tree.root], self.d.last_root)
            rows = concat_rows(rows, root)
        nodes = [n for n in tree.live_nodes() if n.node_id not in self.d.fed and tree.depth_of(n.node_id) <= max_depth]
        if nodes:
            rows = concat_rows(rows, node_rows(self.pid, nodes))
        if rows is None:
            return None
        want = [n for n in rows.node_ids if n not in caught_up]
        return ProposeCall(self.pid, tree, source_rows(rows), want, self.width)

    # -- verification ---------------------------------------------------------------------------------
    def verify(self) -> None:
        tree, req, stats = self.tree, self.req, self.req.stats
        planning = self.auto is not None and self.layers > 0  # a request that stopped drafting only waits
        commit, drop = [], []
        while tree.root_target() is not None and not req.finished:
            parent = tree.root_id
            depth = max((self.d.drafted_depth.get(n.node_id, 0) for n in tree.live_nodes() if n.parent == parent),
                        default=0)  # when the root's children were sent (0: none were)
            rank = self._rank(parent, tree.root_target()) if planning else None
            if self.d.lagging and self.source is not None and parent not in self.d.fed and not self._in_chunk(parent):
                root = tree.root  # committed, and the draft never took it in: it catches up later
                if self.d.last_root is None:
                    raise RuntimeError("a lagging draft missed the prompt's last token")
                self.d.behind.append((parent, self.d.last_root, root.position, root.token))
            v = tree.verify(tree.root_target())
            stats.verifications += 1
            hit = v.hit and v.committed_id in self.d.sent
            if planning:
                self.auto.hits.record(rank, hit)
            if hit:
                stats.hits += 1
                depth = self.d.drafted_depth.get(v.committed_id, depth)
                stats.hits_by_depth[depth] = stats.hits_by_depth.get(depth, 0) + 1
            else:
                # A miss, or a hit on a node drafted ahead but not sent yet: either way the new
                # root must cross the whole pipeline (a drafted-ahead root keeps its subtree).
                self.d.last_root = parent
                self.d.new_root = node_rows(self.pid, [tree.root], root_parent=parent)
            stats.verifications_by_depth[depth] = stats.verifications_by_depth.get(depth, 0) + 1
            if self.d.lagging:
                self.d.last_root = parent  # the new root's parent, for a draft that takes it in late
            commit.append(v.committed_id)
            drop.extend(v.pruned)
            req.append(v.token, self._logprobs_of(parent))
        if self.started and not self.prefill.left():
            stats.commits_per_step[len(commit)] = stats.commits_per_step.get(len(commit), 0) + 1
            if planning:
                self._adapt()
        if not (commit or drop):
            return
        self._pruned(commit, [n for n in drop if n in self.d.sent], [n for n in drop if n in self.d.fed])
        self.d.keep_live(tree)

    def _in_chunk(self, node: int) -> bool:
        return self.d.chunk is not None and node in self.d.chunk.node_ids

    def _rank(self, parent: int, token: int) -> Optional[int]:
        """Where the source ranked the target's token among its proposals for `parent`."""
        ranked = sorted(self.d.props.get(parent, ()), key=lambda p: -p[1])
        return next((i for i, (t, _) in enumerate(ranked) if t == token), None)

    def _adapt(self) -> None:
        """auto: one layer less when drafting set the pace, one more allowed after calm steps;
        then the plan for the next block."""
        if self.draft_bound:
            self._cap, self._calm = max(1, self.layers - 1), 0
        else:
            self._calm += 1
            if self._calm >= AUTO_CALM_STEPS:
                self._cap, self._calm = min(AUTO_MAX_LAYERS, self._cap + 1), 0
        self._replan()

    def _replan(self) -> None:
        a = self.auto
        widths = [max(1, self.width // k) for k in AUTO_WIDTH_SHARES]
        d, w = plan_block(a.hits, self.block_width, a.num_stages, AUTO_MAX_LAYERS, widths, a.cost,
                          self.req.context_len)
        self.layers, self.block_width = min(d, self._cap), w
        self.tree.width = w
        if d == 0 and self.source is not None:  # for good: the source forgets the request
            self.source.finish(self.pid)
            self.source = None

    def _discard_unsent(self, keep: set[int]) -> None:
        """Drop the nodes drafted ahead that are not in this step's block (the source forgets
        those it took in); they are drafted again when their turn comes."""
        unsent = [n.node_id for n in self.tree.live_nodes() if n.node_id not in self.d.sent and n.node_id not in keep]
        if not unsent:
            return
        fed = self.d.discarded(self.tree.discard(unsent))
        if fed and self.source is not None:
            self.source.observe(self.pid, [], fed)
