"""A cost profile's contention factor (issue 63): a node that runs other work costs its measured
factor times the idle profile, for stages and the draft alike, and the factor survives a file."""

from __future__ import annotations

import pytest

from specpipe.costs.profile import CostProfile


def profile(**extra) -> CostProfile:
    return CostProfile(device="test", rows=[1, 8], layer_ms=[[1.0, 2.0]], head_ms=[0.5, 1.0],
                       draft_ms=[[0.2, 0.4]], overhead_ms=[0.1, 0.3], model={"num_layers": 4}, **extra)


def test_the_factor_scales_stages_and_the_draft():
    idle, busy = profile(), profile().with_contention(2.5)
    for rows in (1, 4, 8):
        for last in (False, True):
            assert busy.stage(2, last, rows) == pytest.approx(2.5 * idle.stage(2, last, rows))
        assert busy.draft_forward(rows) == pytest.approx(2.5 * idle.draft_forward(rows))
    assert idle.contention == 1.0 and idle.stage(2, True, 1) == pytest.approx(2 * 1.0 + 0.5 + 0.1)


def test_the_factor_survives_a_file_and_must_be_positive(tmp_path):
    p = tmp_path / "busy.json"
    profile().with_contention(1.7).save(p)
    assert CostProfile.load(p).contention == pytest.approx(1.7)
    with pytest.raises(ValueError, match="contention"):
        profile(contention=0.0)
