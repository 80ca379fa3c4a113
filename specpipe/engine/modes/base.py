"""What every mode is to the engine core: one request's state machine, stepped by the core.

Each pipeline step the core asks every running request, in this order:

  want()              what it would send: committed rows and speculative rows (sched.Want)
  prepare(grant)      what it may send this step (sched.Grant)
  drafting(BEFORE)    source calls to make before sending (tree mode drafts its tree here)
  send()              the Rows it puts into stage 1 (None: nothing this step)
  control()           its admit / pruning message for every stage this step
  drafting(DURING)    source calls made while the stages compute (SpecPipe drafts its new layer)
  receive(results)    the target's tokens for its rows that left the last stage (and their
                      log-probabilities, when the request asked for them)
  verify()            commit tokens (Request.append), prune, prepare next step's message
  drafting(AFTER)     source calls after verification (SpecPipe drafts a new root at once)

The core batches every request's source calls of one phase into one `propose_many`, so a draft
model runs one forward for all requests. A state never talks to the pipeline itself.

Ids: a state is bound to a *pipeline id* (`pid`), fresh for each time a request enters the
pipeline (a preempted request comes back with a new pid), so rows of an earlier incarnation
still in flight can never be mistaken for the new one's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from typing import Optional

from specpipe.engine.rows import Prefill
from specpipe.messages import Admit, Prune, Results, Rows
from specpipe.request import Request
from specpipe.sampling import TokenLogprobs
from specpipe.sched.scheduler import Grant, Want
from specpipe.spec_decode.sources import ProposeCall, TokenSource
from specpipe.penalties import PenaltyContext
from specpipe.spec_decode.tree import TokenTree

BEFORE, DURING, AFTER = "before_send", "while_computing", "after_verify"


def _top(lp: TokenLogprobs, k: int) -> TokenLogprobs:
    return TokenLogprobs(lp.logprob, lp.top_ids[:k], lp.top_logprobs[:k])


class ModeState(ABC):
    def __init__(self, pid: int, req: Request, source: Optional[TokenSource], width: int) -> None:
        self.pid, self.req, self.source, self.width = pid, req, source, width
        tokens = req.prompt_ids + req.output_ids  # after a preemption: recomputed from here
        self.tree = TokenTree(tokens, width)
        self.prefill = Prefill(pid, tokens, self.tree.root_id)
        self.grant = Grant()
        self.held = 0  # rows sent and not pruned: what this request may hold at any stage
        self.started = False  # sent its first rows (steps count from there)
        self.floors: deque[int] = deque()  # committed_sent() after each of the last S + 2 steps (engine/core.py)
        self._commits_sent = 0  # committed node ids told to the stages
        self._rows_sent_end = 0  # 1 + the highest position of a row sent
        self.draft_bound = False  # its drafting outlasted the stages' compute in the last step
        self._admit: Optional[Admit] = Admit(pid, req.sampling)
        self._commit: list[int] = list(self.prefill.node_ids)  # the prompt is committed up front
        self._drop: list[int] = []
        # Log-probabilities of computed nodes not yet verified (requests that asked only): the
        # committed token at position p + 1 takes those of the node at p, the row that chose it,
        # so a request keeps plain decoding's values whatever tree its tokens came through.
        self._logprobs: dict[int, TokenLogprobs] = {}
        # Prompt logprobs, asked for and not yet had (not after a preemption that came later):
        # every prefill row is scored on the next prompt token (engine/rows.py, Prefill).
        self._prompt_pos: dict[int, int] = {}
        self.penalty_context: Optional[PenaltyContext] = None  # a penalized request's (engine/core.py)
        if req.sampling.prompt_logprobs is not None and not req.output_ids:
            self.prefill.scored = True
            self._prompt_pos = {n: i for i, n in enumerate(self.prefill.node_ids[:-1])}
            req.prompt_logprobs = [None] * len(req.prompt_ids)
        if source is not None:
            source.start(pid)
            source.observe(pid, list(self.prefill.node_ids), [])  # and so it is for the source

    # -- the step, as the core drives it ---------------------------------------------------------
    @abstractmethod
    def want(self) -> Want: ...

    def prepare(self, grant: Grant) -> None:
        self.grant = grant

    def drafting(self, phase: str) -> Optional[ProposeCall]:
        return None

    def proposals(self, phase: str, props: dict) -> None:
        pass

    @abstractmethod
    def send(self) -> Optional[Rows]: ...

    def control(self) -> tuple[Optional[Admit], Optional[Prune]]:
        """This step's admit (first step only) and pruning message; sent once."""
        if self.grant.rows == 0 and self._admit is not None:
            return None, None  # not in the pipeline yet: nothing to tell the stages
        admit, self._admit = self._admit, None
        prune = Prune(self.pid, self._commit, self._drop) if self._commit or self._drop else None
        self._commits_sent += len(self._commit)
        self._commit, self._drop = [], []
        return admit, prune

    def use_cached(self, block_ids: list[int], block_size: int) -> None:
        """Before its first rows: the stages hold its first len(block_ids) * block_size tokens in
        cached blocks (prefix caching). Its prefill starts after them; the admit names them."""
        cached = len(block_ids) * block_size
        self.prefill.skip(cached)
        self.held = self._rows_sent_end = self._commits_sent = cached
        self._commit = list(self.prefill.node_ids[cached:])
        self._admit = Admit(self.pid, self.req.sampling, list(block_ids))

    def committed_sent(self) -> int:
        """A lower bound on the committed positions whose rows were sent and whose commits were
        told to the stages. Committed rows go out in position order, and every committed node
        but the newest has a committed child, which was sent after it or computed from it; so
        all committed positions below min(commits told, rows sent) - 1 are among them."""
        return max(0, min(self._commits_sent, self._rows_sent_end) - 1)

    def receive(self, results: Results) -> None:
        for node, tok in zip(results.node_ids, results.tokens):
            if node in self.tree:
                self.tree.record_target(node, tok)
        if results.logprobs is not None and not self._prompt_pos:
            self._logprobs.update((n, lp) for n, lp in zip(results.node_ids, results.logprobs) if n in self.tree)
        elif results.logprobs is not None:  # prompt rows scored: each trimmed to the top count asked for
            asked = self.req.sampling
            for n, lp in zip(results.node_ids, results.logprobs):  # prompt row i: token i + 1's
                if n in self._prompt_pos:
                    self.req.prompt_logprobs[self._prompt_pos[n] + 1] = _top(lp, asked.prompt_logprobs)
                elif n in self.tree and asked.logprobs is not None:
                    self._logprobs[n] = _top(lp, asked.logprobs)

    def _logprobs_of(self, node: int) -> Optional[TokenLogprobs]:
        """The log-probabilities computed at `node` (its target token was just committed), or
        None when the request did not ask for them."""
        if self.req.sampling.logprobs is None:
            return None
        lp = self._logprobs.pop(node, None)
        if lp is None:  # every computed row of a request that asked carries them
            raise RuntimeError(f"request {self.req.request_id}: no logprobs came for node {node}")
        return lp

    @abstractmethod
    def verify(self) -> None: ...

    def finish(self) -> None:
        """The request ended or left the pipeline: free what the source holds for it."""
        if self.source is not None:
            self.source.finish(self.pid)

    # -- helpers for the modes ---------------------------------------------------------------------
    def _sent(self, rows: Optional[Rows]) -> Optional[Rows]:
        if rows is not None and len(rows):
            self.held += len(rows)
            self._rows_sent_end = max(self._rows_sent_end, max(rows.positions) + 1)
            self.started = True
            return rows
        return None

    def _pruned(self, commit: list[int], drop: list[int], source_drop: Optional[list[int]] = None) -> None:
        """Queue a pruning message for every stage (and the source) and forget dropped rows.
        `drop`: rows the stages hold; `source_drop`: what the source holds, if that differs."""
        self._commit += commit
        self._drop += drop
        if self._logprobs:  # those of pruned nodes go with them
            self._logprobs = {n: lp for n, lp in self._logprobs.items() if n in self.tree}
        self.held -= len(drop)
        source_drop = drop if source_drop is None else source_drop
        if self.source is not None and (commit or source_drop):
            self.source.observe(self.pid, commit, source_drop)
