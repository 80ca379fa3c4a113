"""Split a model's layers into pipeline stages."""

from __future__ import annotations

from typing import Optional, Sequence

from specpipe.config import ConfigError, StageSpec


def partition_layers(num_layers: int, num_stages: int,
                     stage_layers: Optional[Sequence[int]] = None) -> list[StageSpec]:
    """Even split by default (earlier stages take the remainder), or the explicit layer counts."""
    if num_stages < 1:
        raise ConfigError(f"--stages must be at least 1, got {num_stages}")
    if num_stages > num_layers:
        raise ConfigError(f"--stages {num_stages} is more than the model's {num_layers} layers")
    if stage_layers is None:
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    else:
        counts = list(stage_layers)
        if len(counts) != num_stages:
            raise ConfigError(f"--stage-layers lists {len(counts)} stages but --stages is {num_stages}")
        if any(c < 1 for c in counts):
            raise ConfigError(f"--stage-layers: every stage needs at least one layer, got {counts}")
        if sum(counts) != num_layers:
            raise ConfigError(
                f"--stage-layers sums to {sum(counts)} but the model has {num_layers} layers")
    specs, start = [], 0
    for s, c in enumerate(counts):
        specs.append(StageSpec(start, start + c, first=s == 0, last=s == num_stages - 1))
        start += c
    return specs


def parse_stage_layers(text: Optional[str]) -> Optional[list[int] | str]:
    """'8,8,7,7' -> [8, 8, 7, 7]; 'balanced' stays a word (costs/balance.py resolves it)."""
    if not text:
        return None
    if text == "balanced":
        return text
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError(f"--stage-layers must be comma-separated integers, got {text!r}") from None
