"""Round-based decoding: modes `pp` / `pp-cb` (no source) and `tree`.

A round: draft a tree of depth D below the root (top-W per layer by cumulative score, as in
EAGLE-2), send the root and the whole tree into stage 1 as one batch, wait until it has crossed
all S stages, then accept the longest path the target agrees with plus the target's next token,
and prune the rest. Without a source a round is one token crossing the pipeline: standard
pipeline-parallel decoding. Each round costs S pipeline steps however big the tree is, and its D
layers are drafted one after another before the round can start. Other requests' rounds fill
the steps in between (continuous batching over the pipeline, as vLLM runs PP).
"""

from __future__ import annotations

from typing import Optional

import torch

from specpipe.engine.modes.base import BEFORE, ModeState
from specpipe.engine.rows import concat_rows, node_rows, source_rows
from specpipe.messages import Rows
from specpipe.sched.scheduler import Want
from specpipe.spec_decode.sources import ProposeCall, SourceRows


class RoundsState(ModeState):
    def __init__(self, pid, req, source, width: int, depth: int) -> None:
        super().__init__(pid, req, source, width)
        self.depth = depth if source is not None else 0
        self.root_rows: Optional[Rows] = None  # a new root the target has not computed yet
        self.awaiting = False  # a round is in the pipeline
        self.nodes: list = []  # this round's tree
        self.undrafted: set[int] = set()  # its deepest layer, never fed to the source
        self._feed: Optional[SourceRows] = None  # what the source has not taken in yet
        self._calls = None  # the round's drafting, one layer per source call

    def want(self) -> Want:
        if self.awaiting or (self.root_rows is None and not self.prefill.left()):
            return Want(held=self.held)
        if self.prefill.left():
            return Want(must=self.prefill.left(), chunkable=True, spec=self.depth * self.width, held=self.held)
        return Want(must=len(self.root_rows), spec=self.depth * self.width, held=self.held)

    def prepare(self, grant) -> None:
        super().prepare(grant)
        self.nodes = []
        completes = grant.must and grant.must >= self.prefill.left()  # the root goes out this step
        if completes and grant.spec and self.depth:
            if self._feed is None:  # the first round: the source takes in the whole prompt
                self._feed = source_rows(self.prefill.rows(0, len(self.prefill.tokens)))
            self._calls = self._draft_tree(max(1, min(self.width, grant.spec // self.depth)))
            self._call = next(self._calls)

    def drafting(self, phase: str) -> Optional[ProposeCall]:
        return self._call if phase == BEFORE and self._calls is not None else None

    def proposals(self, phase: str, props: dict) -> None:
        try:
            self._call = self._calls.send(props)
        except StopIteration:
            self._calls = self._call = None

    def _draft_tree(self, width: int):
        """Draft D layers one after another (a generator: yields a source call, receives its
        proposals). The deepest layer is not fed to the source (its proposals would go unused);
        it is remembered as `undrafted` so that an accepted node from it is fed first next round."""
        tree, pid = self.tree, self.pid
        tree.width = width
        props = yield ProposeCall(pid, tree, self._feed, [tree.root_id], self.width)
        self._feed = None
        self.undrafted = set()
        for d in range(self.depth):
            layer = tree.expand(props)
            if not layer:
                return
            self.nodes.extend(layer)
            self.req.stats.drafted += len(layer)
            if d + 1 == self.depth:
                self.undrafted = {n.node_id for n in layer}
                return
            layer_rows = source_rows(node_rows(pid, layer))
            props = yield ProposeCall(pid, tree, layer_rows, [n.node_id for n in layer], self.width)

    def send(self) -> Optional[Rows]:
        g = self.grant
        if not g.must:
            return None
        if self.prefill.left():
            head = self.prefill.take(g.must)
            if self.prefill.left():
                return self._sent(head)  # a chunk of a long prompt; the round starts with the last one
        else:
            head, self.root_rows = self.root_rows, None
        self.awaiting = True
        return self._sent(concat_rows(head, node_rows(self.pid, self.nodes) if self.nodes else None))

    def verify(self) -> None:
        tree, req, stats = self.tree, self.req, self.req.stats
        if tree.root_target() is None:
            return
        stats.rounds += 1
        commit, drop, catch_up = [], [], None
        while tree.root_target() is not None and not req.finished:
            parent = tree.root_id
            v = tree.verify(tree.root_target())
            commit.append(v.committed_id)
            drop.extend(v.pruned)
            req.append(v.token, self._logprobs_of(parent))
            if self.source is not None:
                stats.verifications += 1
                if v.hit:
                    stats.hits += 1
                    stats.hits_by_depth[len(commit)] = stats.hits_by_depth.get(len(commit), 0) + 1
            if v.hit and v.committed_id in self.undrafted:
                r = tree.root  # accepted from the last layer: the source never took it in
                catch_up = SourceRows([r.node_id], [parent], [r.position], [r.token])
            if not v.hit:
                self.root_rows = node_rows(self.pid, [tree.root], root_parent=parent)
        self.awaiting = False
        self._pruned(commit, drop)
        if self.source is not None and self.root_rows is not None:
            fresh = source_rows(self.root_rows)
            self._feed = fresh if catch_up is None else SourceRows(
                catch_up.node_ids + fresh.node_ids, catch_up.parent_ids + fresh.parent_ids,
                catch_up.positions + fresh.positions, torch.cat([catch_up.tokens, fresh.tokens]))

