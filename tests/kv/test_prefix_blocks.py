"""The prefix cache's parts on their own: the driver's index (hits by tokens, LRU tail first, no
duplicates), the block manager's accounting, and a stage's slot table (blocks move to the cache
without a copy where they are whole, and with one where a tree scattered them)."""

import pytest

from specpipe.kv.slot_table import NO_PARENT, KVStateError, SlotTable
from specpipe.sched.block_manager import BlockManager
from specpipe.sched.prefix_cache import PrefixCache


def test_a_hit_needs_the_same_tokens_after_the_same_parent():
    c = PrefixCache(2)
    a, new = c.insert(None, [1, 2])
    b, _ = c.insert(a, [3, 4])
    assert new and [x.block_id for x in c.match([1, 2, 3, 4, 5], 4)] == [a.block_id, b.block_id]
    assert c.match([1, 2, 3, 9], 4) == [a]  # the second block differs in one token
    assert c.match([9, 2, 3, 4], 4) == []  # same tokens [3, 4] but after another parent
    assert c.match([1, 2, 3, 4], 3) == [a]  # at most `limit` tokens: a token is always left
    again, new = c.insert(None, [1, 2])
    assert again is a and not new and len(c) == 2


def test_unreferenced_blocks_are_evicted_least_recent_first_tail_before_head():
    c = PrefixCache(1)
    a, _ = c.insert(None, [1])
    b, _ = c.insert(a, [2])
    x, _ = c.insert(None, [7])
    c.release([a, b])  # a sequence ends: its tail joins the LRU first
    c.release([x])
    c.acquire([a])  # read again: not evictable while read
    c.evict(1)
    assert c.take_evicted() == [b.block_id]
    c.evict(5)
    assert c.take_evicted() == [x.block_id] and len(c) == 1  # `a` is still read
    c.release([a])
    c.evict(5)
    assert c.take_evicted() == [a.block_id] and len(c) == 0 and c.stats.evictions == 3


def test_block_manager_counts_a_cached_block_once_and_evicts_for_room():
    m = BlockManager(6, 2, cache=PrefixCache(2))
    m.reserve(0, 6)  # 3 blocks of its own
    assert m.share(0, [1, 2]) is not None and m.share(0, [3, 4]) is not None
    assert m.pool.held[0] == 1 and m.num_free() == 3
    m.free(0)  # its cached blocks stay, read by nobody
    assert m.num_free() == 4 and m.pool.available() == 6
    assert len(m.lookup(1, [1, 2, 3, 4, 5])) == 2  # 4 of its 5 tokens cached
    m.reserve(1, 9)  # 4 cached + 5 of its own: 3 blocks
    assert m.pool.held[1] == 3 and m.num_free() == 1
    m.free(1)
    m.lookup(2, [8, 9, 10])  # nothing cached for it
    m.reserve(2, 12)  # 6 blocks: every cached block must go
    assert sorted(m.take_evicted()) == [0, 1] and m.num_free() == 0


def prefill(table: SlotTable, rid: int, n: int, start: int = 0) -> None:
    ids = [-2 - i for i in range(start, start + n)]
    table.plan(rid, ids, [ids[0] + 1 if start else NO_PARENT] + ids[:-1])
    table.commit(rid, ids)
    table.computed(rid)


def test_a_whole_block_joins_the_cache_as_it_is_and_is_read_by_the_next_request():
    t = SlotTable(4, 2)
    t.admit(1)
    prefill(t, 1, 3)
    assert t.share(1, [0], [40]) == []  # positions 0, 1 fill block 0 in order: no copy
    t.release(1)
    assert t.cached == {40: 0} and t.pool.num_free() == 3 and t.idle == 1 and t.blocks_in_use() == 0
    t.admit(2, [40])
    assert t.requests[2].committed == [0, 1]
    prefill(t, 2, 1, start=2)
    assert t.requests[2].committed == [0, 1, 2]  # its own rows take its own block
    assert t.idle == 0 and t.blocks_in_use() == 2
    with pytest.raises(KVStateError):
        t.evict([40])  # read by request 2
    t.release(2)
    t.evict([40])
    assert t.pool.num_free() == 4 and not t.cached and t.idle == 0


def test_positions_a_tree_scattered_are_copied_into_one_block_at_release():
    t = SlotTable(4, 2)
    t.admit(1)
    prefill(t, 1, 1)  # position 0 -> slot 0
    t.plan(1, [5, 6], [-2, -2])  # two siblings at position 1: slots 1, 2
    t.drop(1, [5])  # the first is wrong: slot 1 is free again
    t.commit(1, [6])
    assert t.requests[1].committed == [0, 2]
    with pytest.raises(KVStateError):
        t.share(1, [0], [7])  # not one block's slots in order, and the request still runs
    moves = t.share(1, [0], [7], final=True)
    assert moves == [(2, 1)] and t.cached == {7: 0}
    t.release(1)
    assert t.pool.num_free() == 3


def test_a_stage_that_lost_a_request_fails_the_next_reader_of_its_blocks():
    t = SlotTable(4, 2)
    t.admit(1)
    prefill(t, 1, 3)
    t.fail(1)
    assert t.share(1, [0], [8]) == []  # it cannot hold them: remembered as lost
    assert t.admit(2, [8]) is False and t.requests[2].failed
    t.evict([8])
    assert not t.lost
