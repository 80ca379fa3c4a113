"""What one request's drafting has done so far under modes `specpipe` and `specpipe-db`
(modes/specpipe.py): one record, its phase named, its invariants written as code.

Both draft paths update it in one order. A source call is built from the record without
changing it; only when the source takes the call in (`taken_in`: synchronously, when it has
answered; with --draft-async, when the call is submitted) do its nodes count as fed, and the
prompt chunk and committed tokens it carried stop being pending. A call built and then dropped (a
phase cut short, a new root's AFTER call the async path skips) therefore changes nothing.

`check` states the invariants; the engine core runs it after every step when
SPECPIPE_CHECK_STATE is set (the test suite sets it), so a path that breaks them fails at the step
that did, not tokens later.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Optional

from specpipe.messages import Rows
from specpipe.spec_decode.sources import ProposeCall, SourceRows
from specpipe.spec_decode.tree import TokenTree

CHECK_STATE = os.environ.get("SPECPIPE_CHECK_STATE", "") not in ("", "0")


class Phase(enum.Enum):
    PROMPT = "prompt"  # the prompt is still entering stage 1
    NEW_ROOT = "new root"  # after a miss: the target's token must cross the pipeline before its children
    FLOWING = "flowing"  # the root is in the pipeline; blocks below it follow every step
    UNDRAFTED = "undrafted"  # no source (or auto decided not to draft): it goes on as pp


class DraftStateError(AssertionError):
    """An invariant of the record broke: a bug in the mode, named with the request."""


@dataclass
class DraftProgress:
    props: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # node -> its children's candidates
    drafted_depth: dict[int, int] = field(default_factory=dict)  # node -> its depth when it was sent
    sent: set[int] = field(default_factory=set)  # nodes sent into the pipeline (the root once it is)
    fed: set[int] = field(default_factory=set)  # nodes the source has taken in
    new_root: Optional[Rows] = None  # after a miss: its row, until it is sent
    last_root: Optional[int] = None  # the root before the current one (its parent for the stages)
    chunk: Optional[SourceRows] = None  # prompt rows sent to stage 1 that the source has not taken in
    behind: list[tuple[int, int, int, int]] = field(default_factory=list)  # lagging: committed
    # (node, parent, position, token) the draft has not taken in, in order
    lagging: bool = False  # --draft-async: the draft may fall behind the committed tokens

    def phase(self, prefill_left: int, drafting: bool) -> Phase:
        if prefill_left:
            return Phase.PROMPT
        if self.new_root is not None:
            return Phase.NEW_ROOT
        return Phase.FLOWING if drafting else Phase.UNDRAFTED

    # -- the updates, in the one order both draft paths use ------------------------------------------
    def taken_in(self, call: ProposeCall) -> None:
        """The source has `call`'s rows now (see the module)."""
        self.fed.update(call.want)
        if self.chunk is not None and call.rows is self.chunk:
            self.chunk = None
        if self.behind:
            taken = set(call.rows.node_ids)
            self.behind = [b for b in self.behind if b[0] not in taken]

    def block_sent(self, tree: TokenTree, nodes: list[int]) -> None:
        for n in nodes:
            self.drafted_depth[n] = tree.depth_of(n)
        self.sent.update(nodes)

    def keep_live(self, tree: TokenTree) -> None:
        """After verification: forget what the tree pruned. The proposals of every live node are
        kept: when a hit leaves a subtree shallower than the rest of the tree was, its deepest
        layer becomes the frontier again and is re-expanded from them."""
        self.props = {n: p for n, p in self.props.items() if n in tree}
        self.drafted_depth = {n: d for n, d in self.drafted_depth.items() if n in tree}
        self.sent = {n for n in self.sent if n in tree}
        self.fed = {n for n in self.fed if n in tree}

    def discarded(self, removed: list[int]) -> list[int]:
        """Nodes drafted ahead and dropped unsent; returns those the source had taken in."""
        fed = [n for n in removed if n in self.fed]
        for n in removed:
            self.props.pop(n, None)
            self.fed.discard(n)
        return fed

    # -- the invariants -------------------------------------------------------------------------------
    def check(self, tree: TokenTree, prefill_left: int, request_id: int) -> None:
        def fail(what: str) -> None:
            raise DraftStateError(f"request {request_id}, {self.phase(prefill_left, True).value}: {what}")

        live = {n.node_id for n in tree.live_nodes()} | {tree.root_id}
        for name, ids in (("sent", self.sent), ("fed", self.fed), ("props", self.props),
                          ("drafted_depth", self.drafted_depth)):
            if not set(ids) <= live:
                fail(f"{name} holds nodes the tree no longer has: {sorted(set(ids) - live)}")
        if not set(self.drafted_depth) <= self.sent:
            fail("a drafted depth for a node never sent")
        if not set(self.props) <= self.fed:
            fail(f"proposals for nodes the source never took in: {sorted(set(self.props) - self.fed)}")
        if self.behind and not self.lagging:
            fail("committed tokens held back for a draft that cannot lag")
        if prefill_left and (self.sent or self.new_root is not None):
            fail("tree nodes sent before the prompt is in")
        if self.new_root is not None:
            if self.new_root.node_ids[0] != tree.root_id:
                fail(f"the pending new root {self.new_root.node_ids[0]} is not the tree's root {tree.root_id}")
            if self.sent:
                fail(f"nodes {sorted(self.sent)} sent before the root they hang from")
        parent = {n.node_id: n.parent for n in tree.live_nodes()}
        for n in self.sent - {tree.root_id}:  # the pipeline gets a node's parent first
            if parent.get(n) not in self.sent:
                fail(f"node {n} sent without its parent {parent.get(n)}")
        for n in self.fed - {tree.root_id}:  # so does the source
            if parent.get(n) not in self.fed:
                fail(f"node {n} taken in by the source without its parent {parent.get(n)}")


def check_counters(stats, request_id: int) -> None:
    """The request's speculation counters agree with each other."""
    problems = []
    if stats.hits > stats.verifications:
        problems.append(f"{stats.hits} hits in {stats.verifications} verifications")
    if sum(stats.hits_by_depth.values()) != stats.hits:
        problems.append(f"hits by depth {dict(stats.hits_by_depth)} do not sum to {stats.hits}")
    if sum(stats.verifications_by_depth.values()) != stats.verifications:
        problems.append(f"verifications by depth {dict(stats.verifications_by_depth)} do not sum to "
                        f"{stats.verifications}")
    if stats.hits > stats.drafted:
        problems.append(f"{stats.hits} hits of {stats.drafted} drafted nodes")
    if problems:
        raise DraftStateError(f"request {request_id}: " + "; ".join(problems))
