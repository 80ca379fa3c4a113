"""Modes `specpipe` and `specpipe-db` (SPEC §4-5): one new layer of the request's dynamic token
tree enters stage 1 every pipeline step, and one layer leaves the last stage and is verified.

One step of one request:
  1. send the pruning message of the last verification to every stage and the newest layer to
     stage 1; the layer is the global top-w children of the frontier by cumulative score, where
     w is the width the scheduler granted this step (the full W alone; narrower as the pipeline
     fills, down to none when the row budget binds);
  2. while the stages compute, the source takes in that layer and proposes its children
     (drafting overlaps the pipeline instead of being added to it);
  3. when the root's target token is known, verify it: a hit makes the matching child the root
     and prunes its siblings' subtrees; a miss makes the target's token a fresh root that must
     cross the whole pipeline;
  4. after a miss the new root is drafted at once and enters stage 1 with its first layer, so the
     two leave the last stage together and are verified in the same step (one step saved per miss).
"""

from __future__ import annotations

from typing import Optional

from specpipe.engine.modes.base import AFTER, DURING, ModeState
from specpipe.engine.rows import concat_rows, node_rows, source_rows
from specpipe.messages import Rows
from specpipe.sched.scheduler import Want
from specpipe.spec_decode.sources import ProposeCall, SourceRows


class SpecPipeState(ModeState):
    def __init__(self, pid, req, source, width: int) -> None:
        super().__init__(pid, req, source, width)
        self.props: dict[int, list[tuple[int, float]]] = {}  # node id -> its children's candidates
        self.drafted_depth: dict[int, int] = {}  # node id -> its depth when it was drafted
        self.new_root: Optional[Rows] = None  # after a miss: must cross the whole pipeline
        self._feed: Optional[SourceRows] = None  # sent this step, for the source to take in
        self._want: list[int] = []  # nodes whose children the source proposes this step
        self._root_call: Optional[ProposeCall] = None

    def want(self) -> Want:
        if self.prefill.left():
            return Want(must=self.prefill.left(), chunkable=True, held=self.held)
        grows = any(n.node_id in self.props for n in self.tree.frontier())
        return Want(must=len(self.new_root) if self.new_root is not None else 0,
                    spec=self.width if grows else 0, held=self.held)

    def send(self) -> Optional[Rows]:
        g, tree = self.grant, self.tree
        if self.prefill.left():
            if not g.must:
                return None
            chunk = self.prefill.take(g.must)
            self._feed = source_rows(chunk)
            self._want = [] if self.prefill.left() else [tree.root_id]
            return self._sent(chunk)
        rows = None
        if self.new_root is not None:
            if not g.must:
                return None  # its children cannot go before it
            rows, self.new_root = self.new_root, None
        if g.spec:
            tree.width = g.spec
            frontier = [n.node_id for n in tree.frontier() if n.node_id in self.props]
            layer = tree.expand({n: self.props[n] for n in frontier})
            for n in layer:
                self.drafted_depth[n.node_id] = n.position - tree.root_position
            self.req.stats.drafted += len(layer)
            if layer:
                layer_rows = node_rows(self.pid, layer)
                self._feed, self._want = source_rows(layer_rows), [n.node_id for n in layer]
                rows = concat_rows(rows, layer_rows)
        self.req.stats.live_nodes_sum += tree.num_live()
        return self._sent(rows)

    def drafting(self, phase: str) -> Optional[ProposeCall]:
        if phase == DURING and self._feed is not None:
            call = ProposeCall(self.pid, self.tree, self._feed, self._want, self.width)
            self._feed, self._want = None, []
            return call
        if phase == AFTER:
            call, self._root_call = self._root_call, None
            return call
        return None

    def proposals(self, phase: str, props: dict) -> None:
        self.props.update(props)

    def verify(self) -> None:
        tree, req, stats = self.tree, self.req, self.req.stats
        commit, drop = [], []
        while tree.root_target() is not None and not req.finished:
            parent = tree.root_id
            v = tree.verify(tree.root_target())
            stats.verifications += 1
            if v.hit:
                stats.hits += 1
                d = self.drafted_depth.get(v.committed_id, 0)
                stats.hits_by_depth[d] = stats.hits_by_depth.get(d, 0) + 1
            else:
                self.new_root = node_rows(self.pid, [tree.root], root_parent=parent)
            commit.append(v.committed_id)
            drop.extend(v.pruned)
            req.append(v.token)
        if not (commit or drop):
            return
        self._pruned(commit, drop)
        # Keep proposals of every live node: when a hit leaves a subtree shallower than the rest
        # of the tree was, its deepest layer becomes the frontier again and is re-expanded from
        # them (otherwise the tree would stop growing until a miss).
        self.props = {n: p for n, p in self.props.items() if n in tree}
        self.drafted_depth = {n: d for n, d in self.drafted_depth.items() if n in tree}
        if self.new_root is not None and self.source is not None and not req.finished:
            # A miss: draft the new root now (one small forward on the critical path) so that
            # its first layer enters stage 1 with it.
            self._root_call = ProposeCall(self.pid, tree, source_rows(self.new_root), [tree.root_id], self.width)
