"""Sampling parameters and the target's token choice, identical in every decoding mode.

Why the RNG is keyed by (seed, absolute position): speculative modes compute the target's token
for a position several times over different trees, and plain decoding computes it once. Drawing
the uniform number for position p from a generator seeded by (seed, p) makes the token a pure
function of the target's distribution at p, so every mode commits exactly the same sequence.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specpipe.grammar.spec import StructuredOutput


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: Optional[int] = None  # None: a random seed is drawn per request (see resolved())
    max_tokens: int = 128
    stop: tuple[str, ...] = ()  # strings that end the output (driver side; not part of the output)
    structured: Optional[StructuredOutput] = None  # the output must match it (specpipe/grammar/)

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(x, str) or not x for x in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def resolved(self) -> "SamplingParams":
        """The same parameters with a concrete seed, so a sampled run can be reproduced."""
        if self.seed is not None or self.greedy:
            return self
        return dataclasses.replace(self, seed=secrets.randbelow(2**63))


def position_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on (seed, position)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def target_tokens(logits: torch.Tensor, positions: Sequence[int], params: SamplingParams) -> list[int]:
    """The target's token for each row. logits: (N, V) for rows at absolute `positions` (N,)."""
    if params.greedy:
        return logits.argmax(dim=-1).tolist()
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)  # (N, V)
    if params.top_k or params.top_p < 1.0:
        probs = _truncate(probs, params.top_k, params.top_p)
    # Inverse-CDF sampling over a fixed (descending-probability) order so that the draw is a
    # deterministic function of the distribution and the keyed uniform number.
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    cdf = sorted_p.cumsum(dim=-1)
    out = []
    for i, pos in enumerate(positions):
        u = position_uniform(params.seed, pos) * float(cdf[i, -1])
        j = int(torch.searchsorted(cdf[i], torch.tensor([u], dtype=cdf.dtype, device=cdf.device)).item())
        out.append(int(order[i, min(j, cdf.shape[1] - 1)]))
    return out


def _truncate(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    keep = torch.ones_like(sorted_p, dtype=torch.bool)
    if top_k:
        keep[:, top_k:] = False
    if top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = sorted_p.cumsum(dim=-1) - sorted_p
        keep &= before < top_p
    mask = torch.zeros_like(keep).scatter(1, order, keep)
    return probs * mask
