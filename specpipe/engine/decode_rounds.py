"""Round-based decoding over the pipeline: mode `pp` (no speculation) and mode `tree`.

A round: draft a tree of depth D below the root (top-W per layer by cumulative score, as in
EAGLE-2), push the root and the whole tree through all S stages as one batch, then accept the
longest path the target agrees with plus the target's next token, and prune the rest. With no
source (D = 0) a round is one token crossing the pipeline: standard pipeline-parallel decoding.
Each round costs S pipeline steps however big the tree is; drafting its D layers one after
another happens before the round can start.
"""

from __future__ import annotations

import time
from typing import Optional


from specpipe.messages import Admit, Control, Pipeline, Prune, Rows
from specpipe.request import Request
from specpipe.engine.rows import concat_rows, node_rows, prompt_rows, source_rows
from specpipe.spec_decode.sources import SourceRows, TokenSource
from specpipe.spec_decode.tree import TokenTree


def decode_rounds(pipe: Pipeline, req: Request, source: Optional[TokenSource] = None,
                  depth: int = 0, width: int = 1) -> None:
    rid, stats = req.request_id, req.stats
    tree = TokenTree(req.prompt_ids, width)
    first = prompt_rows(rid, req.prompt_ids, tree.root_id)
    control = Control(admit=[Admit(rid, req.sampling)], prune=[Prune(rid, commit=list(first.node_ids))])
    root_rows: Rows = first  # what the target has not computed yet: the prompt, later the new root
    draft_rows = source_rows(first)  # what the source has not taken in yet
    if source is not None:
        source.start(rid)
        source.observe(rid, list(first.node_ids), [])  # the prompt is committed for the source too
    try:
        while not req.finished:
            nodes, undrafted = [], set()
            if source is not None and depth > 0:
                t0 = time.perf_counter()
                nodes, undrafted = _draft_tree(source, rid, tree, draft_rows, depth, width)
                stats.draft_s += time.perf_counter() - t0
            batch = concat_rows(root_rows, node_rows(rid, nodes) if nodes else None)
            results = pipe.step(control, [batch])
            for _ in range(pipe.num_stages - 1):  # the batch crosses the other stages
                results += pipe.step(Control(), [])
            stats.pipeline_steps += pipe.num_stages
            stats.rounds += 1
            for res in results:
                for node, tok in zip(res.node_ids, res.tokens):
                    if node in tree:
                        tree.record_target(node, tok)
            commit, drop, catch_up = [], [], None
            while tree.root_target() is not None and not req.finished:
                parent = tree.root_id
                v = tree.verify(tree.root_target())
                commit.append(v.committed_id)
                drop.extend(v.pruned)
                req.append(v.token)
                if source is not None:
                    stats.verifications += 1
                    if v.hit:
                        stats.hits += 1
                        stats.hits_by_depth[len(commit)] = stats.hits_by_depth.get(len(commit), 0) + 1
                if v.hit and v.committed_id in undrafted:
                    r = tree.root  # accepted from the last layer: the source never took it in
                    catch_up = SourceRows([r.node_id], [parent], [r.position], [r.token])
                if not v.hit:
                    root_rows = node_rows(rid, [tree.root], root_parent=parent)
            control = Control(prune=[Prune(rid, commit=commit, drop=drop)])
            if source is not None:
                source.observe(rid, commit, drop)
                draft_rows = _join(catch_up, source_rows(root_rows))
    finally:
        pipe.step(Control(release=[rid]), [])
        if source is not None:
            source.finish(rid)


def _draft_tree(source: TokenSource, rid: int, tree: TokenTree, feed: SourceRows, depth: int,
                width: int) -> tuple[list, set[int]]:
    """Draft D layers one after another. The deepest layer is not fed to the source (its
    proposals would go unused); it is returned as `undrafted` so that an accepted node from it
    is fed first next round."""
    props = source.propose(rid, tree, feed, [tree.root_id], width)
    nodes: list = []
    undrafted: set[int] = set()
    for d in range(depth):
        layer = tree.expand(props)
        if not layer:
            break
        nodes.extend(layer)
        if d + 1 == depth:
            undrafted = {n.node_id for n in layer}
        else:
            layer_rows = source_rows(node_rows(rid, layer))
            props = source.propose(rid, tree, layer_rows, [n.node_id for n in layer], width)
    return nodes, undrafted


def _join(first: Optional[SourceRows], then: SourceRows) -> SourceRows:
    if first is None:
        return then
    return SourceRows(first.node_ids + then.node_ids, first.parent_ids + then.parent_ids,
                      first.positions + then.positions, first.tokens + then.tokens)
