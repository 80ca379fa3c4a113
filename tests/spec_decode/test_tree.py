"""The token tree on its own: unit tests, then random expand/verify sequences checked against an
independent reference model (parents recorded at creation, pruning recomputed from scratch)."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specpipe.spec_decode.tree import TokenTree

PROMPT = [11, 12, 13]


def committed(tree):
    """Every committed token, prompt included."""
    return tuple(tree.committed_since(0))


def is_live(tree, node_id):
    """A live speculative node (not the root)."""
    return node_id in tree and node_id != tree.root_id


def grow(tree, proposals):
    """Expand and return {token: node} of the new layer (tokens are unique in these tests)."""
    return {n.token: n for n in tree.expand(proposals)}


# ---- construction and queries ----------------------------------------------------------------

def test_initial_tree_is_just_the_root():
    tree = TokenTree(PROMPT, width=4)
    assert committed(tree) == tuple(PROMPT)
    assert tree.root.token == 13 and tree.root.position == 2 and tree.root_id == 0
    assert tree.num_live() == 0 and tree.live_nodes() == []
    assert [n.node_id for n in tree.frontier()] == [tree.root_id]
    assert tree.ancestors(tree.root_id) == [] and tree.depth_of(tree.root_id) == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        TokenTree([], width=4)
    with pytest.raises(ValueError):
        TokenTree(PROMPT, width=0)
    tree = TokenTree(PROMPT, width=2)
    with pytest.raises(ValueError):
        tree.expand({tree.root_id: [(1, math.nan)]})
    with pytest.raises(ValueError):
        tree.expand({tree.root_id: [(1, math.inf)]})
    with pytest.raises(ValueError):
        tree.expand({tree.root_id: [(-1, 0.0)]})
    with pytest.raises(KeyError):
        tree.node(99)


# ---- expand ----------------------------------------------------------------------------------

def test_expand_scores_positions_and_ancestors():
    tree = TokenTree(PROMPT, width=4)
    l1 = grow(tree, {tree.root_id: [(5, -0.1), (6, -1.0)]})
    assert set(l1) == {5, 6}
    assert l1[5].score == pytest.approx(-0.1) and l1[5].parent == tree.root_id
    assert tree.node(l1[5].node_id).position == 3 and tree.depth_of(l1[5].node_id) == 1

    l2 = grow(tree, {l1[5].node_id: [(7, -0.2)], l1[6].node_id: [(8, -0.3)]})
    assert l2[7].score == pytest.approx(-0.3)
    assert l2[8].score == pytest.approx(-1.3)
    assert tree.node(l2[8].node_id).position == 4 and tree.depth_of(l2[8].node_id) == 2
    assert tree.ancestors(l2[8].node_id) == [l1[6].node_id, l2[8].node_id]
    assert tree.path_tokens(l2[8].node_id) == [6, 8]
    assert [n.node_id for n in tree.frontier()] == [n.node_id for n in tree.layer(2)]
    assert tree.max_depth() == 2


def test_expand_keeps_global_top_w_across_parents():
    tree = TokenTree(PROMPT, width=3)
    l1 = grow(tree, {tree.root_id: [(1, -0.1), (2, -2.0)]})
    a, b = l1[1].node_id, l1[2].node_id
    # Under `a` every child beats the best child of `b` on cumulative score, except one.
    new = tree.expand({a: [(10, -0.5), (11, -3.0), (12, -2.5)], b: [(20, -0.1), (21, -5.0)]})
    # scores: 10:-0.6  11:-3.1  12:-2.6  20:-2.1  21:-7.0
    assert [n.token for n in new] == [10, 20, 12]  # best first, ids in that order
    assert [n.node_id for n in new] == sorted(n.node_id for n in new)
    assert tree.num_live() == 5


def test_expand_merges_duplicate_tokens_under_one_parent():
    tree = TokenTree(PROMPT, width=4)
    new = tree.expand({tree.root_id: [(5, -2.0), (5, -0.5), (6, -1.0), (5, -1.0)]})
    assert [(n.token, n.logprob) for n in new] == [(5, -0.5), (6, -1.0)]


def test_same_token_under_different_parents_is_two_nodes():
    tree = TokenTree(PROMPT, width=4)
    l1 = grow(tree, {tree.root_id: [(1, -0.1), (2, -0.2)]})
    new = tree.expand({l1[1].node_id: [(9, -0.1)], l1[2].node_id: [(9, -0.1)]})
    assert len(new) == 2 and {n.parent for n in new} == {l1[1].node_id, l1[2].node_id}


def test_expand_ties_go_to_lower_parent_then_lower_token():
    tree = TokenTree(PROMPT, width=2)
    l1 = grow(tree, {tree.root_id: [(1, -1.0), (2, -1.0)]})
    a, b = l1[1].node_id, l1[2].node_id
    new = tree.expand({b: [(4, 0.0), (3, 0.0)], a: [(6, 0.0), (5, 0.0)]})
    assert [(n.parent, n.token) for n in new] == [(a, 5), (a, 6)]


def test_expand_only_from_the_frontier_and_empty_is_a_noop():
    tree = TokenTree(PROMPT, width=2)
    l1 = grow(tree, {tree.root_id: [(1, -1.0)]})
    grow(tree, {l1[1].node_id: [(2, -1.0)]})
    with pytest.raises(ValueError):
        tree.expand({l1[1].node_id: [(3, -1.0)]})  # no longer the newest layer
    with pytest.raises(ValueError):
        tree.expand({tree.root_id: [(3, -1.0)]})
    before = [(n.node_id, n.token) for n in tree.live_nodes()]
    assert tree.expand({}) == []
    assert tree.expand({n.node_id: [] for n in tree.frontier()}) == []
    assert [(n.node_id, n.token) for n in tree.live_nodes()] == before


def test_width_can_change_between_expansions():
    tree = TokenTree(PROMPT, width=4)
    assert len(tree.expand({tree.root_id: [(t, -t) for t in range(8)]})) == 4
    tree.width = 2
    new = tree.expand({n.node_id: [(1, -0.1), (2, -0.2)] for n in tree.frontier()})
    assert len(new) == 2


# ---- verify ----------------------------------------------------------------------------------

def test_verify_hit_promotes_child_and_prunes_siblings():
    tree = TokenTree(PROMPT, width=4)
    l1 = grow(tree, {tree.root_id: [(5, -0.5), (6, -1.0)]})
    l2 = grow(tree, {l1[5].node_id: [(7, -0.2)], l1[6].node_id: [(8, -0.1)]})
    l3 = grow(tree, {l2[7].node_id: [(9, -0.3)], l2[8].node_id: [(10, -0.1)]})
    old_root = tree.root_id
    pos9 = tree.node(l3[9].node_id).position

    res = tree.verify(5)
    assert res.hit and res.token == 5 and res.position == 3
    assert res.committed_id == l1[5].node_id == tree.root_id != old_root
    assert set(res.pruned) == {l1[6].node_id, l2[8].node_id, l3[10].node_id}
    assert res.surviving == (l2[7].node_id, l3[9].node_id)
    assert committed(tree) == (11, 12, 13, 5)
    assert l1[6].node_id not in tree and not is_live(tree, l2[8].node_id)
    # positions stay, depths and scores are re-based on the new root
    assert tree.node(l3[9].node_id).position == pos9 and tree.depth_of(l3[9].node_id) == 2
    assert tree.root.score == 0.0 and tree.root.parent is None
    assert l2[7].score == pytest.approx(-0.2) and l3[9].score == pytest.approx(-0.5)
    assert tree.ancestors(l3[9].node_id) == [l2[7].node_id, l3[9].node_id]
    assert (tree.hits, tree.verifications) == (1, 1)


def test_verify_miss_makes_fresh_root_and_drops_everything():
    tree = TokenTree(PROMPT, width=4)
    l1 = grow(tree, {tree.root_id: [(5, -0.5), (6, -1.0)]})
    grow(tree, {l1[5].node_id: [(7, -0.2)]})
    highest = max(n.node_id for n in tree.live_nodes())

    res = tree.verify(42)
    assert not res.hit and res.surviving == () and len(res.pruned) == 3
    assert res.committed_id == tree.root_id > highest
    assert tree.root.token == 42 and tree.root.position == 3 and tree.root_target() is None
    assert tree.num_live() == 0 and [n.node_id for n in tree.frontier()] == [tree.root_id]
    assert committed(tree) == (11, 12, 13, 42)
    assert (tree.hits, tree.verifications) == (0, 1)


def test_hit_on_a_leaf_child_leaves_an_empty_tree():
    tree = TokenTree(PROMPT, width=4)
    l1 = grow(tree, {tree.root_id: [(5, -0.5), (6, -1.0)]})
    res = tree.verify(6)
    assert res.hit and res.surviving == () and res.pruned == (l1[5].node_id,)
    assert [n.node_id for n in tree.frontier()] == [l1[6].node_id]


def test_frontier_after_hit_is_deepest_surviving_layer():
    tree = TokenTree(PROMPT, width=1)
    l1 = grow(tree, {tree.root_id: [(5, -0.1), (6, -9.0)]})  # width 1: only 5 kept
    assert set(l1) == {5}
    tree.width = 2
    l2 = grow(tree, {l1[5].node_id: [(7, -0.1), (8, -0.2)]})
    tree.verify(5)
    assert {n.node_id for n in tree.frontier()} == {l2[7].node_id, l2[8].node_id}


def test_recorded_targets():
    tree = TokenTree(PROMPT, width=2)
    l1 = grow(tree, {tree.root_id: [(5, -0.1)]})
    assert tree.root_target() is None
    tree.record_target(tree.root_id, 5)
    tree.record_target(l1[5].node_id, 9)
    assert tree.root_target() == 5
    with pytest.raises(ValueError):
        tree.verify(6)  # disagrees with what the last stage reported
    tree.verify(tree.root_target())
    assert tree.root_target() == 9  # the new root was already computed: verify is due again


def test_committed_since_reads_only_the_new_tokens():
    tree = TokenTree(PROMPT, width=2)
    assert tree.committed_since(0) == PROMPT and tree.committed_since(3) == []
    grow(tree, {tree.root_id: [(5, -0.1)]})
    tree.verify(5)
    tree.verify(8)
    assert tree.committed_since(3) == [5, 8] and tree.num_committed == 5
    got = tree.committed_since(4)
    got.append(99)  # a copy of the tail: the tree is not changed through it
    assert committed(tree) == (11, 12, 13, 5, 8)
    for bad in (-1, 6):
        with pytest.raises(IndexError):
            tree.committed_since(bad)


# ---- random operation sequences against a reference model ------------------------------------

TOKENS = st.integers(0, 5)  # a tiny vocabulary: duplicates, hits and misses all happen often
LOGPROBS = st.one_of(st.sampled_from([0.0, -0.5, -1.0, -2.0, -math.inf]),
                     st.floats(-8.0, 0.0, allow_nan=False))


class Reference:
    """What the tree must equal, recomputed from facts recorded when nodes were made."""

    def __init__(self, tree):
        self.prompt = list(committed(tree))
        self.verified = []
        self.parent = {}     # node id -> parent id at creation (root for layer 1)
        self.token = {}
        self.position = {}
        self.logprob = {}
        self.live = set()
        self.root = tree.root_id
        self.root_pos = tree.root.position
        self.ids_seen = {tree.root_id}
        self.hits = 0
        self.max_width = tree.width  # the live-count bound holds for the widest layer ever made

    def fresh(self, node_id):
        assert node_id not in self.ids_seen and node_id > max(self.ids_seen)
        self.ids_seen.add(node_id)

    def chain(self, nid):
        """Ancestors of nid below the root, bottom-up, nid included."""
        out = []
        while nid != self.root:
            out.append(nid)
            nid = self.parent[nid]
        return out

    def path_score(self, nid):
        return sum(self.logprob[i] for i in self.chain(nid))


def check_invariants(tree, ref):
    live = tree.live_nodes()
    ids = [n.node_id for n in live]
    assert set(ids) == ref.live and ids == sorted(ids)
    assert tree.num_live() == len(ids)
    assert committed(tree) == tuple(ref.prompt + ref.verified)
    assert tree.committed_since(len(ref.prompt)) == ref.verified and tree.num_committed == len(committed(tree))
    assert tree.root_id == ref.root and tree.root.position == len(committed(tree)) - 1
    assert tree.root.parent is None and tree.root.token == committed(tree)[-1]
    assert tree.num_live() <= ref.max_width * tree.max_depth()
    assert (tree.hits, tree.verifications) == (ref.hits, len(ref.verified))
    for n in live:
        # no orphans: the parent is live or the root, and depth grows by one per edge
        assert n.parent == ref.parent[n.node_id]
        assert n.parent == tree.root_id or n.parent in ref.live
        assert tree.depth_of(n.node_id) == tree.depth_of(n.parent) + 1
        # positions are fixed for life and agree with depth below the current root
        assert tree.node(n.node_id).position == ref.position[n.node_id]
        assert tree.node(n.node_id).position == tree.root.position + tree.depth_of(n.node_id)
        assert tree.ancestors(n.node_id) == ref.chain(n.node_id)[::-1]
        assert tree.path_tokens(n.node_id) == [ref.token[i] for i in ref.chain(n.node_id)[::-1]]
        expect = ref.path_score(n.node_id)
        assert n.score == pytest.approx(expect, abs=1e-9) or (math.isinf(expect) and n.score == expect)
    depths = [tree.depth_of(i) for i in ids]
    for d in set(depths):
        assert [n.node_id for n in tree.layer(d)] == [i for i, dd in zip(ids, depths) if dd == d]
    assert {n.node_id for n in tree.frontier()} == (
        {i for i, d in zip(ids, depths) if d == max(depths)} if ids else {tree.root_id})


def do_expand(tree, ref, data):
    frontier = [n.node_id for n in tree.frontier()]
    parents = data.draw(st.lists(st.sampled_from(frontier), unique=True, min_size=1), label="parents")
    proposals = {p: data.draw(st.lists(st.tuples(TOKENS, LOGPROBS), max_size=6), label="cands")
                 for p in parents}
    before = set(ref.live)
    new = tree.expand(proposals)
    # best logprob per (parent, token), then check the top-W property independently of tie order
    best = {}
    for p, cands in proposals.items():
        for t, lp in cands:
            best[(p, t)] = max(lp, best.get((p, t), -math.inf))
    assert len(new) == min(tree.width, len(best))
    chosen = {(n.parent, n.token) for n in new}
    assert len(chosen) == len(new)
    scores = {k: (ref.path_score(k[0]) if k[0] != ref.root else 0.0) + lp for k, lp in best.items()}
    if len(new) < len(best):
        worst_kept = min(scores[k] for k in chosen)
        best_dropped = max(scores[k] for k in best if k not in chosen)
        assert worst_kept >= best_dropped - 1e-9
    for n in new:
        ref.fresh(n.node_id)
        assert n.logprob == best[(n.parent, n.token)]
        assert n.target is None
        ref.parent[n.node_id] = n.parent
        ref.token[n.node_id] = n.token
        ref.logprob[n.node_id] = n.logprob
        ref.position[n.node_id] = tree.node(n.parent).position + 1
        ref.live.add(n.node_id)
    assert not (before - ref.live)


def do_verify(tree, ref, data):
    children = {ref.token[i]: i for i in ref.live if ref.parent[i] == ref.root}
    x = data.draw(st.sampled_from(sorted(children)) if children and data.draw(st.booleans(), label="aim")
                  else TOKENS, label="target")
    res = tree.verify(x)
    ref.verified.append(x)
    if x in children:
        c = children[x]
        assert res.hit and res.committed_id == c
        ref.hits += 1
        survivors = {i for i in ref.live if i != c and c in ref.chain(i)}
        ref.root = c  # scores are now summed from c down: its own logprob no longer counts
    else:
        assert not res.hit
        ref.fresh(res.committed_id)
        ref.root = res.committed_id
        survivors = set()
    assert set(res.surviving) == survivors and list(res.surviving) == sorted(survivors)
    assert set(res.pruned) == ref.live - survivors - {ref.root}
    assert not set(res.pruned) & set(res.surviving)
    assert res.token == x and res.position == len(ref.prompt) + len(ref.verified) - 1
    for i in res.pruned:
        assert i not in tree
    ref.live = survivors


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(TOKENS, min_size=1, max_size=4), width=st.integers(1, 5), data=st.data())
def test_random_expand_verify_sequences(prompt, width, data):
    tree = TokenTree(prompt, width=width)
    ref = Reference(tree)
    check_invariants(tree, ref)
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        op = data.draw(st.sampled_from(["expand"] * 3 + ["verify"] * 2 + ["width"]), label="op")
        if op == "expand":
            do_expand(tree, ref, data)
        elif op == "verify":
            do_verify(tree, ref, data)
        else:
            tree.width = data.draw(st.integers(1, 5), label="new width")
            ref.max_width = max(ref.max_width, tree.width)
        check_invariants(tree, ref)
