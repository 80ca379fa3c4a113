"""Sampling keyed by (seed, position)."""

import pytest
import torch

from specpipe.sampling import SamplingParams, position_uniform, target_tokens


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


# The n-gram and merged sources are tested in tests/spec_decode/test_sources.py.
