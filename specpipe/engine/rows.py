"""Turning tree nodes and prompts into the Rows that enter stage 1 (and the source)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specpipe.messages import NO_PARENT, Rows
from specpipe.spec_decode.sources import SourceRows
from specpipe.spec_decode.tree import Node


def prompt_node_ids(prompt_len: int, root_id: int) -> list[int]:
    """Prompt tokens before the root get negative ids (-2, -3, ...) that never meet a tree id;
    the last prompt token is the tree's root."""
    return [-2 - i for i in range(prompt_len - 1)] + [root_id]


class Prefill:
    """A prompt (or, after preemption, prompt + output so far) sent in chunks, one per step.

    Chunks of one request may follow each other on consecutive steps: the pipeline is FIFO, so a
    chunk reaches every stage after the chunk before it. Only the last prompt token (the tree's
    root) asks for the target's token.
    """

    def __init__(self, request_id: int, tokens: Sequence[int], root_id: int) -> None:
        self.request_id = request_id
        self.tokens = list(tokens)
        self.node_ids = prompt_node_ids(len(self.tokens), root_id)
        self.sent = 0
        self.cached = 0  # leading tokens the stages hold in cached blocks: never sent
        self.scored = False  # prompt logprobs: every row is a head row, scored on its next token

    def skip(self, cached: int) -> None:
        """Before the first chunk: the stages hold the first `cached` tokens already."""
        if self.sent != self.cached or not 0 <= cached < len(self.tokens):
            raise ValueError(f"a cached prefix of {cached} tokens set after sending or past the prompt")
        self.sent = self.cached = cached

    def left(self) -> int:
        return len(self.tokens) - self.sent

    def take(self, n: int) -> Rows:
        a, b = self.sent, min(self.sent + n, len(self.tokens))
        self.sent = b
        return self.rows(a, b)

    def rows(self, a: int, b: int) -> Rows:
        ids = self.node_ids
        rows = Rows(self.request_id, ids[a:b], [ids[a - 1] if a else NO_PARENT] + ids[a:b - 1], list(range(a, b)),
                    torch.tensor(self.tokens[a:b], dtype=torch.long),
                    head_rows=[b - 1 - a] if b == len(self.tokens) else [])
        if self.scored:
            rows.head_rows = list(range(b - a))
            rows.scored = self.tokens[a + 1:b + 1] + [-1] * (b == len(self.tokens))
        return rows


def node_rows(request_id: int, nodes: Sequence[Node], root_parent: int | None = None) -> Rows:
    """Rows for tree nodes (parents first). A node without a tree parent is a new root whose
    parent, for the stages, is the previous root `root_parent` (already committed)."""
    parents = [n.parent if n.parent is not None else root_parent for n in nodes]
    if any(p is None for p in parents):
        raise ValueError("a new root needs the previous root as its parent")
    return Rows(request_id, [n.node_id for n in nodes], parents, [n.position for n in nodes],
                torch.tensor([n.token for n in nodes], dtype=torch.long))


def source_rows(rows: Rows) -> SourceRows:
    return SourceRows(list(rows.node_ids), list(rows.parent_ids), list(rows.positions), rows.data)


def concat_rows(a: Optional[Rows], b: Optional[Rows]) -> Optional[Rows]:
    """One message carrying a's rows then b's (either may be None); parents stay first."""
    if a is None or b is None:
        return a if b is None else b
    heads_a = a.head_rows if a.head_rows is not None else list(range(len(a)))
    heads_b = b.head_rows if b.head_rows is not None else list(range(len(b)))
    scored = None if a.scored is None and b.scored is None else \
        (a.scored or [-1] * len(heads_a)) + (b.scored or [-1] * len(heads_b))
    return Rows(a.request_id, a.node_ids + b.node_ids, a.parent_ids + b.parent_ids,
                a.positions + b.positions, torch.cat([a.data, b.data]),
                heads_a + [len(a) + i for i in heads_b], scored=scored)
