"""What a finished request gives back: one type for the CLI, the Python API and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from specpipe.request import Request
from specpipe.sampling import TokenLogprobs


@dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's log-probability and its rank at its position (1 = most likely; None for
    a chosen token outside the top k asked for)."""

    logprob: float
    rank: Optional[int] = None


def logprob_dicts(logprobs: list[TokenLogprobs]) -> list[dict[int, Logprob]]:
    """vLLM's per-token {token id: Logprob} (the top k, plus the chosen token), from ours."""
    out = []
    for tok, lp in logprobs:
        d = {t: Logprob(v, r) for r, (t, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), 1)}
        d.setdefault(tok, Logprob(lp.logprob))
        out.append(d)
    return out


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: Optional[list[dict[int, Logprob]]] = None  # vLLM's shape, when SamplingParams.logprobs is set


@dataclass
class RequestOutput:
    """One prompt's result: text, token ids, why it ended (stop | length | abort | error), stats."""

    request_id: int
    prompt: Optional[str]
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict = field(default_factory=dict)
    error: Optional[str] = None
    # One per token when SamplingParams.logprobs is set: the target's raw log-probabilities at its
    # position (sampling.target_logprobs), the same in every mode; None when not asked for.
    logprobs: Optional[list[TokenLogprobs]] = None
    # One per prompt token when SamplingParams.prompt_logprobs is set (the first None), else None.
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None

    @staticmethod
    def of(req: Request, stats: dict, prompt: Optional[str] = None) -> "RequestOutput":
        return RequestOutput(req.request_id, prompt, req.prompt_ids, req.text, list(req.output_ids),
                             req.finish_reason or "length", stats, req.error,
                             None if req.sampling.logprobs is None else list(req.output_logprobs),
                             None if req.sampling.prompt_logprobs is None else list(req.prompt_logprobs))

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's shape (`out.outputs[0].text`), for code written against it."""
        lps = None if self.logprobs is None else logprob_dicts(list(zip(self.token_ids, self.logprobs)))
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, lps)]

    def as_dict(self) -> dict:
        """`specpipe generate --json`'s object."""
        return {"text": self.text, "prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "stats": self.stats}
