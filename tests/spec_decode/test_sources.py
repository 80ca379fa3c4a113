"""The model-free sources: the n-gram source (its index against the plain scan it replaced) and
the merged source."""

from __future__ import annotations

import math
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specpipe.spec_decode.sources import MergedSource, NgramIndex, NgramSource, ProposeCall, SourceRows, TokenSource
from specpipe.spec_decode.tree import TokenTree

NO_ROWS = SourceRows([], [], [], [])


def lookup(src: NgramSource, context, k):
    """The source's candidates for the token after `context` alone (no request, nothing kept)."""
    index = NgramIndex(src.min_n, src.max_n)
    index.extend(context)
    return src._candidates(index, [], k)


def scan_lookup(context, k, min_n, max_n):
    """The n-gram source as it was before the index: scan the whole context for every query.
    The indexed source must propose exactly this (the step-count regression depends on it)."""
    L = len(context)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = list(context[L - n:])
        follow: Counter = Counter()
        for i in range(L - n - 1, -1, -1):
            if list(context[i:i + n]) == suffix:
                follow[context[i + n]] += 1
        if follow:
            total = sum(follow.values())
            penalty = math.log(n / max_n)
            ranked = sorted(follow.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
            return [(tok, math.log(c / total) + penalty) for tok, c in ranked]
    return []


def scan_propose(tree, want, k, min_n, max_n):
    return {n: scan_lookup(tree.committed_since(0) + tree.path_tokens(n), k, min_n, max_n) for n in want}


# ---- n-gram: examples --------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_longest_match():
    src = NgramSource(max_n=3)
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    cands = lookup(src, ctx, k=4)
    assert [t for t, _ in cands] == [7, 9]  # both followed "1 2 3"; ties broken by token id
    assert all(lp <= 0 for _, lp in cands)
    assert lookup(src, [4, 5, 6], k=4) == []


def test_ngram_uses_the_tree_path():
    tree = TokenTree([1, 2, 3, 4, 1, 2], width=4)
    node = tree.expand({tree.root_id: [(3, -0.1)]})[0]
    props = NgramSource().propose(0, tree, NO_ROWS, [node.node_id], 4)
    assert props[node.node_id][0][0] == 4  # "... 1 2 3" was followed by 4


def test_ngram_occurrences_overlapping_the_path_count():
    # The suffix "5 5" occurs across the committed/path boundary and inside the path.
    tree = TokenTree([7, 5], width=1)
    a = tree.expand({tree.root_id: [(5, 0.0)]})[0]
    b = tree.expand({a.node_id: [(5, 0.0)]})[0]
    src = NgramSource(max_n=2)
    got = src.propose(0, tree, NO_ROWS, [b.node_id], 4)[b.node_id]
    assert got == scan_propose(tree, [b.node_id], 4, 1, 2)[b.node_id] == [(5, 0.0)]


def test_ngram_index_follows_commits_and_is_released():
    src = NgramSource(max_n=2)
    tree = TokenTree([1, 2, 1], width=2)
    src.start(3)
    short = math.log(1 / 2)  # the penalty of a 1-gram match when max_n is 2
    assert src.propose(3, tree, NO_ROWS, [tree.root_id], 2) == {tree.root_id: [(2, short)]}
    for tok in (3, 1):  # two misses: "1" is now followed by 2 and by 3
        tree.verify(tok)
    got = src.propose(3, tree, NO_ROWS, [tree.root_id], 2)
    half = math.log(0.5) + short
    assert got == scan_propose(tree, [tree.root_id], 2, 1, 2) == {tree.root_id: [(2, half), (3, half)]}
    src.finish(3)
    assert 3 not in src._requests  # nothing kept for a finished request


def test_ngram_starts_lazily_and_never_mixes_requests():
    src = NgramSource(max_n=2)
    t1, t2 = TokenTree([4, 5, 4], width=2), TokenTree([4, 6, 4], width=2)
    assert src.propose(1, t1, NO_ROWS, [t1.root_id], 2)[t1.root_id][0][0] == 5  # never started
    assert src.propose(2, t2, NO_ROWS, [t2.root_id], 2)[t2.root_id][0][0] == 6
    # The same id with another tree (a caller that did not finish the first): a fresh index.
    assert src.propose(1, t2, NO_ROWS, [t2.root_id], 2)[t2.root_id][0][0] == 6


# ---- n-gram: the index against the scan, on random trees -----------------------------------------

TOKENS = st.integers(0, 3)  # a tiny vocabulary: repeated n-grams everywhere


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(TOKENS, min_size=1, max_size=12), sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)),
       k=st.integers(1, 5), width=st.integers(1, 4), data=st.data())
def test_indexed_proposals_equal_the_scan(prompt, sizes, k, width, data):
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    src = NgramSource(max_n=max_n, min_n=min_n)
    tree = TokenTree(prompt, width=width)
    if data.draw(st.booleans(), label="start"):
        src.start(0)
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        if data.draw(st.booleans(), label="verify") and tree.num_live():
            children = sorted({n.token for n in tree.layer(1)})
            tree.verify(data.draw(st.sampled_from(children) | TOKENS, label="target"))
        want = [n.node_id for n in tree.frontier()]
        if data.draw(st.booleans(), label="all nodes"):
            want = [tree.root_id] + [n.node_id for n in tree.live_nodes()]
        got = src.propose(0, tree, NO_ROWS, want, k)
        assert got == scan_propose(tree, want, k, min_n, max_n)  # same candidates, order and scores
        frontier = {n.node_id for n in tree.frontier()}
        tree.expand({n: p for n, p in got.items() if n in frontier})
    src.finish(0)
    assert not src._requests


@settings(max_examples=200, deadline=None)
@given(context=st.lists(TOKENS, max_size=20), min_n=st.integers(1, 3), extra=st.integers(0, 3), k=st.integers(1, 4))
def test_lookup_equals_the_scan(context, min_n, extra, k):
    assert lookup(NgramSource(max_n=min_n + extra, min_n=min_n), context, k) == scan_lookup(context, k, min_n, min_n + extra)


# ---- merged ----------------------------------------------------------------------------------------

class Fixed(TokenSource):
    def __init__(self, cands):
        self.cands = cands
        self.batches = 0

    def propose(self, request_id, tree, rows, want, k):
        return {n: self.cands for n in want}

    def propose_many(self, calls):
        self.batches += 1
        return super().propose_many(calls)


def test_merged_source_keeps_the_best_score_per_token():
    m = MergedSource([Fixed([(1, -2.0), (2, -0.5)]), Fixed([(1, -0.1), (3, -3.0)])])
    got = m.propose(0, None, None, [0], k=3)[0]
    assert got == [(1, -0.1), (2, -0.5), (3, -3.0)]
    assert not any(math.isnan(lp) for _, lp in got)


def test_merged_propose_many_calls_each_source_once():
    fixed = [Fixed([(1, -2.0), (2, -0.5)]), Fixed([(1, -0.1), (3, -3.0)])]
    ngram = NgramSource(max_n=2)
    m = MergedSource(fixed + [ngram])
    trees = [TokenTree([1, 2, 1], width=2), TokenTree([4, 7, 4], width=2)]
    calls = [ProposeCall(rid, t, NO_ROWS, [t.root_id], k) for rid, t, k in ((5, trees[0], 3), (6, trees[1], 4))]
    got = m.propose_many(calls)
    assert [f.batches for f in fixed] == [1, 1]
    assert got == [m.propose(c.request_id, c.tree, c.rows, c.want, c.k) for c in calls]
    assert got[0][trees[0].root_id] == [(1, -0.1), (2, -0.5), (3, -3.0)]
    assert got[1][trees[1].root_id] == [(1, -0.1), (2, -0.5), (7, math.log(1 / 2)), (3, -3.0)]  # 7: the n-gram's
