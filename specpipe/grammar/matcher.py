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


class GrammarViolation(RuntimeError):
    """A committed token the grammar refuses: a bug, since the target is masked; the request ends."""


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

    def accept(self, token: int) -> None:
        """A committed token."""
        if not self._m.consume_token(token):
            raise GrammarViolation(f"the grammar refuses committed token {token}: {self._m.get_error()}")

    def close(self) -> None:
        """The request ended: free the matcher."""
        self._m = None

    # -- speculative paths (every call leaves the matcher where it found it) -----------------------
    def _mask_bytes(self, path: Sequence[int]) -> bytes | None:
        m = self._m
        n = m.try_consume_tokens(list(path)) if path else 0
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
