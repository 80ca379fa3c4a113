"""Stage layer counts balanced by measured cost (`--stage-layers balanced`).

The even split gives every stage the same number of decoder layers, but the last stage also
computes the final norm and the LM head, which on a model with a large vocabulary costs several
layers (Qwen2.5-1.5B on a CPU: a 151936 x 1536 head is ~5 layers' time). Every step waits for the
slowest stage, so SpecPipe's step, and pp-cb's throughput, follow that stage. Here the counts are
chosen from a cost profile so that the slowest stage is as fast as it can be: layers cost the
same on every stage, so only how many the last stage keeps matters; the others share the rest
evenly (earlier stages take the remainder, as in the even split).
"""

from __future__ import annotations

from specpipe.costs.profile import CostProfile
from specpipe.loader.partition import partition_layers

BALANCED = "balanced"


def balanced_stage_layers(profile: CostProfile, num_layers: int, num_stages: int,
                          rows: int = 1, context: int = 256) -> list[int]:
    """Layer counts per stage (summing to num_layers) whose slowest stage, for `rows` rows at
    `context`, is the fastest; among equals, the one nearest the even split."""
    if profile.num_layers and profile.num_layers != num_layers:
        raise ValueError(f"the cost profile is of a model with {profile.num_layers} layers, this one has {num_layers}")
    even = [s.end - s.start for s in partition_layers(num_layers, num_stages)]
    if num_stages == 1:
        return even

    def slowest(counts: list[int]) -> float:
        return max(profile.stage(n, s == num_stages - 1, rows, context) for s, n in enumerate(counts))

    best, best_key = even, (slowest(even), 0)
    for last in range(1, num_layers - num_stages + 2):
        counts = [s.end - s.start for s in partition_layers(num_layers - last, num_stages - 1)] + [last]
        key = (slowest(counts), abs(last - even[-1]))
        if key < best_key:
            best, best_key = counts, key
    return best


def resolve_stage_layers(stage_layers, profile, num_layers: int, num_stages: int, mode: str, width: int):
    """--stage-layers as given (counts, or None for the even split), or "balanced": counts from
    the cost profile (balanced_stage_layers) for the rows a step of `mode` sends: a tree layer's
    `width` in the speculative modes, one row per request otherwise."""
    from specpipe.config import SPECULATIVE_MODES, ConfigError

    if stage_layers != BALANCED:
        return stage_layers
    if profile is None:
        raise ConfigError("--stage-layers balanced needs a --cost-profile to balance the stages by")
    try:
        return balanced_stage_layers(profile, num_layers, num_stages, width if mode in SPECULATIVE_MODES else 1)
    except ValueError as e:
        raise ConfigError(f"--stage-layers balanced: {e}") from None
