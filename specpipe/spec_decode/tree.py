"""The dynamic speculative token tree of one request (docs/design.md §3-§4), kept by the driver.

Pure Python: no torch, no model, no processes. (Each stage builds its tree attention mask itself,
in kv/slot_table.py, from the parent ids the rows carry.)

Glossary:
  committed  -- every token the target has decided, prompt included, in order.
  root       -- the last committed token, at absolute position p = len(committed) - 1. It has a
                node id like any node, so a stage can name it; it has no parent in the tree (what
                precedes it is the committed prefix, visible to every node).
  node       -- a speculative token hanging under the root. A node at depth d (d >= 1) is a
                candidate for absolute position p + d.
  layer d    -- the live nodes at depth d. Layers are added below the deepest (expand), or nodes
                into a given layer (add_child, when a block of layers is topped up).
  frontier   -- the deepest layer, the one the next expansion grows from; the root alone when
                there are no speculative nodes (right after a miss, or at the start).
  score      -- cumulative draft log-probability along the path from the current root.
  hit / miss -- verification of the root's target token x: a hit when x is a child of the root
                (that child becomes the root), a miss otherwise (x becomes a fresh root).

Positions are absolute and never change while a node lives; depth is relative to the current
root (depth = position - p), so after a hit every survivor's depth drops by one. Node ids are
unique for the request's lifetime and increase in creation order; since a parent is always created
before its children, id order is also a topological order, which lets pruning work in one pass
over the live nodes (O(live) per step, with about W*S live nodes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence


@dataclass(slots=True)
class Node:
    node_id: int
    token: int
    parent: Optional[int]   # None for the root
    position: int           # absolute position in the sequence; fixed for the node's life
    logprob: float          # draft log-probability of `token` given the path to it
    score: float            # sum of logprobs from the current root (the root's own score is 0)
    target: Optional[int] = None  # the target's token for position + 1, once computed


@dataclass(frozen=True)
class VerifyResult:
    """The outcome of one verification: the pruning message every stage receives."""

    hit: bool                   # the target's token was a child of the old root
    token: int                  # the committed token (the target's token)
    position: int               # its absolute position (the new root's position)
    committed_id: int           # node id of the new root: the hit child, or a fresh id on a miss
    pruned: tuple[int, ...]     # speculative node ids dropped, ascending
    surviving: tuple[int, ...]  # speculative node ids still live (below the new root), ascending


Proposals = Mapping[int, Sequence[tuple[int, float]]]  # parent id -> [(token, logprob), ...]


class TokenTree:
    """One request's committed sequence plus the speculative tree under its last token."""

    def __init__(self, prompt: Sequence[int], width: int) -> None:
        if len(prompt) == 0:
            raise ValueError("a token tree needs a non-empty prompt: its last token is the root")
        self._committed: list[int] = [int(t) for t in prompt]
        self.prompt_len = len(self._committed)
        self.width = width
        self._next_id = 0
        self._root = self._new_root(self._committed[-1])
        # Live speculative nodes by id; dict order is id order, hence parents before children.
        self._nodes: dict[int, Node] = {}
        self.verifications = 0
        self.hits = 0

    # ---- parameters and state --------------------------------------------------------------

    @property
    def width(self) -> int:
        """W: how many nodes one expansion keeps. Settable, so batching can narrow the tree."""
        return self._width

    @width.setter
    def width(self, value: int) -> None:
        if int(value) < 1:
            raise ValueError(f"tree width must be at least 1, got {value}")
        self._width = int(value)

    @property
    def num_committed(self) -> int:
        return len(self._committed)

    def committed_since(self, start: int) -> list[int]:
        """The committed tokens from index `start` on: O(new tokens), for readers that keep up
        with the sequence incrementally (the n-gram index) instead of copying all of it."""
        if not 0 <= start <= len(self._committed):
            raise IndexError(f"committed_since({start}): {len(self._committed)} tokens are committed")
        return self._committed[start:]

    @property
    def root(self) -> Node:
        return self._root

    @property
    def root_id(self) -> int:
        return self._root.node_id

    # ---- queries -----------------------------------------------------------------------------

    def node(self, node_id: int) -> Node:
        """The root or a live speculative node; KeyError for anything else."""
        if node_id == self._root.node_id:
            return self._root
        try:
            return self._nodes[node_id]
        except KeyError:
            raise KeyError(f"node {node_id} is not in the tree (pruned, committed or never made)") from None

    def __contains__(self, node_id: int) -> bool:
        return node_id == self._root.node_id or node_id in self._nodes

    def live_nodes(self) -> list[Node]:
        """Live speculative nodes (root excluded), in id order, so parents come first."""
        return list(self._nodes.values())

    def num_live(self) -> int:
        return len(self._nodes)

    def depth_of(self, node_id: int) -> int:
        """Depth below the current root (0 for the root itself)."""
        return self.node(node_id).position - self._root.position

    def max_depth(self) -> int:
        """Depth of the deepest live layer (0 when only the root is left)."""
        if not self._nodes:
            return 0
        return max(n.position for n in self._nodes.values()) - self._root.position

    def layer(self, depth: int) -> list[Node]:
        """Live nodes at `depth`, in id order; layer(0) is [root]."""
        if depth == 0:
            return [self._root]
        pos = self._root.position + depth
        return [n for n in self._nodes.values() if n.position == pos]

    def frontier(self) -> list[Node]:
        """The layer the next expansion grows from: the deepest live layer, or [root]."""
        return self.layer(self.max_depth())

    def ancestors(self, node_id: int) -> list[int]:
        """Node ids on the path from a child of the root down to `node_id`, both included.

        The root is not included (its KV is committed prefix); ancestors(root) is [].
        """
        path = []
        node = self.node(node_id)
        while node.parent is not None:
            path.append(node.node_id)
            node = self.node(node.parent)
        path.reverse()
        return path

    def path_tokens(self, node_id: int) -> list[int]:
        """The speculative continuation of the committed sequence that ends at `node_id`."""
        return [self._nodes[i].token for i in self.ancestors(node_id)]

    # ---- driver bookkeeping ------------------------------------------------------------------

    def record_target(self, node_id: int, token: int) -> None:
        """The last stage computed `node_id`: the target's token for its position + 1."""
        self.node(node_id).target = int(token)

    def root_target(self) -> Optional[int]:
        """The root's target token if it has been computed: verify(root_target()) is due."""
        return self._root.target

    # ---- the two tree operations -------------------------------------------------------------

    def expand(self, proposals: Proposals) -> list[Node]:
        """Add the next layer: the global top-W children of frontier nodes by cumulative score.

        `proposals` maps frontier node ids to (token, logprob) candidates from a draft source.
        A token proposed twice under one parent keeps its best logprob. Ties in score go to the
        lower parent id, then the lower token id, so the tree does not depend on dict order.
        New nodes get ids in rank order (best first) and are returned in that order. No
        proposals (or only empty lists) leave the tree unchanged.
        """
        frontier_ids = {n.node_id for n in self.frontier()}
        best: dict[tuple[int, int], float] = {}  # (parent, token) -> best logprob
        for parent, cands in proposals.items():
            if parent not in frontier_ids:
                raise ValueError(f"expand: node {parent} is not on the frontier {sorted(frontier_ids)}")
            for token, logprob in cands:
                token, logprob = int(token), float(logprob)
                if token < 0:
                    raise ValueError(f"expand: negative token id {token}")
                if math.isnan(logprob) or logprob == math.inf:
                    # -inf is a legal (if hopeless) guess; NaN and +inf would poison every score below
                    raise ValueError(f"expand: logprob {logprob} for token {token} under node {parent}")
                key = (parent, token)
                if key not in best or logprob > best[key]:
                    best[key] = logprob

        ranked = sorted(
            ((self.node(parent).score + lp, parent, token, lp) for (parent, token), lp in best.items()),
            key=lambda c: (-c[0], c[1], c[2]),
        )
        added = []
        for score, parent, token, lp in ranked[: self._width]:
            node = Node(self._take_id(), token, parent, self.node(parent).position + 1, lp, score)
            self._nodes[node.node_id] = node
            added.append(node)
        return added

    def add_child(self, parent_id: int, token: int, logprob: float) -> Node:
        """One node under `parent_id` (in any layer: blocks of several layers fill layers that
        pruning thinned). The caller keeps (parent, token) pairs unique."""
        parent = self.node(parent_id)
        node = Node(self._take_id(), int(token), parent_id, parent.position + 1, float(logprob),
                    parent.score + float(logprob))
        self._nodes[node.node_id] = node
        return node

    def discard(self, node_ids) -> list[int]:
        """Remove speculative nodes that were never sent, with everything below them; returns
        the removed ids, ascending."""
        gone = set(node_ids)
        removed = []
        for nid, n in self._nodes.items():  # id order: a parent is decided before its children
            if nid in gone or n.parent in gone:
                gone.add(nid)
                removed.append(nid)
        for nid in removed:
            del self._nodes[nid]
        return removed

    def verify(self, target_token: int) -> VerifyResult:
        """Commit the target's token for the position after the root, and prune.

        Hit: the root's child with that token becomes the root; only its subtree survives, and
        survivors' scores are re-based on it (depths drop by one, positions stay). Miss: the token
        becomes a fresh root (new id, nothing computed yet) and every speculative node is pruned.
        """
        token = int(target_token)
        old = self._root
        if old.target is not None and old.target != token:
            raise ValueError(f"verify: token {token} differs from the root's recorded target {old.target}")
        self.verifications += 1
        self._committed.append(token)

        child = next((n for n in self._nodes.values()
                      if n.parent == old.node_id and n.token == token), None)
        survivors: dict[int, Node] = {}
        pruned = []
        if child is not None:
            self.hits += 1
            keep = {child.node_id}
            for nid, n in self._nodes.items():  # id order: a parent is decided before its children
                if n.parent in keep:
                    keep.add(nid)
                    survivors[nid] = n
                elif nid != child.node_id:
                    pruned.append(nid)
            child.parent, child.score = None, 0.0
            for n in survivors.values():  # re-summed rather than shifted: exact, and safe at -inf
                n.score = survivors.get(n.parent, child).score + n.logprob
            self._root = child
        else:
            pruned = list(self._nodes)
            self._root = self._new_root(token)
        self._nodes = survivors
        return VerifyResult(
            hit=child is not None,
            token=token,
            position=self._root.position,
            committed_id=self._root.node_id,
            pruned=tuple(pruned),
            surviving=tuple(survivors),
        )

    # ---- internals ---------------------------------------------------------------------------

    def _take_id(self) -> int:
        nid = self._next_id
        self._next_id += 1
        return nid

    def _new_root(self, token: int) -> Node:
        """A root the target has not seen yet: it still has to cross the whole pipeline."""
        return Node(self._take_id(), token, None, len(self._committed) - 1, 0.0, 0.0)

    def __repr__(self) -> str:
        return (f"TokenTree(root={self._root.node_id}@{self._root.position}, width={self._width}, "
                f"live={len(self._nodes)}, depth={self.max_depth()}, hits={self.hits}/{self.verifications})")
