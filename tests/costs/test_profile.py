"""Cost profiles: a layer's cost by the size of the stage it runs in (layer_ms_by_stage)."""

from __future__ import annotations

import pytest

from specpipe.costs.profile import CostProfile


def profile(**extra) -> CostProfile:
    # One context, rows 1 and 8: a layer costs 1 ms / 2 ms on the 4-layer stage it was measured on.
    return CostProfile(device="test", rows=[1, 8], layer_ms=[[1.0, 2.0]], head_ms=[0.5, 1.0],
                       contexts=[64], overhead_ms=[0.1, 0.2], **extra)


def test_without_larger_stages_every_stage_costs_its_layers_at_the_one_measured_cost():
    p = profile()
    assert p.stage(10, False, 1) == pytest.approx(0.1 + 10 * 1.0)
    assert p.layer(1, 64, stage_layers=30) == p.layer(1, 64) == 1.0


def test_a_layer_costs_what_its_stage_size_reads_off_the_measured_sizes():
    p = profile(stage_layers=4, layer_ms_by_stage={"12": [[2.0, 4.0]], "20": [[3.0, 4.0]]})
    assert p.layer(1, 64, stage_layers=2) == 1.0  # below the smallest size: that size's cost
    assert p.layer(1, 64, stage_layers=4) == 1.0
    assert p.layer(1, 64, stage_layers=8) == pytest.approx(1.5)  # halfway between 4 and 12
    assert p.layer(8, 64, stage_layers=16) == pytest.approx(4.0)
    assert p.layer(1, 64, stage_layers=40) == 3.0  # past the largest: flat, not extrapolated
    assert p.stage(16, True, 1) == pytest.approx(0.1 + 16 * 2.5 + 0.5)
    again = CostProfile.from_json(p.to_json())
    assert again.layer_ms_by_stage == p.layer_ms_by_stage and again.stage_layers == 4


def test_bad_stage_tables_are_refused():
    with pytest.raises(ValueError, match="larger than stage_layers"):
        profile(stage_layers=4, layer_ms_by_stage={"4": [[1.0, 2.0]]})
    with pytest.raises(ValueError, match="larger than stage_layers"):
        profile(layer_ms_by_stage={"8": [[1.0, 2.0]]})  # the base size not recorded
    with pytest.raises(ValueError, match=r"layer_ms_by_stage\[8\] must be 1 contexts x 2 rows"):
        profile(stage_layers=4, layer_ms_by_stage={"8": [[1.0]]})


def idle_profile() -> CostProfile:
    # After idling 0 / 10 / 50 ms: a layer of a 4-layer stage costs 0 / 0.2 / 0.4 ms more, of a
    # 12-layer stage 0 / 0.1 / 0.2; the head 0 / 1 / 2 ms more.
    return profile(idle_gaps_ms=[0, 10, 50], idle_layer_ms={"4": [0.0, 0.2, 0.4], "12": [0.0, 0.1, 0.2]},
                   idle_head_ms=[0.0, 1.0, 2.0])


def test_a_step_after_an_idle_gap_costs_what_the_idle_tables_say():
    p = idle_profile()
    assert p.idle(4, False, 0.0) == 0.0
    assert p.idle(4, False, 10.0) == pytest.approx(4 * 0.2)
    assert p.idle(4, False, 30.0) == pytest.approx(4 * 0.3)  # linear between the gaps
    assert p.idle(4, False, 500.0) == pytest.approx(4 * 0.4)  # flat past the last gap
    assert p.idle(8, True, 10.0) == pytest.approx(8 * 0.15 + 1.0)  # between the sizes, with the head
    assert p.idle(30, False, 50.0) == pytest.approx(30 * 0.2)  # past the largest size: its cost
    assert profile().idle(4, True, 50.0) == 0.0  # no tables: back to back
    again = CostProfile.from_json(p.to_json())
    assert (again.idle_gaps_ms, again.idle_layer_ms, again.idle_head_ms) == (p.idle_gaps_ms, p.idle_layer_ms,
                                                                              p.idle_head_ms)


def test_bad_idle_tables_are_refused():
    with pytest.raises(ValueError, match="ascending"):
        profile(idle_gaps_ms=[10, 0], idle_head_ms=[0.0, 1.0])
    with pytest.raises(ValueError, match=r"idle_layer_ms\[4\] must have one entry per idle gap"):
        profile(idle_gaps_ms=[0, 10], idle_layer_ms={"4": [0.0]}, idle_head_ms=[0.0, 1.0])
    with pytest.raises(ValueError, match="idle_head_ms must have one entry per idle gap"):
        profile(idle_gaps_ms=[0, 10], idle_layer_ms={"4": [0.0, 1.0]})


def test_the_head_costs_what_its_last_stage_size_reads_off_the_measured_sizes():
    # head_ms (0.5 / 1.0 ms at 1 / 8 rows) was measured on a last stage of 1 layer; on last stages
    # of 4 and 12 layers it cost 1.5 / 2.0 and 2.5 / 3.0 ms.
    p = profile(head_ms_by_stage={"4": [1.5, 2.0], "12": [2.5, 3.0]})
    assert p.head(1) == 0.5 and p.head(1, 1) == 0.5
    assert p.head(1, 4) == 1.5
    assert p.head(8, 8) == pytest.approx(2.5)  # halfway between 4 and 12
    assert p.head(1, 40) == 2.5  # past the largest: flat
    assert p.stage(4, True, 1) == pytest.approx(0.1 + 4 * 1.0 + 1.5)
    assert CostProfile.from_json(p.to_json()).head_ms_by_stage == p.head_ms_by_stage
    with pytest.raises(ValueError, match=r"head_ms_by_stage\[4\] must have 2 entries"):
        profile(head_ms_by_stage={"4": [1.5]})
