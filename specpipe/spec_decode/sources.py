"""Speculative token sources behind one small interface, and the n-gram and merged sources.

A source proposes scored children for tree nodes. The driver feeds it exactly the rows it sends
into the target pipeline (so a model source keeps its own KV in step with the target's) and the
pruning messages (so that KV is pruned like the target's), then asks for proposals.

Glossary:
  row        -- (node id, parent id, position, token) of a node entering the pipeline.
  proposals  -- node id -> [(token, logprob), ...], the candidates for that node's children.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from specpipe.spec_decode.tree import Proposals, TokenTree


@dataclass(frozen=True)
class SourceRows:
    """Nodes entering the pipeline this step; parents precede children."""

    node_ids: list[int]
    parent_ids: list[int]
    positions: list[int]
    tokens: list[int]


@dataclass
class ProposeCall:
    """One request's share of a step's drafting: take in `rows`, propose children for `want`."""

    request_id: int
    tree: TokenTree
    rows: SourceRows
    want: Sequence[int]  # node ids (a subset of the rows' nodes, or already taken-in nodes)
    k: int  # candidates per node


class TokenSource(ABC):
    """Interface of every speculative token source."""

    name: str = "source"
    tokenizer_fingerprint: str | None = None  # set by model sources, checked against the target's

    def start(self, request_id: int) -> None:
        """A request begins (its prompt arrives through the first `propose`)."""

    @abstractmethod
    def propose(self, request_id: int, tree: TokenTree, rows: SourceRows, want: Sequence[int],
                k: int) -> dict[int, list[tuple[int, float]]]:
        """Take in `rows`, then return up to `k` scored children for each node id in `want`
        (a subset of the rows' nodes)."""

    def propose_many(self, calls: Sequence[ProposeCall]) -> list[dict[int, list[tuple[int, float]]]]:
        """Every request's proposals for one step, in the order of `calls`. A model source
        overrides this to run one forward for all requests' rows."""
        return [self.propose(c.request_id, c.tree, c.rows, c.want, c.k) for c in calls]

    def observe(self, request_id: int, commit: Sequence[int], drop: Sequence[int]) -> None:
        """The same pruning message the stages receive."""

    def finish(self, request_id: int) -> None:
        """The request ended: free what the source holds for it."""


class NgramSource(TokenSource):
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens
    (longest n first) and propose the tokens that followed it. No model."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, request_id, tree, rows, want, k):
        committed = tree.committed
        return {n: self.lookup(list(committed) + tree.path_tokens(n) if n != tree.root_id else list(committed), k)
                for n in want}

    def lookup(self, context: Sequence[int], k: int) -> list[tuple[int, float]]:
        """Candidates for the token after `context`, scored by how often each followed the
        longest matching suffix (log of the relative frequency, minus a penalty for short n)."""
        L = len(context)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = list(context[L - n:])
            follow: Counter = Counter()
            for i in range(L - n - 1, -1, -1):
                if list(context[i:i + n]) == suffix:
                    follow[context[i + n]] += 1
            if follow:
                total = sum(follow.values())
                # A short match is weaker evidence: lower its scores so that, merged with a
                # model source, it does not crowd out the model's confident guesses.
                penalty = math.log(n / self.max_n)
                ranked = sorted(follow.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
                return [(tok, math.log(c / total) + penalty) for tok, c in ranked]
        return []


class MergedSource(TokenSource):
    """Several sources merged into one layer: each token keeps its best logprob."""

    def __init__(self, sources: Sequence[TokenSource]) -> None:
        if not sources:
            raise ValueError("a merged source needs at least one source")
        self.sources = list(sources)
        self.name = "+".join(s.name for s in sources)
        prints = {s.tokenizer_fingerprint for s in sources} - {None}
        self.tokenizer_fingerprint = prints.pop() if len(prints) == 1 else None

    def start(self, request_id):
        for s in self.sources:
            s.start(request_id)

    def propose(self, request_id, tree, rows, want, k):
        merged: dict[int, dict[int, float]] = {n: {} for n in want}
        for s in self.sources:
            for node, cands in s.propose(request_id, tree, rows, want, k).items():
                best = merged[node]
                for tok, lp in cands:
                    if tok not in best or lp > best[tok]:
                        best[tok] = lp
        return {n: sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[:k] for n, c in merged.items()}

    def observe(self, request_id, commit, drop):
        for s in self.sources:
            s.observe(request_id, commit, drop)

    def finish(self, request_id):
        for s in self.sources:
            s.finish(request_id)


__all__ = ["MergedSource", "NgramSource", "ProposeCall", "Proposals", "SourceRows", "TokenSource"]
