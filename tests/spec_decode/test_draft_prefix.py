"""The draft model's prefix cache (spec_decode/draft_prefix.py) keeps the right KV in each block it
caches, however a tree scattered the request's committed positions over its blocks."""

from __future__ import annotations

import torch

from specpipe.kv.slot_table import SlotTable
from specpipe.messages import NO_PARENT
from specpipe.sched.prefix_cache import PrefixCache
from specpipe.spec_decode.draft_prefix import DraftPrefixCache
from specpipe.spec_decode.sources import SourceRows

BS = 2


def test_blocks_a_tree_scattered_are_cached_with_their_own_kv():
    """Issue 58 finding 4: at release each block was copied into a spare block on its own, and a
    spare block could still hold a later block's source slots (overwritten before they were
    read). Here positions 1 and 2 end in each other's blocks; every cached block must hold its
    own tokens' KV."""
    table = SlotTable(4, BS, horizon=0)
    kv: dict[int, int] = {}  # slot -> the token whose KV it holds

    def move(moves):  # as KVCache.move: every read before any write
        got = [kv[a] for a, _ in moves]
        for (_, d), v in zip(moves, got):
            kv[d] = v

    cache = DraftPrefixCache(table, move, PrefixCache(BS))
    table.admit(1)

    def compute(nodes, parents, positions, tokens):
        rows = cache.feed(1, SourceRows(nodes, parents, positions, torch.tensor(tokens)), [])
        plan = table.plan(1, rows.node_ids, rows.parent_ids, rows.positions)
        kv.update(zip(plan.write_slots, rows.tokens.tolist()))
        table.computed(1)
        cache.share(1)

    def observe(commit, drop=()):  # as DraftModelSource.observe
        table.drop(1, list(drop))
        table.commit(1, list(commit))
        cache.observe(1, commit, drop)
        cache.share(1)

    compute([0], [NO_PARENT], [0], [10])  # slot 0
    observe([0])
    compute([1, 2], [0, 0], [1, 1], [21, 11])  # slots 1, 2: a tree of two candidates for position 1
    observe([2], [1])  # position 1 in slot 2 (block 1); slot 1 free again
    compute([3], [2], [2], [12])  # position 2 in slot 1 (block 0)
    observe([3])
    compute([4], [3], [3], [13])  # position 3 in slot 3
    observe([4])
    assert table.requests[1].committed == [0, 2, 1, 3]  # no block holds its positions in order
    cache.finish(1)
    table.release(1)
    held = {b.key[1]: [kv[s] for s in range(table.cached[b.block_id] * BS, (table.cached[b.block_id] + 1) * BS)]
            for b in cache.index.blocks.values()}
    assert held == {(10, 11): [10, 11], (12, 13): [12, 13]}
