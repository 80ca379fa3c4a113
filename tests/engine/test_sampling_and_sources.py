"""Sampling keyed by (seed, position), and the model-free speculative sources."""

import math

import pytest
import torch

from specpipe.sampling import SamplingParams, position_uniform, target_tokens
from specpipe.spec_decode.sources import MergedSource, NgramSource, SourceRows, TokenSource
from specpipe.spec_decode.tree import TokenTree


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    assert target_tokens(logits, [4, 9], SamplingParams()) == [1, 0]


def test_sample_depends_only_on_distribution_seed_and_position():
    torch.manual_seed(0)
    row = torch.randn(1, 50)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    alone = target_tokens(row, [17], p)
    batched = target_tokens(torch.cat([torch.randn(3, 50), row]), [1, 2, 3, 17], p)
    assert batched[-1] == alone[0]
    draws = {target_tokens(row, [pos], p)[0] for pos in range(40)}
    assert len(draws) > 1  # different positions draw different numbers


def test_top_k_and_top_p_truncate():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for pos in range(200):
        assert target_tokens(logits, [pos], SamplingParams(temperature=1.0, top_k=2, seed=1))[0] in (0, 1)
        assert target_tokens(logits, [pos], SamplingParams(temperature=1.0, top_p=0.7, seed=1))[0] in (0, 1)


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([[0.6, 0.3, 0.1]])
    p = SamplingParams(temperature=1.0, seed=3)
    counts = [0, 0, 0]
    for pos in range(3000):
        counts[target_tokens(probs.log(), [pos], p)[0]] += 1
    assert abs(counts[0] / 3000 - 0.6) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03


def test_position_uniform_is_deterministic_and_in_range():
    u = [position_uniform(9, k) for k in range(1000)]
    assert u == [position_uniform(9, k) for k in range(1000)]
    assert all(0.0 <= x < 1.0 for x in u)
    assert abs(sum(u) / len(u) - 0.5) < 0.05


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-1), dict(max_tokens=0)])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_ngram_proposes_what_followed_the_longest_match():
    src = NgramSource(max_n=3)
    ctx = [1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3]
    cands = src.lookup(ctx, k=4)
    assert [t for t, _ in cands] == [7, 9]  # both followed "1 2 3"; ties broken by token id
    assert all(lp <= 0 for _, lp in cands)
    assert src.lookup([4, 5, 6], k=4) == []


def test_ngram_uses_the_tree_path():
    tree = TokenTree([1, 2, 3, 4, 1, 2], width=4)
    node = tree.expand({tree.root_id: [(3, -0.1)]})[0]
    props = NgramSource().propose(0, tree, SourceRows([], [], [], []), [node.node_id], 4)
    assert props[node.node_id][0][0] == 4  # "... 1 2 3" was followed by 4


class Fixed(TokenSource):
    def __init__(self, cands):
        self.cands = cands

    def propose(self, request_id, tree, rows, want, k):
        return {n: self.cands for n in want}


def test_merged_source_keeps_the_best_score_per_token():
    m = MergedSource([Fixed([(1, -2.0), (2, -0.5)]), Fixed([(1, -0.1), (3, -3.0)])])
    got = m.propose(0, None, None, [0], k=3)[0]
    assert got == [(1, -0.1), (2, -0.5), (3, -3.0)]
    assert not any(math.isnan(lp) for _, lp in got)
