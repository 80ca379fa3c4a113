"""`--layers-per-step auto`'s planner: expected tokens per step, the hit profile, step costs."""

from __future__ import annotations

from pathlib import Path

import pytest

from specpipe.costs.profile import CostProfile, load_profile
from specpipe.spec_decode.planner import (PRIOR_VERIFICATIONS, HitProfile, StepCost, expected_tokens_per_step,
                                          plan_block)

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_expected_tokens_by_hand():
    # d = 1: one token per verification step, and a miss (1 - h) costs S - 1 steps of refill.
    assert expected_tokens_per_step(0.5, 1, 8) == pytest.approx(1 / (1 + 0.5 * 7))
    # d = 2, h = 0.5: 1.5 tokens a step, a miss with probability 0.75.
    assert expected_tokens_per_step(0.5, 2, 8) == pytest.approx(1.5 / (1 + 0.75 * 7))
    assert expected_tokens_per_step(1.0, 4, 8) == 4.0  # every token hit: d per step
    assert expected_tokens_per_step(0.0, 4, 8) == pytest.approx(1 / 8)  # pp: one token per S steps
    assert expected_tokens_per_step(0.3, 3, 1) == pytest.approx(1 + 0.3 + 0.09)  # S = 1: no refill
    rates = [expected_tokens_per_step(0.9, d, 8) for d in range(1, 9)]
    assert rates == sorted(rates)  # deeper never loses in steps...
    assert rates[7] - rates[6] < rates[1] - rates[0]  # ...but gains less and less


def test_hit_profile_scales_the_measured_rate_by_reach():
    hits = HitProfile(8)
    for rank in [0] * 60 + [1] * 20 + [5] * 10 + [None] * 10:
        hits.record(rank, hit=rank is not None and rank < 4)
    # measured 80 hits of 100 at width 4 (with the prior of 8 at 0.8): 86.4 / 108
    measured = (80 + 0.8 * PRIOR_VERIFICATIONS) / (100 + PRIOR_VERIFICATIONS)
    assert hits.hit_rate(4, 4) == pytest.approx(measured)
    # width 8 also reaches the 10 tokens at rank 5: reach 90 + 6.4 against 80 + 6.4
    assert hits.hit_rate(8, 4) == pytest.approx(measured * 96.4 / 86.4)
    assert hits.hit_rate(1, 4) == pytest.approx(measured * 66.4 / 86.4)
    assert HitProfile(4).hit_rate(4, 4) == pytest.approx(0.8)  # nothing measured: the prior


def test_step_cost_is_the_slowest_stage_or_the_drafting():
    rows = [1, 64]
    p = CostProfile("t", rows, [[1.0, 2.0]], [1.0, 1.0], [[0.5, 0.5]], model={"num_layers": 5})
    cost = StepCost(p, 2)  # stages of 3 and 2 layers, the head on the second
    assert cost.step_ms(1, 1, 1, 256) == pytest.approx(3.0)  # 3 layers x 1 ms = 2 layers + head
    assert cost.step_ms(64, 2, 8, 256) == pytest.approx(6.0)
    assert cost.step_ms(1, 10, 8, 256) == pytest.approx(5.0)  # ten draft forwards outlast the stages
    with pytest.raises(ValueError, match="layers"):
        StepCost(CostProfile("t", rows, [[1.0, 2.0]], [1.0, 1.0]), 2)


def test_plans():
    strong, weak = HitProfile(16), HitProfile(16)
    for i in range(200):  # strong: the target's token is in the top 8 nearly always, some at ranks 4-15
        strong.record(0 if i % 10 < 8 else 6 if i % 10 == 8 else 12, hit=i % 10 < 9)
        weak.record(0 if i % 10 < 3 else None, hit=i % 10 < 3)
    # Rows free, drafting hidden: the deepest block, as wide as the reach grows.
    assert plan_block(strong, 16, 8, 8, [16, 8, 4], None, 512) == (8, 16)
    # The draft source's top-1 is all it ever gets right: width buys nothing, the smallest wins.
    assert plan_block(weak, 16, 8, 8, [16, 8, 4], None, 512) == (8, 4)
    # H100 roofline (70B over 8 stages, 1B draft): a draft forward is 1.6 ms against 7.7 ms of the
    # slowest stage, and 16 rows a layer cost next to nothing. Four layers of drafting hide behind
    # the stages; a fifth (8.0 ms) outlasts them a little and still pays, a sixth (9.6 ms) not.
    h100 = StepCost(load_profile("h100-80gb"), 8)
    assert plan_block(strong, 16, 8, 8, [16, 8, 4], h100, 512) == (5, 16)
    # This CPU with float32 weights and the 0.5B draft (41% of the 1.5B target per row, 265 ms
    # for 4 rows): a block of one layer would commit 0.58 tokens per 308 ms, pp a token per
    # 404 ms pass through the 8 stages: no drafting.
    cpu = StepCost(CostProfile.load(RESULTS / "profile_qwen_cpu_t2.json"), 8)
    assert cpu.pass_ms(512) == pytest.approx(404, abs=1)
    assert plan_block(strong, 16, 8, 8, [16, 8, 4], cpu, 512) == (0, 16)


def test_plans_no_drafting_where_the_draft_costs_more_than_it_saves():
    """d = 0 (pp): a token per pass of one row through the stages. Chosen only for a model source
    with a cost profile, where every block is slower per token; never without a profile (rows
    free) or for a source that costs nothing."""
    rows = [1, 64]
    hits = HitProfile(8)
    for i in range(100):
        hits.record(0 if i % 2 else None, hit=bool(i % 2))  # half the target's tokens drafted
    # 8 layers over 4 stages: 2 ms a stage step; a draft forward of 10 ms. Drafting d = 1 gives
    # E(0.5, 1, 4) = 0.4 tokens per 10 ms, pp a token per 8 ms pass: no drafting.
    dear = StepCost(CostProfile("t", rows, [[1.0, 1.0]], [0.0, 0.0], [[10.0, 10.0]], model={"num_layers": 8}), 4)
    assert plan_block(hits, 8, 4, 8, [8, 4, 2], dear, 256) == (0, 8)
    # A draft forward of 1 ms hides behind the stages: draft.
    cheap = StepCost(CostProfile("t", rows, [[1.0, 1.0]], [0.0, 0.0], [[1.0, 1.0]], model={"num_layers": 8}), 4)
    assert plan_block(hits, 8, 4, 8, [8, 4, 2], cheap, 256)[0] >= 1
    assert plan_block(hits, 8, 4, 8, [8, 4, 2], None, 256)[0] >= 1
    # Stopping is for good: with little evidence only a draft that would lose at any hit rate stops.
    few = HitProfile(8)
    for i in range(10):
        few.record(None, hit=False)  # 10 misses: the measured rate says stop, a perfect draft would pay
    fair = StepCost(CostProfile("t", rows, [[1.0, 1.0]], [0.0, 0.0], [[3.0, 3.0]], model={"num_layers": 8}), 4)
    assert plan_block(few, 8, 4, 8, [8, 4, 2], fair, 256)[0] >= 1
    assert plan_block(few, 8, 4, 8, [8, 4, 2], dear, 256) == (0, 8)  # 10 ms a forward: hopeless
    # The same profile for a source that runs no model (n-gram): its proposals cost nothing.
    free = StepCost(CostProfile("t", rows, [[1.0, 1.0]], [0.0, 0.0], [[10.0, 10.0]], model={"num_layers": 8}), 4,
                    draft_cost=False)
    assert plan_block(hits, 8, 4, 8, [8, 4, 2], free, 256)[0] >= 1
