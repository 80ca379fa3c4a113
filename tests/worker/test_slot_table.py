"""KV slot bookkeeping: pure Python, no torch."""

import numpy as np
import pytest

from specpipe.worker.slot_table import NO_PARENT, KVCacheFull, KVManager, KVStateError, SlotAllocator


def test_allocator_reuses_lowest_freed_slots():
    a = SlotAllocator(8)
    assert a.alloc(3) == [0, 1, 2]
    a.free([1, 0])
    assert a.alloc(3) == [0, 1, 3]
    assert a.num_used() == 4
    with pytest.raises(KVCacheFull):
        a.alloc(5)


def test_prefill_is_a_causal_chain():
    m = KVManager(16)
    m.admit(7)
    plan = m.plan(7, [-2, -3, 0], [NO_PARENT, -2, -3])
    assert plan.write_slots == [0, 1, 2]
    assert plan.read_slots == [0, 1, 2]
    assert plan.mask.tolist() == np.tri(3, dtype=bool).tolist()


def test_tree_mask_is_ancestry_and_commit_moves_slots_without_copy():
    m = KVManager(32)
    m.admit(1)
    m.plan(1, [-2, 0], [NO_PARENT, -2])
    m.commit(1, [-2, 0])
    m.computed(1)
    assert m.requests[1].committed == [0, 1]
    # layer 1: nodes 1, 2 under root 0; layer 2: 3 under 1, 4 under 2 (sent in one message)
    plan = m.plan(1, [1, 2, 3, 4], [0, 0, 1, 2])
    base = 2
    cols = plan.read_slots[base:]
    slot_of = {n: m.requests[1].spec[n][0] for n in (1, 2, 3, 4)}
    seen = {n: {c for j, c in enumerate(cols) if plan.mask[i, base + j]} for i, n in enumerate([1, 2, 3, 4])}
    assert seen[3] == {slot_of[1], slot_of[3]}
    assert seen[4] == {slot_of[2], slot_of[4]}
    assert plan.mask[:, :base].all()
    # hit on node 1: commit it, drop the sibling subtree; node 3's slot stays where it is
    m.drop(1, [2, 4])
    m.commit(1, [1])
    assert m.requests[1].committed == [0, 1, slot_of[1]]
    assert set(m.requests[1].spec) == {3}
    assert m.total_in_use() == 4
    m.release(1)
    assert m.total_in_use() == 0


def test_commit_of_a_node_not_yet_computed_waits():
    m = KVManager(8)
    m.admit(0)
    m.plan(0, [-2], [NO_PARENT])
    m.commit(0, [-2, 5])  # node 5 is still upstream of this stage
    assert m.requests[0].committed == [0] and list(m.requests[0].pending) == [5]
    m.plan(0, [5], [-2])
    m.computed(0)
    assert m.requests[0].committed == [0, 1] and not m.requests[0].pending


def test_rows_pruned_in_transit_are_recognised():
    m = KVManager(8)
    m.admit(0)
    m.plan(0, [-2], [NO_PARENT])
    m.drop(0, [3, 4])
    assert m.live_rows(0, [3, 5, 4]) == [1]
    with pytest.raises(KVStateError):
        m.plan(0, [9], [3])  # a child of a pruned node must never be computed
