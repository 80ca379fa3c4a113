"""Mode `specpipe` (SPEC §4): one new layer of the dynamic token tree enters stage 1 every
pipeline step, and one layer leaves the last stage and is verified.

One driver step:
  1. send the pruning message of the last verification to every stage and the newest layer to
     stage 1 (`submit`);
  2. while the stages compute, the source takes in that layer and proposes its children
     (drafting overlaps the pipeline instead of being added to it);
  3. receive the rows leaving the last stage (`collect`); while the root's target token is known,
     verify it: a hit makes the matching child the root and prunes its siblings' subtrees; a miss
     makes the target's token a fresh root that must cross the whole pipeline;
  4. expand the next layer from the surviving frontier: the global top-W children by cumulative
     score. After a miss the new root is drafted at once and enters with its first layer.
"""

from __future__ import annotations

import time

from specpipe.engine.rows import concat_rows, node_rows, prompt_rows, source_rows
from specpipe.messages import Admit, Control, Pipeline, Prune
from specpipe.request import Request
from specpipe.spec_decode.sources import SourceRows, TokenSource
from specpipe.spec_decode.tree import TokenTree


def decode_specpipe(pipe: Pipeline, req: Request, source: TokenSource, width: int) -> None:
    rid, stats = req.request_id, req.stats
    tree = TokenTree(req.prompt_ids, width)
    rows = prompt_rows(rid, req.prompt_ids, tree.root_id)
    control = Control(admit=[Admit(rid, req.sampling)], prune=[Prune(rid, commit=list(rows.node_ids))])
    want = [tree.root_id]  # nodes whose children the source proposes this step
    feed_rows = rows  # what the source has not taken in yet
    props: dict[int, list[tuple[int, float]]] = {}
    drafted_depth: dict[int, int] = {}  # node id -> its depth when it was drafted
    source.start(rid)
    source.observe(rid, list(rows.node_ids), [])  # the prompt is committed for the source too
    try:
        while not req.finished:
            pipe.submit(control, [rows] if rows is not None else [])
            t0 = time.perf_counter()
            feed = source_rows(feed_rows) if feed_rows is not None else SourceRows([], [], [], [])
            props.update(source.propose(rid, tree, feed, want, width))
            stats.draft_s += time.perf_counter() - t0
            results = pipe.collect()
            stats.pipeline_steps += 1
            for res in results:
                for node, tok in zip(res.node_ids, res.tokens):
                    if node in tree:
                        tree.record_target(node, tok)

            commit, drop, new_root = [], [], None
            while tree.root_target() is not None and not req.finished:
                parent = tree.root_id
                v = tree.verify(tree.root_target())
                stats.verifications += 1
                if v.hit:
                    stats.hits += 1
                    d = drafted_depth.get(v.committed_id, 0)
                    stats.hits_by_depth[d] = stats.hits_by_depth.get(d, 0) + 1
                else:
                    new_root = node_rows(rid, [tree.root], root_parent=parent)
                commit.append(v.committed_id)
                drop.extend(v.pruned)
                req.append(v.token)
            if commit or drop:
                source.observe(rid, commit, drop)
                # Keep proposals of every live node: when a hit leaves a subtree shallower than
                # the rest of the tree was, its deepest layer becomes the frontier again and is
                # re-expanded from them (otherwise the tree would stop growing until a miss).
                props = {n: p for n, p in props.items() if n in tree}
                drafted_depth = {n: d for n, d in drafted_depth.items() if n in tree}
            control = Control(prune=[Prune(rid, commit=commit, drop=drop)] if commit or drop else [])
            if req.finished:
                break

            if new_root is not None:
                # A miss: the new root must cross the whole pipeline. Draft it now (one small
                # forward on the critical path) so that its first layer enters stage 1 with it:
                # root and children then leave the last stage together and are verified in the
                # same step, which saves one step per miss.
                t0 = time.perf_counter()
                props.update(source.propose(rid, tree, source_rows(new_root), [tree.root_id], width))
                stats.draft_s += time.perf_counter() - t0
            frontier = [n.node_id for n in tree.frontier() if n.node_id in props]
            layer = tree.expand({n: props[n] for n in frontier})
            for n in layer:
                drafted_depth[n.node_id] = n.position - tree.root_position
            feed_rows = node_rows(rid, layer) if layer else None
            rows = concat_rows(new_root, feed_rows)
            want = [n.node_id for n in layer]
            stats.live_nodes_sum += tree.num_live()
    finally:
        pipe.step(Control(release=[rid]), [])
        source.finish(rid)
