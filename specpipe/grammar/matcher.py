"""One request's grammar state: it follows the committed tokens only, and answers for any tree
node what the grammar allows after it by walking down the node's path (accept the speculative
tokens, take the mask, roll back), so the matcher never holds an uncommitted token between calls.

The engine uses it three ways (engine/core.py): a mask row for every head row a request sends
(the last stage masks the target with it: the committed path and every speculative row alike),
the draft's proposals filtered before they enter the tree, and each committed token accepted,
the request finishing with "stop" when the grammar is complete (nothing but the end may follow).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specpipe.grammar import bitmask
from specpipe.grammar.compiler import CompiledGrammar


class RequestGrammar:
    def __init__(self, compiled: CompiledGrammar) -> None:
        self.compiled = compiled
        self.vocab_size = compiled.vocab_size
        self._m = compiled.matcher()
        self.masks_made = 0  # mask rows computed for this request (statistics and tests)

    @property
    def closed(self) -> bool:
        return self._m is None

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows nothing more (only the end of the sequence)."""
        return self._m is not None and self._m.is_stopped()

    def accept(self, token: int) -> str | None:
        """A committed token; None, or why the grammar refuses it (an engine bug, since the target
        is masked: the request then ends with that error)."""
        if not 0 <= token < self.vocab_size or not self._m.consume_token(token):
            why = (self._m.get_error() or "out of the vocabulary").splitlines()[0]
            return f"the grammar refuses committed token {token}: {why}"
        return None

    def close(self) -> None:
        """The request ended: free the matcher."""
        self._m = None

    # -- speculative paths (every call leaves the matcher where it found it) -----------------------
    def _consume(self, path: Sequence[int]) -> int:
        """Accept as much of `path` as the grammar allows; how many tokens that was. (An id outside
        the vocabulary would put llguidance's matcher in a lasting error state: refused here.)"""
        if not path:
            return 0
        path = list(path)
        bad = next((i for i, t in enumerate(path) if not 0 <= t < self.vocab_size), len(path))
        return self._m.try_consume_tokens(path[:bad]) if bad else 0

    def _mask_bytes(self, path: Sequence[int]) -> bytes | None:
        m = self._m
        n = self._consume(path)
        try:
            if n < len(path):
                return None  # a token on the path is refused: nothing below it can be committed
            self.masks_made += 1
            return m.compute_bitmask()
        finally:
            if n:
                m.rollback(n)

    def masks(self, paths: Sequence[Sequence[int] | None]) -> torch.Tensor:
        """(len(paths), W) int64: the mask after each path of speculative tokens below the
        committed prefix (None: a row no longer in the tree). A path the grammar refuses gets an all-allowed row: its target token is
        never committed (its parent's masked target cannot have chosen it), so any will do."""
        rows = []
        for path in paths:
            data = None if path is None else self._mask_bytes(path)
            rows.append(bitmask.allow_all(self.vocab_size) if data is None else bitmask.from_bytes(data, self.vocab_size))
        return torch.stack(rows) if rows else torch.empty(0, bitmask.row_words(self.vocab_size), dtype=torch.int64)

    def filter(self, path: Sequence[int], candidates: list[tuple[int, float]]) -> list[tuple[int, float]]:
        """The candidates (token, score) the grammar allows after `path`, in their order."""
        data = self._mask_bytes(path)
        if data is None:
            return []
        return [(t, s) for t, s in candidates if 0 <= t < 8 * len(data) and data[t >> 3] >> (t & 7) & 1]

    def forced(self, path: Sequence[int]) -> int | None:
        """The token that begins what the grammar forces after `path` (say '"name": "' inside an
        object whose next key is fixed), or None when it leaves a choice."""
        m = self._m
        n = self._consume(path)
        try:
            if n < len(path):
                return None
            ff = m.compute_ff_tokens()
            return ff[0] if ff else None
        finally:
            if n:
                m.rollback(n)

    def proposals(self, path: Sequence[int], candidates: list[tuple[int, float]], k: int) -> list[tuple[int, float]]:
        """A draft's candidates after `path` as the tree takes them: the forbidden ones dropped,
        and the token the grammar forces (if any) first with log-probability 0, since the
        target, masked by the same grammar, is nearly sure to take it; at most k."""
        allowed = self.filter(path, candidates)
        tok = self.forced(path)
        if tok is None:
            return allowed[:k]
        return [(tok, 0.0), *[(t, s) for t, s in allowed if t != tok]][:k]
