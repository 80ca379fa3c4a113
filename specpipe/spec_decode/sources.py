"""Speculative token sources behind one small interface, and the n-gram and merged sources.

A source proposes scored children for tree nodes. The driver feeds it exactly the rows it sends
into the target pipeline (so a model source keeps its own KV in step with the target's) and the
pruning messages (so that KV is pruned like the target's), then asks for proposals.

Glossary:
  row        -- (node id, parent id, position, token) of a node entering the pipeline.
  proposals  -- node id -> [(token, logprob), ...], the candidates for that node's children.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from specpipe.spec_decode.tree import Proposals, TokenTree


@dataclass(frozen=True)
class SourceRows:
    """Nodes entering the pipeline this step; parents precede children."""

    node_ids: list[int]
    parent_ids: list[int]
    positions: list[int]
    tokens: torch.Tensor  # (N,) long: the very tensor stage 1 gets, so a draft model uses it as it is

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", torch.as_tensor(self.tokens, dtype=torch.long))


@dataclass
class ProposeCall:
    """One request's share of a step's drafting: take in `rows`, propose children for `want`."""

    request_id: int
    tree: TokenTree
    rows: SourceRows
    want: Sequence[int]  # node ids (a subset of the rows' nodes, or already taken-in nodes)
    k: int  # candidates per node
    # Structured output: node ids -> their token masks ((N, W) int64, specpipe/grammar/bitmask.py),
    # for a model source to mask its logits with before it ranks its candidates. None: free.
    masks: Optional[Callable[[Sequence[int]], torch.Tensor]] = None


class TokenSource(ABC):
    """Interface of every speculative token source."""

    name: str = "source"
    tokenizer_fingerprint: str | None = None  # set by model sources, checked against the target's
    runs_model = False  # its proposals cost a model's forward (priced by a cost profile's draft)
    reads_tree = False  # its proposals read the request's tree, not only the rows it is given

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

    def take_failures(self) -> list[int]:
        """Requests whose drafting state was lost since the last call (a model source's KV pool
        ran out): they get no proposals until the engine starts them again (start + re-feed)."""
        return []

    def has_room(self, tokens: int) -> bool:
        """Whether a request holding `tokens` tokens and nodes would fit now (a model source's pool)."""
        return True


class WrappedSource(TokenSource):
    """Another source with some calls changed: every call the subclass does not override goes to
    `inner` (its name, cost and tokenizer too)."""

    def __init__(self, inner: TokenSource, name: str) -> None:
        self.inner, self.name = inner, name
        self.runs_model, self.tokenizer_fingerprint = inner.runs_model, inner.tokenizer_fingerprint

    def start(self, request_id):
        self.inner.start(request_id)

    def propose(self, request_id, tree, rows, want, k):
        return self.inner.propose(request_id, tree, rows, want, k)

    def propose_many(self, calls):
        return self.inner.propose_many(calls)

    def observe(self, request_id, commit, drop):
        self.inner.observe(request_id, commit, drop)

    def finish(self, request_id):
        self.inner.finish(request_id)

    def take_failures(self):
        return self.inner.take_failures()

    def has_room(self, tokens):
        return self.inner.has_room(tokens)


class NgramIndex:
    """n-gram -> Counter of the tokens that followed it, over a token sequence that only grows.

    Holds, for every n in [min_n, max_n], each occurrence whose follower is inside the sequence.
    `extend` adds the occurrences that new tokens complete, so keeping up costs O(new tokens x
    n-gram sizes) instead of a scan of the whole context per query.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._follow: dict[int, dict[tuple[int, ...], Counter]] = {n: {} for n in range(min_n, max_n + 1)}

    def extend(self, new_tokens: Sequence[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(new_tokens)
        toks = self.tokens
        for j in range(max(start, self.min_n), len(toks)):  # j: the follower's index
            for n, table in self._follow.items():
                if n > j:
                    break
                gram = tuple(toks[j - n:j])
                follow = table.get(gram)
                if follow is None:
                    follow = table[gram] = Counter()
                follow[toks[j]] += 1

    def followers(self, path: Sequence[int], n: int) -> Counter:
        """Tokens that followed the last n tokens of `tokens + path`, wherever an earlier
        occurrence lies (in the indexed prefix, or overlapping `path`), with their counts.
        Read-only: when nothing overlaps the path, this is the index's own Counter."""
        tail_start = max(0, len(self.tokens) - n)  # occurrences from here on overlap the path
        tail = self.tokens[tail_start:] + list(path)
        suffix = tail[len(tail) - n:]
        indexed = self._follow[n].get(tuple(suffix), Counter())  # followers inside the prefix
        # An occurrence starting at or after tail_start has its follower at len(tokens) or later,
        # in the path: the index does not hold those. Scan them; there are at most len(path).
        scanned = Counter(tail[i + n] for i in range(len(tail) - n) if tail[i:i + n] == suffix)
        return indexed + scanned if scanned else indexed


class NgramSource(TokenSource):
    """Prompt lookup: find earlier occurrences of the context's last n tokens (longest n first)
    and propose the tokens that followed them. No model.

    A node's context is the committed sequence plus the node's path. The committed part is kept
    in an NgramIndex per request, brought up to date on each propose from tree.num_committed, so
    a lookup costs O(path length x n) plus a dictionary read, however long the context is.
    """

    name = "ngram"
    reads_tree = True

    def __init__(self, max_n: int = 4, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._requests: dict[int, tuple[TokenTree, NgramIndex]] = {}

    def start(self, request_id):
        self._requests.pop(request_id, None)

    def finish(self, request_id):
        self._requests.pop(request_id, None)

    def _index(self, request_id: int, tree: TokenTree) -> NgramIndex:
        held = self._requests.get(request_id)
        # Started lazily: a caller may skip start(). A different tree under the same id (a reused
        # id, or a caller that never finished) gets a fresh index rather than a wrong one.
        if held is None or held[0] is not tree:
            held = self._requests[request_id] = (tree, NgramIndex(self.min_n, self.max_n))
        index = held[1]
        if len(index.tokens) < tree.num_committed:
            index.extend(tree.committed_since(len(index.tokens)))
        return index

    def propose(self, request_id, tree, rows, want, k):
        index = self._index(request_id, tree)
        return {n: self._candidates(index, tree.path_tokens(n), k) for n in want}

    def _candidates(self, index: NgramIndex, path: Sequence[int], k: int) -> list[tuple[int, float]]:
        """Candidates for the token after `index.tokens + path`, scored by how often each followed
        the longest matching suffix (log of the relative frequency, minus a penalty for short n)."""
        L = len(index.tokens) + len(path)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            follow = index.followers(path, n)
            if follow:
                total = sum(follow.values())
                # A short match is weaker evidence: lower its scores so that, merged with a
                # model source, it does not crowd out the model's confident guesses.
                penalty = math.log(n / self.max_n)
                ranked = heapq.nsmallest(k, follow.items(), key=lambda kv: (-kv[1], kv[0]))
                return [(tok, math.log(c / total) + penalty) for tok, c in ranked]
        return []


class MergedSource(TokenSource):
    """Several sources merged into one layer: each token keeps its best logprob."""

    def __init__(self, sources: Sequence[TokenSource]) -> None:
        if not sources:
            raise ValueError("a merged source needs at least one source")
        self.sources = list(sources)
        self.name = "+".join(s.name for s in sources)
        self.runs_model = any(s.runs_model for s in sources)
        self.reads_tree = any(s.reads_tree for s in sources)
        prints = {s.tokenizer_fingerprint for s in sources} - {None}
        self.tokenizer_fingerprint = prints.pop() if len(prints) == 1 else None

    def start(self, request_id):
        for s in self.sources:
            s.start(request_id)

    def propose(self, request_id, tree, rows, want, k):
        return _merge([s.propose(request_id, tree, rows, want, k) for s in self.sources], want, k)

    def propose_many(self, calls):
        # Each source sees the whole step at once (a model source batches it into one forward).
        per_source = [s.propose_many(calls) for s in self.sources]
        return [_merge([props[i] for props in per_source], c.want, c.k) for i, c in enumerate(calls)]

    def observe(self, request_id, commit, drop):
        for s in self.sources:
            s.observe(request_id, commit, drop)

    def finish(self, request_id):
        for s in self.sources:
            s.finish(request_id)

    def take_failures(self):
        return sorted({rid for s in self.sources for rid in s.take_failures()})

    def has_room(self, tokens):
        return all(s.has_room(tokens) for s in self.sources)


def _merge(proposals: Sequence[dict[int, list[tuple[int, float]]]], want: Sequence[int],
           k: int) -> dict[int, list[tuple[int, float]]]:
    """One candidate list per node from several sources': each token keeps its best logprob."""
    merged: dict[int, dict[int, float]] = {n: {} for n in want}
    for props in proposals:
        for node, cands in props.items():
            best = merged[node]
            for tok, lp in cands:
                if tok not in best or lp > best[tok]:
                    best[tok] = lp
    return {n: sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))[:k] for n, c in merged.items()}


__all__ = ["MergedSource", "NgramIndex", "NgramSource", "ProposeCall", "Proposals", "SourceRows", "TokenSource"]
