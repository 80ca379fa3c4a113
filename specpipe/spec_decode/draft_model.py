"""A draft model as a speculative token source: any causal LM with the target's tokenizer.

The draft decodes the tree node-wise with its own tree-masked, paged KV cache, using the same slot
table and the same packed forward as a pipeline stage (kv/slot_table.py, kv/packed_forward.py), and
prunes it with the same messages, so its cache too holds only committed tokens + live nodes.
One step's drafting for every request is one forward (`propose_many`).

If the draft's block pool runs out for a request, that request only loses its draft: its draft
KV is freed, it gets no proposals (decoding stays correct, just unspeculated), and
`take_failures` tells the engine, which starts its drafting again (engine/core.py).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from specpipe.grammar.bitmask import allowed
from specpipe.kernels.qlinear import select_outputs
from specpipe.messages import Rows
from specpipe.model.llama import LlamaStage
from specpipe.spec_decode.draft_prefix import DraftPrefixCache
from specpipe.spec_decode.sources import ProposeCall, SourceRows, TokenSource
from specpipe.kv.packed_forward import run_packed
from specpipe.kv.slot_table import SlotTable


class DraftModelSource(TokenSource):
    """A draft model's proposals. `vocab_ids`: the tokens the draft may propose (its LM head
    computes those rows only: in a small model with a large vocabulary the head is a third of the
    bytes a forward reads); None: all. The target verifies every proposal, so this changes how
    often the tree hits, never the output."""

    runs_model = True

    def __init__(self, model: LlamaStage, num_blocks: int, block_size: int, name: str,
                 tokenizer_fingerprint: str | None = None, vocab_ids: torch.Tensor | None = None) -> None:
        if not (model.spec.first and model.spec.last):
            raise ValueError("a draft model needs its embedding and its LM head")
        if vocab_ids is not None:
            model.lm_head = select_outputs(model.lm_head, vocab_ids)
        self.vocab_ids = vocab_ids
        self.model, self.name = model, name
        self.tokenizer_fingerprint = tokenizer_fingerprint
        # Horizon 0: the draft is fed synchronously, never a pruned node's row, so it remembers none.
        self.slots = SlotTable(num_blocks, block_size, horizon=0)
        self.kv = model.make_kv_cache(self.slots.num_slots)
        self._failed: list[int] = []
        self.prefix: Optional[DraftPrefixCache] = None

    def enable_prefix_cache(self, index) -> None:
        """Keep the KV of prompt prefixes for later requests (spec_decode/draft_prefix.py), in
        `index` (an empty sched.prefix_cache.PrefixCache of this source's block size)."""
        self.prefix = DraftPrefixCache(self.slots, self.kv.move, index)

    def start(self, request_id: int) -> None:
        self.slots.admit(request_id)

    def propose(self, request_id, tree, rows: SourceRows, want: Sequence[int], k: int):
        return self.propose_many([ProposeCall(request_id, tree, rows, want, k)])[0]

    def propose_many(self, calls: Sequence[ProposeCall]) -> list[dict[int, list[tuple[int, float]]]]:
        parts, owner = [], []  # the Rows computed, and the index of the call each belongs to
        for i, c in enumerate(calls):
            if not c.rows.node_ids or self.slots.requests[c.request_id].failed:
                continue
            rows = self.prefix.feed(c.request_id, c.rows, c.want) if self.prefix is not None else c.rows
            index = {n: j for j, n in enumerate(rows.node_ids)}
            missing = [n for n in c.want if n not in index]
            if missing:
                raise ValueError(f"request {c.request_id}: proposals wanted for nodes {missing} that "
                                 "are not among this call's rows (the draft keeps no logits)")
            parts.append(Rows(c.request_id, list(rows.node_ids), list(rows.parent_ids),
                              list(rows.positions), rows.tokens,
                              head_rows=[index[n] for n in c.want]))
            owner.append(i)
        out: list[dict[int, list[tuple[int, float]]]] = [{} for _ in calls]
        if self.prefix is not None:  # room for the rows, as the cache allows
            self.prefix.make_room(sum(-(-len(p) // self.slots.block_size) for p in parts))
        packed = run_packed(self.model, self.kv, self.slots, parts)
        self._failed += packed.failed
        if self.prefix is not None:
            for p in parts:
                self.prefix.share(p.request_id)
        for i, logits in zip(owner, packed.outputs):  # logits (len(want), V)
            c = calls[i]
            if logits is None or not len(c.want):
                continue
            if c.masks is not None:  # structured output: rank only what the grammar allows
                logits = self._masked(logits, c.masks(list(c.want)))
            top = torch.log_softmax(logits.float(), dim=-1).topk(min(c.k, logits.shape[-1]), dim=-1)
            ids = top.indices if self.vocab_ids is None else self.vocab_ids[top.indices]
            ids, lps = ids.tolist(), top.values.tolist()
            out[i] = {n: list(zip(ids[j], lps[j])) for j, n in enumerate(c.want)}
        return out

    def _masked(self, logits: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """Logits (over the draft's vocabulary, or its --draft-vocab cut) with forbidden tokens
        at -inf. A row whose allowed tokens all lie outside a --draft-vocab cut stays unmasked
        (never all -inf: no NaN scores); the grammar's filter drops its candidates afterwards."""
        if self.vocab_ids is None:
            keep = allowed(masks, logits.shape[-1])
        else:
            keep = allowed(masks, int(self.vocab_ids.max()) + 1)[:, self.vocab_ids]
        keep[~keep.any(dim=-1)] = True
        return logits.masked_fill(~keep.to(logits.device), float("-inf"))

    def observe(self, request_id, commit, drop):
        if request_id in self.slots.requests:
            self.slots.drop(request_id, list(drop))
            self.slots.commit(request_id, list(commit))
            if self.prefix is not None:
                self.prefix.observe(request_id, commit, drop)
                self.prefix.share(request_id)

    def finish(self, request_id):
        if self.prefix is not None:
            self.prefix.finish(request_id)
        self.slots.release(request_id)

    def take_failures(self) -> list[int]:
        failed, self._failed = self._failed, []
        return failed

    def has_room(self, tokens: int) -> bool:
        free = self.prefix.available() if self.prefix is not None else self.slots.pool.num_free()
        return free * self.slots.block_size >= tokens
