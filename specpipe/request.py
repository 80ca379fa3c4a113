"""One generation request as the driver tracks it, and the stats reported for it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

from specpipe.sampling import SamplingParams, TokenLogprobs

TextCallback = Callable[[str], None]


class Detokenizer(Protocol):
    def add(self, token: int) -> str: ...

    def flush(self) -> str: ...


class Grammar(Protocol):
    """A structured-output request's matcher (specpipe/grammar/matcher.py: RequestGrammar)."""

    closed: bool
    complete: bool  # satisfied, and nothing but the end may follow

    def accept(self, token: int) -> Optional[str]: ...  # None, or why the grammar refuses it

    def close(self) -> None: ...


@dataclass
class DecodeStats:
    """Step-level counters; see docs/design.md §9 for the definitions."""

    pipeline_steps: int = 0  # steps from its first rows entering stage 1 to its last token
    drafted: int = 0  # draft tokens sent into the pipeline (tree nodes)
    verifications: int = 0  # target tokens checked against the tree
    hits: int = 0  # ... that the tree held (accepted draft tokens)
    hits_by_depth: dict[int, int] = field(default_factory=dict)  # hits by the depth the token was drafted at
    verifications_by_depth: dict[int, int] = field(default_factory=dict)  # ... and verifications (specpipe)
    commits_per_step: dict[int, int] = field(default_factory=dict)  # tokens committed in a step -> steps
    block_shapes: dict[str, int] = field(default_factory=dict)  # specpipe: "d x w" of the blocks sent -> steps
    rounds: int = 0  # tree mode: verification rounds
    live_nodes_sum: int = 0  # sum over steps of the live tree size (for the mean)
    draft_s: float = 0.0  # driver time spent in the speculative source (shared by a step's requests)
    draft_calls: int = 0  # source calls made for it (one draft forward each, shared with other requests)
    preemptions: int = 0  # times its KV was taken back and it was recomputed
    stage_restarts: int = 0  # of those, times the stages died and were started again
    draft_failures: int = 0  # times the draft model's KV pool ran out for it (it was recomputed)
    draft_bound_steps: int = 0  # steps whose drafting outlasted the stages (the draft set the pace)
    cached_tokens: int = 0  # prompt tokens the prefix cache held (not computed) at its last admission


class RequestText:
    """A request's text, made outside the engine step (as vLLM v1 keeps detokenization out of its
    core): the offline loop feeds it between steps, a server's output thread as steps end.

    Text is cut before the first stop string (which is not part of it); the text `feed` returns
    for streaming holds back a tail that could still turn out to begin one. When a stop string
    appears, `kept` is the number of output ids that stand (through the one that completed it):
    the engine may have committed a few more before it heard, and those are dropped."""

    def __init__(self, detokenizer: Detokenizer, stops: tuple[str, ...] = ()) -> None:
        self.detokenizer, self.stops = detokenizer, stops
        self.text = ""
        self.seen = 0  # output ids fed so far
        self.kept: Optional[int] = None
        self.stop_string: Optional[str] = None  # the stop string that ended it (Anthropic's stop_sequence)
        self._streamed = 0  # characters of `text` already returned by feed

    def feed(self, new_ids: list[int], reason: Optional[str] = None) -> str:
        """The request's next committed ids, and its finish reason once the engine has ended it
        after them; returns the text that may be delivered now."""
        if self.kept is not None:
            return ""
        for token in new_ids:
            self.seen += 1
            before = len(self.text)
            self.text += self.detokenizer.add(token)
            if self._hit_stop_string(before):
                self.kept = self.seen
                break
        if self.kept is None and reason == "length":  # as it ran out: what the detokenizer holds back
            self.text += self.detokenizer.flush()
        over = reason is not None or self.kept is not None
        hold = 0 if over else max(map(len, self.stops), default=1) - 1
        upto = max(self._streamed, len(self.text) - hold)
        piece, self._streamed = self.text[self._streamed:upto], upto
        return piece

    def _hit_stop_string(self, before: int) -> bool:
        if not self.stops or len(self.text) == before:
            return False
        # Only the tail can hold a new match: the new piece plus a stop string's length.
        start = max(0, before - max(map(len, self.stops)) + 1)
        hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stops) if i >= 0]
        if not hits:
            return False
        cut, self.stop_string = min(hits)
        self.text = self.text[:cut]
        return True


@dataclass
class Request:
    """A request's committed output. `append` is the only way tokens arrive; it applies the stop
    conditions the engine step can see: a stop token id (EOS) and `max_tokens`. Stop strings need
    text, which is made outside the step (`output`, a RequestText); when one appears, `keep` ends
    the request there."""

    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    output: Optional[RequestText] = None  # its text (None: ids only)
    on_text: Optional[TextCallback] = None  # offline streaming: called with each piece of text
    client: Optional[str] = None  # who sent it (a server's API key tag or address): fair admission
    arrival: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finish_reason: Optional[str] = None  # stop | length | abort | error
    error: Optional[str] = None
    stats: DecodeStats = field(default_factory=DecodeStats)
    no_prefix_cache: bool = False  # a stage lacked a cached block for it: compute its whole prompt
    grammar: Optional[Grammar] = None  # structured output: follows the committed tokens
    # One per output id when sampling.logprobs is set (else empty): output_logprobs[i] is set
    # together with output_ids[i], so a reader on another thread may read any delivered index.
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # When sampling.prompt_logprobs is set: one per prompt token, the first None (nothing precedes
    # it), the others those of the token given the prompt before it; filled as the prefill's
    # rows leave the last stage (complete before the first output token).
    prompt_logprobs: list[Optional[TokenLogprobs]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.output.text if self.output is not None else ""

    @property
    def context_len(self) -> int:
        """Tokens committed so far, prompt included: the context its next rows attend to."""
        return len(self.prompt_ids) + len(self.output_ids)

    def append(self, token: int, logprobs: Optional[TokenLogprobs] = None) -> bool:
        """Record one committed output token (with its log-probabilities when the request asked
        for them); True when the request is now finished."""
        if self.finished:
            return True
        if (logprobs is None) != (self.sampling.logprobs is None):
            raise ValueError(f"request {self.request_id}: logprobs {'missing' if logprobs is None else 'unasked'}")
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        self.output_ids.append(token)
        self.token_times.append(time.perf_counter())
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif self.grammar is not None and not self._grammar_accepts(token):
            pass  # ended: complete ("stop") or refused ("error")
        elif len(self.output_ids) >= self.sampling.max_tokens:
            self.finish_reason = "length"
        if self.finished:
            self._close_grammar()
        return self.finished

    def _grammar_accepts(self, token: int) -> bool:
        """Feed a committed token to the grammar; False when that ended the request: the grammar
        is complete (only the end can follow, so it stops here as plain constrained decoding
        would at its next token), or it refused the token (an engine bug: an error, not bad output)."""
        refused = self.grammar.accept(token)
        if refused is not None:
            self.finish_reason, self.error = "error", refused
            return False
        if self.grammar.complete:
            self.finish_reason = "stop"
            return False
        return True

    def _close_grammar(self) -> None:
        if self.grammar is not None:
            self.grammar.close()

    def end(self, reason: str, error: Optional[str] = None) -> None:
        """Finish early (abort, error); what was decoded so far stays."""
        if not self.finished:
            self.finish_reason, self.error = reason, error
        self._close_grammar()

    def keep(self, n: int) -> None:
        """A stop string ended it after `n` output ids: later ones (committed before the engine
        heard) are dropped, and it finished with "stop" whatever the engine's reason was."""
        del self.output_ids[n:], self.token_times[n:], self.output_logprobs[n:]
        self.finish_reason, self.error = "stop", None
        self._close_grammar()

    def summary(self, num_stages: int) -> dict:
        s = self.stats
        n = len(self.output_ids)
        gaps = [b - a for a, b in zip(self.token_times, self.token_times[1:])]
        return {
            "pipeline_steps": s.pipeline_steps,
            "tokens_per_step": n / s.pipeline_steps if s.pipeline_steps else None,
            "drafted": s.drafted,
            "hit_rate": s.hits / s.verifications if s.verifications else None,
            "hits_by_depth": {str(k): v for k, v in sorted(s.hits_by_depth.items())} or None,
            "hit_rate_by_depth": {str(k): s.hits_by_depth.get(k, 0) / v
                                  for k, v in sorted(s.verifications_by_depth.items())} or None,
            "commits_per_step": {str(k): v for k, v in sorted(s.commits_per_step.items())} or None,
            "block_shapes": dict(sorted(s.block_shapes.items())) or None,
            "acceptance_length": n / s.rounds if s.rounds else None,
            "mean_live_tree": s.live_nodes_sum / s.pipeline_steps if s.live_nodes_sum else None,
            "ttft_ms": (self.token_times[0] - self.arrival) * 1e3 if n else None,
            "tbt_ms": sum(gaps) / len(gaps) * 1e3 if gaps else None,
            "draft_ms": s.draft_s * 1e3 if s.draft_s else None,
            "cached_tokens": s.cached_tokens,
            "preemptions": s.preemptions,
            "stage_restarts": s.stage_restarts,
            "draft_failures": s.draft_failures,
            "draft_bound_steps": s.draft_bound_steps,
            "num_stages": num_stages,
        }
