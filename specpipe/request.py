"""One generation request as the driver tracks it, and the stats reported for it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from specpipe.sampling import SamplingParams

TokenCallback = Callable[[int], None]


@dataclass
class DecodeStats:
    """Step-level counters; see SPEC §7 for the definitions."""

    pipeline_steps: int = 0
    verifications: int = 0
    hits: int = 0
    hits_by_depth: dict[int, int] = field(default_factory=dict)  # SpecPipe: hits by the depth the token was drafted at
    rounds: int = 0  # tree mode: verification rounds
    live_nodes_sum: int = 0  # sum over steps of the live tree size (for the mean)
    draft_s: float = 0.0  # driver time spent in the speculative source


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    on_token: Optional[TokenCallback] = None
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stats: DecodeStats = field(default_factory=DecodeStats)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int) -> bool:
        """Record one committed output token; True when the request is now finished."""
        if self.finished:
            return True
        self.output_ids.append(token)
        self.token_times.append(time.perf_counter())
        if self.on_token is not None:
            self.on_token(token)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.output_ids) >= self.sampling.max_tokens:
            self.finish_reason = "length"
        return self.finished

    def summary(self, num_stages: int) -> dict:
        s = self.stats
        n = len(self.output_ids)
        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        return {
            "pipeline_steps": s.pipeline_steps,
            "tokens_per_step": n / s.pipeline_steps if s.pipeline_steps else None,
            "hit_rate": s.hits / s.verifications if s.verifications else None,
            "hits_by_depth": {str(k): v for k, v in sorted(s.hits_by_depth.items())} or None,
            "acceptance_length": n / s.rounds if s.rounds else None,
            "mean_live_tree": s.live_nodes_sum / s.pipeline_steps if s.live_nodes_sum else None,
            "ttft_ms": (self.token_times[0] - self.arrival) * 1e3 if n else None,
            "tbt_ms": sum(gaps) / len(gaps) * 1e3 if gaps else None,
            "draft_ms": s.draft_s * 1e3 if s.draft_s else None,
            "num_stages": num_stages,
        }
