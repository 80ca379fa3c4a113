"""A draft model as a speculative token source: any causal LM with the target's tokenizer.

The draft decodes the tree node-wise with its own tree-masked KV cache, using the same slot
bookkeeping as a pipeline stage (sched/kv_manager.py), and prunes it with the same messages, so its
cache too holds only committed tokens + live nodes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specpipe.model.llama import LlamaStage
from specpipe.model.runner import run_rows
from specpipe.worker.slot_table import KVManager
from specpipe.spec_decode.sources import SourceRows, TokenSource


class DraftModelSource(TokenSource):
    def __init__(self, model: LlamaStage, num_slots: int, name: str,
                 tokenizer_fingerprint: str | None = None) -> None:
        if not (model.spec.first and model.spec.last):
            raise ValueError("a draft model needs its embedding and its LM head")
        self.model, self.name = model, name
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.kv = model.make_kv_cache(num_slots)
        self.slots = KVManager(num_slots)

    def start(self, request_id: int) -> None:
        self.slots.admit(request_id)

    def propose(self, request_id, tree, rows: SourceRows, want: Sequence[int], k: int):
        if not rows.node_ids:
            return {}
        plan = self.slots.plan(request_id, rows.node_ids, rows.parent_ids)
        index = {n: i for i, n in enumerate(rows.node_ids)}
        head = [index[n] for n in want]
        tokens = torch.tensor(rows.tokens, dtype=torch.long)
        logits = run_rows(self.model, self.kv, tokens, rows.positions, plan.write_slots,
                          plan.read_slots, plan.mask, head)  # (len(want), V)
        self.slots.computed(request_id)
        if not head:
            return {}
        top = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        ids, lps = top.indices.tolist(), top.values.tolist()
        return {n: list(zip(ids[i], lps[i])) for i, n in enumerate(want)}

    def observe(self, request_id, commit, drop):
        if request_id in self.slots.requests:
            self.slots.drop(request_id, list(drop))
            self.slots.commit(request_id, list(commit))

    def finish(self, request_id):
        self.slots.release(request_id)
