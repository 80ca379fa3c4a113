"""--stage-layers balanced: the last stage's LM head counts, so it keeps fewer layers."""

import pytest

from specpipe.config import ConfigError, EngineConfig
from specpipe.costs.balance import balanced_stage_layers, resolve_stage_layers
from specpipe.costs.profile import CostProfile


def profile(head_ms: float, num_layers: int = 28) -> CostProfile:
    # a layer costs 1 ms at one row and 2 ms at eight; the head costs head_ms and twice that
    return CostProfile("t", [1, 8], [[1.0, 2.0]], [head_ms, 2 * head_ms], model={"num_layers": num_layers})


def slowest(p: CostProfile, counts: list[int], rows: int = 1) -> float:
    return max(p.stage(n, s == len(counts) - 1, rows, 256) for s, n in enumerate(counts))


def test_the_head_takes_layers_off_the_last_stage():
    p = profile(head_ms=4.8)  # Qwen2.5-1.5B's head on a CPU: about 4.8 layers' time
    assert balanced_stage_layers(p, 28, 4) == [8, 8, 8, 4]  # the last: 4 + 4.8 = 8.8 ms; even 7 + 4.8
    assert slowest(p, [8, 8, 8, 4]) < slowest(p, [7, 7, 7, 7])
    counts = balanced_stage_layers(p, 28, 8, rows=8)
    assert sum(counts) == 28 and counts[-1] == 1 and min(counts) >= 1
    # exhaustive check at S = 3: nothing beats it
    best = min(slowest(p, [a, b, 28 - a - b]) for a in range(1, 27) for b in range(1, 28 - a))
    assert slowest(p, balanced_stage_layers(p, 28, 3)) == pytest.approx(best)


def test_a_free_head_keeps_the_even_split():
    p = profile(head_ms=0.0)
    assert balanced_stage_layers(p, 28, 4) == [7, 7, 7, 7]
    assert balanced_stage_layers(profile(0.0, num_layers=30), 30, 4) == [8, 8, 7, 7]
    assert balanced_stage_layers(p, 28, 1) == [28]


def test_balanced_needs_a_profile_of_this_model():
    p = profile(head_ms=4.8)
    assert resolve_stage_layers([20, 8], p, 28, 2, "pp", 8) == [20, 8]
    assert resolve_stage_layers(None, p, 28, 2, "pp", 8) is None
    assert resolve_stage_layers("balanced", p, 28, 4, "specpipe", 8) == balanced_stage_layers(p, 28, 4, rows=8)
    assert resolve_stage_layers("balanced", p, 28, 4, "pp-cb", 8) == balanced_stage_layers(p, 28, 4, rows=1)
    with pytest.raises(ConfigError, match="needs a --cost-profile"):
        resolve_stage_layers("balanced", None, 28, 2, "pp", 8)
    with pytest.raises(ConfigError, match="28 layers, this one has 30"):
        resolve_stage_layers("balanced", p, 30, 2, "pp", 8)
    with pytest.raises(ConfigError, match="needs a --cost-profile"):
        EngineConfig(mode="pp", stages=2, stage_layers="balanced").validate()
    with pytest.raises(ConfigError, match="layer counts or balanced"):
        EngineConfig(mode="pp", stages=2, stage_layers="even").validate()
    EngineConfig(mode="pp-cb", stages=2, stage_layers="balanced", cost_profile="h100-80gb").validate()
