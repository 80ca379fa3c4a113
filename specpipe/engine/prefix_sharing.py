"""The engine core's side of prefix caching (docs/design.md §16.1): which blocks a request reads
from the cache before its first rows, and which of its blocks join the cache, when.

The index and the accounting are the block manager's (sched/block_manager.py, prefix_cache.py);
the stages act on what this puts in the step's Control (Admit.cached, Control.share) and on the
evictions the block manager makes (Control.evict).
"""

from __future__ import annotations

from specpipe.config import SPECULATIVE_MODES
from specpipe.engine.modes.base import ModeState
from specpipe.messages import Share
from specpipe.sched.block_manager import BlockManager


class PrefixSharing:
    def __init__(self, blocks: BlockManager, mode: str, num_stages: int) -> None:
        self.blocks, self.num_stages = blocks, num_stages
        self.speculative = mode in SPECULATIVE_MODES

    def lookup(self, st: ModeState) -> None:
        """Before the request's first rows: its longest cached prefix (looked up again each time
        it waits, since the cache changes meanwhile); its prefill starts after it."""
        req = st.req
        # (a request scoring its prompt computes all of it: prompt logprobs need every row's logits)
        ids = [] if req.no_prefix_cache or st.prefill.scored else self.blocks.lookup(req.request_id, st.prefill.tokens)
        st.use_cached(ids, self.blocks.block_size)
        req.stats.cached_tokens = len(ids) * self.blocks.block_size

    def admitted(self, st: ModeState) -> None:
        self.blocks.cache.count_query(len(st.prefill.tokens), st.req.stats.cached_tokens)

    def share(self, st: ModeState, out: list[Share], final: bool) -> None:
        """The request's full blocks of committed positions that every stage has settled join
        the cache, told with this step's Control (called after the request's `floors` entry for
        this step) or, `final`, with the Control of its release. A Control reaches every stage in
        the step it is sent, before the rows that stage computes then, and rows sent at step t
        leave the last stage at step t + S - 1: so what the request had sent S steps before the
        Control is settled everywhere. While it runs, only blocks its rows filled in order (its
        prefill; every block in the modes without speculation); at its release, the rest too
        (the stages copy what a tree scattered into one block first)."""
        if not st.started:
            return
        steps_ago = self.num_stages - (1 if final else 0)  # before the last `floors` entry
        limit = st.floors[-1 - steps_ago] if len(st.floors) > steps_ago else 0
        if not final and self.speculative:
            limit = min(limit, len(st.prefill.tokens))
        bs, rid = self.blocks.block_size, st.req.request_id
        first = self.blocks.cached_blocks(rid)
        if first >= limit // bs:
            return
        tokens = st.prefill.tokens if limit <= len(st.prefill.tokens) else st.req.prompt_ids + st.req.output_ids
        share = Share(st.pid)
        for k in range(first, limit // bs):
            block_id = self.blocks.share(rid, tokens[k * bs:(k + 1) * bs])
            if block_id is not None:
                share.blocks.append(k)
                share.ids.append(block_id)
        if share.blocks:
            out.append(share)
