"""Sampling parameters and the target's token choice, identical in every decoding mode.

Why the RNG is keyed by (seed, absolute position): speculative modes compute the target's token
for a position several times over different trees, and plain decoding computes it once. Drawing
the uniform number for position p from a generator seeded by (seed, p) makes the token a pure
function of the target's distribution at p, so every mode commits exactly the same sequence.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import secrets
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch


# -- structured output: what the output must match (compiled and enforced by specpipe/grammar/) ---


class GrammarSpecError(ValueError):
    """A constraint that cannot be used; the message says what is wrong (a server answers 400)."""


KINDS = ("json_schema", "json_object", "regex", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a constraint larger than this is refused (1 MiB of schema or grammar text)


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of the four kinds. `json_schema` is kept as compact JSON text (key order kept: llguidance emits properties in it),
    so two equal schemas share one compiled grammar; `grammar` is Lark or GBNF (as llama.cpp)."""

    json_schema: Optional[str] = None
    json_object: bool = False
    regex: Optional[str] = None
    grammar: Optional[str] = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise GrammarSpecError(f"give exactly one of {', '.join(KINDS)} (got {', '.join(given) or 'none'})")
        if self.json_schema is not None:
            object.__setattr__(self, "json_schema", canonical_schema(self.json_schema))
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v.strip()):
                raise GrammarSpecError(f"{k} must be a non-empty string")
            if v is not None and len(v) > MAX_SPEC_CHARS:
                raise GrammarSpecError(f"{k} is longer than {MAX_SPEC_CHARS} characters")

    @classmethod
    def of_schema(cls, schema: Any) -> "StructuredOutput":
        return cls(json_schema=schema)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def schema(self) -> Optional[dict]:
        """The JSON schema the output must validate against (None for a regex or grammar)."""
        if self.json_schema is not None:
            return json.loads(self.json_schema)
        return {"type": "object"} if self.json_object else None


def canonical_schema(schema: Any) -> str:
    """A schema (dict, or JSON text of one) as canonical JSON text; GrammarSpecError if it is none."""
    if isinstance(schema, str):
        if len(schema) > MAX_SPEC_CHARS:
            raise GrammarSpecError(f"json_schema is longer than {MAX_SPEC_CHARS} characters")
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarSpecError(f"json_schema is not valid JSON: {e}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarSpecError(f"json_schema must be a JSON object, got {type(schema).__name__}")
    text = json.dumps(schema, separators=(",", ":"))  # key order kept: it is the properties' order
    if len(text) > MAX_SPEC_CHARS:
        raise GrammarSpecError(f"json_schema is longer than {MAX_SPEC_CHARS} characters")
    return text


# Bounds of the sampling parameters, checked when a request is made (the server's schema says
# the same): every value crosses the links as an int64 and indexes tensors at the last stage, so
# one out of range would fail a step of the whole pipeline, not just its own request.
# 2**53: exact as a double, so a JSON schema that carries bounds as floats states this number.
MAX_TOP_K = 2**53  # any k at or past the vocabulary keeps every token
MAX_TOKENS = 2**53  # (the context and the KV pool bound it far lower, with the prompt)
INT64_MAX = 2**63 - 1
MAX_TEMPERATURE = 1e4  # beyond it the distribution is uniform to float precision
# Below this a temperature is greedy: logits / 1e-300 overflow to inf and softmax gives NaN,
# while argmax is the limit of sampling as the temperature goes to 0 (vLLM's _SAMPLING_EPS).
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # top log-probabilities a request may ask for per token (OpenAI's bound)
MAX_REPETITION_PENALTY = 100.0  # (vLLM takes any positive value; beyond this every seen token is cut)
MAX_LOGIT_BIAS = 1024  # token ids one request may bias (OpenAI takes 300)


def _check_int(name: str, v: Any, lo: int, hi: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")


def _check_float(name: str, v: Any, lo: float, hi: float, lo_open: bool = False) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi
    if not ok or (lo_open and v == lo):
        raise ValueError(f"{name} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: Optional[int] = None  # None: a random seed is drawn per request (see resolved())
    max_tokens: int = 128
    stop: tuple[str, ...] = ()  # strings that end the output (driver side; not part of the output)
    structured: Optional[StructuredOutput] = None  # the output must match it (specpipe/grammar/)
    # Log-probabilities of each output token and of the `logprobs` most likely ones at its place
    # (0: the token's own only; None: none are computed). See `target_logprobs` for which.
    logprobs: Optional[int] = None
    # The same for each prompt token after the first (vLLM's prompt_logprobs): None, or how many
    # top ones with each. Its prompt then skips the prefix cache (every row's logits are needed).
    prompt_logprobs: Optional[int] = None
    # Penalties and biases (vLLM's semantics; applied at the last stage to each row's logits over
    # that row's own path, specpipe/penalties.py): presence and frequency over the generated
    # tokens, repetition over prompt + generated, logit_bias ((token id, bias) pairs, added
    # first), min_p (tokens below min_p times the top probability after temperature are cut).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(x, str) or not x for x in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, 0, MAX_TOP_K)
        _check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, INT64_MAX)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, lo_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        bias = tuple(sorted((t, b) for t, b in bias))
        if len(bias) > MAX_LOGIT_BIAS or len({t for t, _ in bias}) != len(bias):
            raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} distinct token ids")
        for t, b in bias:
            _check_int("a logit_bias token id", t, 0, INT64_MAX)
            _check_float("a logit_bias value", b, -100.0, 100.0)
        object.__setattr__(self, "logit_bias", bias)

    @property
    def penalized(self) -> bool:
        """Whether the row's own path changes its logits (the driver then ships it, penalties.py)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

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
    if params.min_p > 0:  # vLLM's rule: below min_p times the row's top probability, cut
        probs = probs * (probs >= params.min_p * probs.max(dim=-1, keepdim=True).values)
        probs = probs / probs.sum(dim=-1, keepdim=True)
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


@dataclass(frozen=True)
class TokenLogprobs:
    """One output token's log-probability and the top ones at its position (most likely first)."""

    logprob: float  # of the token the target chose
    top_ids: tuple[int, ...] = ()  # (k,)
    top_logprobs: tuple[float, ...] = ()  # (k,) descending


def target_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[TokenLogprobs]:
    """For each row: log p(token) and the k largest log p, where p = softmax(logits) is the
    target's raw distribution at that position: before temperature, top-k/top-p/min_p, penalties,
    logit_bias and any grammar mask (as vLLM returns by default, its "raw_logprobs"), so the values do not depend on how the
    token was chosen. logits: (N, V), tokens: (N,). Each row alone, in float32: a row's values are
    a function of its logits only, whatever rows share the step."""
    out = []
    for i, token in enumerate(tokens):
        lp = torch.log_softmax(logits[i].float(), dim=-1)  # (V,)
        top_lp, top_ids = lp.topk(k) if k else (lp[:0], lp[:0].long())
        out.append(TokenLogprobs(float(lp[token]), tuple(top_ids.tolist()), tuple(top_lp.tolist())))
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
