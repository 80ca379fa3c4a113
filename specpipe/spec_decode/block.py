"""Choosing the block of tree nodes that enters stage 1 in one pipeline step (docs/design.md §4,
"Several layers per step"): up to `depth` layers below the deepest layer already in the pipeline.

Best-first by cumulative draft score: candidates are the children the source proposed for nodes
already in the pipeline (or already chosen for this block), so a parent always comes before its
children, and at most W nodes go into each layer: layer i + 1 is the global top-W children of
layer i (d = 1 is the paper's SpecPipe, one layer per step). A row cap (the scheduler's grant)
can end the block early.

Candidates may already exist as unsent nodes (drafted ahead while the stages computed): they are
reused, and their own proposals open the next layer of the block. Ties go to the shallower node,
then the lower parent id, then the lower token id, as in `TokenTree.expand`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from specpipe.spec_decode.tree import Node, TokenTree

Proposals = Mapping[int, Sequence[tuple[int, float]]]


@dataclass(frozen=True)
class BlockShape:
    depth: int  # layers below the deepest layer in the pipeline
    rows: int  # nodes in the block at most
    width: int  # nodes per layer at most


@dataclass(frozen=True)
class Pick:
    """One node of a block: an unsent node drafted ahead, or (node None) a child to create."""

    parent: int
    token: int
    logprob: float
    node: Optional[Node]


def select_block(tree: TokenTree, props: Proposals, sent: set[int], shape: BlockShape) -> list[Pick]:
    """The block for this step in the order it is chosen, the tree left as it is. The choice is
    greedy and stops at `shape.rows`, so the first k picks are the block a cap of k rows would
    choose: the scheduler sizes a request's want from this list and the state sends a prefix."""
    base_depth = max((tree.depth_of(n) for n in sent if n in tree), default=0)
    top = base_depth + shape.depth
    unsent = {(n.parent, n.token): n for n in tree.live_nodes() if n.node_id not in sent}
    heap: list[tuple] = []

    def push_children(parent: Node, depth: int) -> None:
        if depth >= top:
            return
        best: dict[int, float] = {}  # a token proposed twice keeps its best logprob
        for token, lp in props.get(parent.node_id, ()):
            token, lp = int(token), float(lp)
            if token not in best or lp > best[token]:
                best[token] = lp
        for token, lp in best.items():
            heapq.heappush(heap, (-(parent.score + lp), depth + 1, parent.node_id, token, lp))

    for n in [tree.root, *tree.live_nodes()]:
        if (n is tree.root or n.node_id in sent) and tree.depth_of(n.node_id) == base_depth:
            push_children(n, base_depth)
    chosen: list[Pick] = []
    per_layer: dict[int, int] = {}
    while heap and len(chosen) < shape.rows:
        _, depth, parent, token, lp = heapq.heappop(heap)
        if per_layer.get(depth, 0) >= shape.width:
            continue
        per_layer[depth] = per_layer.get(depth, 0) + 1
        node = unsent.get((parent, token))
        if node is not None and node.node_id in props:
            push_children(node, depth)  # a new node has no proposals yet: a leaf of the block
        chosen.append(Pick(parent, token, lp, node))
    return chosen


def take_block(tree: TokenTree, picks: Sequence[Pick]) -> list[Node]:
    """The picked nodes, created where they are not nodes yet, parents first (by depth, then
    score)."""
    nodes = [p.node if p.node is not None else tree.add_child(p.parent, p.token, p.logprob) for p in picks]
    return sorted(nodes, key=lambda n: (n.position, -n.score, n.node_id))

