"""Modes `specpipe` and `specpipe-db` (SPEC §4-5): every pipeline step a block of the request's
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

`--layers-per-step auto`: each block is the best AUTO_ROWS_PER_WIDTH * W nodes by cumulative draft
score wherever they lie (no per-layer width: rows go where the draft puts probability mass, as
EAGLE-2 chooses its tree), and the depth drafted ahead is chosen per request and step: one layer
deeper when the target accepted a whole block in two steps running, one shallower when drafting
outlasted the stages' compute (the draft set the pace), between 1 and AUTO_MAX_LAYERS. Under
specpipe-db the scheduler's grant caps the block as for a fixed d.
"""

from __future__ import annotations

from typing import Optional

from specpipe.engine.modes.base import AFTER, DURING, ModeState
from specpipe.engine.rows import concat_rows, node_rows, source_rows
from specpipe.messages import Rows
from specpipe.sched.scheduler import Want
from specpipe.spec_decode.block import BlockShape, block_size, choose_block
from specpipe.spec_decode.sources import ProposeCall, SourceRows

AUTO = "auto"
AUTO_MAX_LAYERS = 8
AUTO_FIRST_LAYERS = 2
AUTO_ROWS_PER_WIDTH = 4  # an auto block holds at most this many W of nodes


def block_rows(layers: int | str, width: int) -> int:
    """The most nodes one block can hold."""
    return AUTO_ROWS_PER_WIDTH * width if layers == AUTO else layers * width


class SpecPipeState(ModeState):
    def __init__(self, pid, req, source, width: int, layers: int | str = 1) -> None:
        super().__init__(pid, req, source, width)
        self.auto = layers == AUTO
        self.layers = AUTO_FIRST_LAYERS if self.auto else int(layers)  # d: the block's depth now
        self._whole_blocks = 0  # auto: steps running in which a whole block was accepted
        self.props: dict[int, list[tuple[int, float]]] = {}  # node id -> its children's candidates
        self.drafted_depth: dict[int, int] = {}  # node id -> its depth when it was sent
        self.sent: set[int] = set()  # tree node ids sent into the pipeline (the root once it is)
        self.fed: set[int] = set()  # tree node ids the source has taken in
        self.new_root: Optional[Rows] = None  # after a miss: must cross the whole pipeline
        self._last_root: Optional[int] = None  # the root before it (its parent for the stages)
        self._chunk: Optional[SourceRows] = None  # a prompt chunk sent this step, for the source
        self._calls = None  # the drafting in progress: a generator of source calls
        self._phase: Optional[str] = None
        self._call: Optional[ProposeCall] = None

    def shape(self, rows: Optional[int] = None) -> BlockShape:
        full = block_rows(AUTO if self.auto else self.layers, self.width)
        return BlockShape(self.layers, full if rows is None else min(rows, full), None if self.auto else self.width)

    def want(self) -> Want:
        if self.prefill.left():
            return Want(must=self.prefill.left(), chunkable=True, held=self.held)
        return Want(must=len(self.new_root) if self.new_root is not None else 0,
                    spec=block_size(self.tree, self.props, self.sent, self.shape()), held=self.held)

    def send(self) -> Optional[Rows]:
        g, tree = self.grant, self.tree
        if self.prefill.left():
            if not g.must:
                return None
            chunk = self.prefill.take(g.must)
            self._chunk = source_rows(chunk)
            if not self.prefill.left():
                self.sent.add(tree.root_id)
            return self._sent(chunk)
        rows = None
        if self.new_root is not None:
            if not g.must:
                return None  # its children cannot go before it
            rows, self.new_root = self.new_root, None
            self.sent.add(tree.root_id)
        block = choose_block(tree, self.props, self.sent, self.shape(g.spec)) if g.spec else []
        self._discard_unsent(keep={n.node_id for n in block})
        if block:
            for n in block:
                self.drafted_depth[n.node_id] = tree.depth_of(n.node_id)
            self.sent.update(n.node_id for n in block)
            self.req.stats.drafted += len(block)
            rows = concat_rows(rows, node_rows(self.pid, block))
        self.req.stats.live_nodes_sum += tree.num_live()
        return self._sent(rows)

    # -- drafting -----------------------------------------------------------------------------------
    def drafting(self, phase: str) -> Optional[ProposeCall]:
        if self._phase != phase:  # a new phase starts its own drafting (a cut-short one is dropped)
            self._phase, self._calls, self._call = phase, None, None
            if self.source is not None and not self.req.finished and (
                    phase == DURING or (phase == AFTER and self.new_root is not None)):
                self._calls = self._draft_ahead()
                self._advance(None)
        return self._call

    def proposals(self, phase: str, props: dict) -> None:
        self.fed.update(self._call.want)
        self.props.update(props)
        self._advance(props)

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
        if self._chunk is not None:  # a prompt chunk; the source proposes for the root once it is in
            chunk, self._chunk = self._chunk, None
            done = tree.root_id in self.sent
            yield ProposeCall(self.pid, tree, chunk, [tree.root_id] if done else [], self.width)
            if not done:
                return
        target = max((tree.depth_of(n) for n in self.sent if n in tree), default=0) + self.layers
        while True:
            call = self._unfed_call(target - 1)
            if call is not None:
                yield call
            if tree.max_depth() >= target:
                return
            frontier = [n.node_id for n in tree.frontier() if n.node_id in self.props]
            if not frontier or not tree.expand({n: self.props[n] for n in frontier}):
                return

    def _unfed_call(self, max_depth: int) -> Optional[ProposeCall]:
        """One call taking in every node (the root included) the source has not seen, down to
        `max_depth`, parents first, and asking for all their children."""
        tree, rows = self.tree, None
        if tree.root_id not in self.fed:
            if self.new_root is None and tree.root_id not in self.sent:
                return None  # the prompt is still coming in
            rows = self.new_root if self.new_root is not None else node_rows(self.pid, [tree.root], self._last_root)
        nodes = [n for n in tree.live_nodes() if n.node_id not in self.fed and tree.depth_of(n.node_id) <= max_depth]
        if nodes:
            rows = concat_rows(rows, node_rows(self.pid, nodes))
        if rows is None:
            return None
        return ProposeCall(self.pid, tree, source_rows(rows), list(rows.node_ids), self.width)

    # -- verification ---------------------------------------------------------------------------------
    def verify(self) -> None:
        tree, req, stats = self.tree, self.req, self.req.stats
        commit, drop = [], []
        while tree.root_target() is not None and not req.finished:
            parent = tree.root_id
            depth = max((self.drafted_depth.get(n.node_id, 0) for n in tree.live_nodes() if n.parent == parent),
                        default=0)  # when the root's children were sent (0: none were)
            v = tree.verify(tree.root_target())
            stats.verifications += 1
            if v.hit and v.committed_id in self.sent:
                stats.hits += 1
                depth = self.drafted_depth.get(v.committed_id, depth)
                stats.hits_by_depth[depth] = stats.hits_by_depth.get(depth, 0) + 1
            else:
                # A miss, or a hit on a node drafted ahead but not sent yet: either way the new
                # root must cross the whole pipeline (a drafted-ahead root keeps its subtree).
                self._last_root = parent
                self.new_root = node_rows(self.pid, [tree.root], root_parent=parent)
            stats.verifications_by_depth[depth] = stats.verifications_by_depth.get(depth, 0) + 1
            commit.append(v.committed_id)
            drop.extend(v.pruned)
            req.append(v.token)
        if self.started and not self.prefill.left():
            stats.commits_per_step[len(commit)] = stats.commits_per_step.get(len(commit), 0) + 1
            if self.auto:
                self._adapt(len(commit), self.new_root is None)
        if not (commit or drop):
            return
        self._pruned(commit, [n for n in drop if n in self.sent], [n for n in drop if n in self.fed])
        # Keep proposals of every live node: when a hit leaves a subtree shallower than the rest
        # of the tree was, its deepest layer becomes the frontier again and is re-expanded from
        # them (otherwise the tree would stop growing until a miss).
        self.props = {n: p for n, p in self.props.items() if n in tree}
        self.drafted_depth = {n: d for n, d in self.drafted_depth.items() if n in tree}
        self.sent = {n for n in self.sent if n in tree}
        self.fed = {n for n in self.fed if n in tree}

    def _adapt(self, committed: int, all_hits: bool) -> None:
        """auto: a block accepted whole twice running asks for a deeper one; a draft that set the
        pace asks for a shallower one (fewer source calls per step)."""
        self._whole_blocks = self._whole_blocks + 1 if all_hits and committed >= self.layers else 0
        if self.draft_bound and self.layers > 1:
            self.layers -= 1
            self._whole_blocks = 0
        elif self._whole_blocks >= 2 and self.layers < AUTO_MAX_LAYERS:
            self.layers += 1
            self._whole_blocks = 0

    def _discard_unsent(self, keep: set[int]) -> None:
        """Drop the nodes drafted ahead that are not in this step's block (the source forgets
        those it took in); they are drafted again when their turn comes."""
        unsent = [n.node_id for n in self.tree.live_nodes() if n.node_id not in self.sent and n.node_id not in keep]
        if not unsent:
            return
        removed = self.tree.discard(unsent)
        fed = [n for n in removed if n in self.fed]
        if fed and self.source is not None:
            self.source.observe(self.pid, [], fed)
        for n in removed:
            self.props.pop(n, None)
            self.fed.discard(n)
