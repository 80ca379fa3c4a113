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
