"""Choosing the block of tree nodes that enters stage 1 in one pipeline step (SPEC §4, "lifting
the cap"): up to `depth` layers below the deepest layer already in the pipeline.

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
from typing import Mapping, Sequence

from specpipe.spec_decode.tree import Node, TokenTree

Proposals = Mapping[int, Sequence[tuple[int, float]]]


@dataclass(frozen=True)
class BlockShape:
    depth: int  # layers below the deepest layer in the pipeline
    rows: int  # nodes in the block at most
    width: int  # nodes per layer at most


def choose_block(tree: TokenTree, props: Proposals, sent: set[int], shape: BlockShape) -> list[Node]:
    """The block for this step, parents first (by depth, then score); candidates that are not
    nodes yet become nodes."""
    chosen = _select(tree, props, sent, shape, tree.add_child)
    return sorted(chosen, key=lambda n: (n.position, -n.score, n.node_id))


def block_size(tree: TokenTree, props: Proposals, sent: set[int], shape: BlockShape) -> int:
    """How many nodes `choose_block` would choose now (the tree is left as it is)."""
    return len(_select(tree, props, sent, shape, lambda parent, token, lp: None))


def _select(tree: TokenTree, props: Proposals, sent: set[int], shape: BlockShape, make) -> list:
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
    chosen: list = []
    per_layer: dict[int, int] = {}
    while heap and len(chosen) < shape.rows:
        _, depth, parent, token, lp = heapq.heappop(heap)
        if per_layer.get(depth, 0) >= shape.width:
            continue
        per_layer[depth] = per_layer.get(depth, 0) + 1
        node = unsent.get((parent, token))
        if node is None:
            node = make(parent, token, lp)  # a new node has no proposals yet: a leaf of the block
        elif node.node_id in props:
            push_children(node, depth)
        chosen.append(node)
    return chosen
