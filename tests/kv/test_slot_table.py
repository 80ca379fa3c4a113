"""KV slot bookkeeping: pure Python, no torch. Paged: blocks per request follow the rule the
driver's block manager mirrors (ceil(peak slots / block_size)), checked on random histories."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpipe.kv.slot_table import NO_PARENT, KVCacheFull, KVStateError, SlotTable


def test_prefill_is_a_causal_chain():
    m = SlotTable(4, 4)
    m.admit(7)
    plan = m.plan(7, [-2, -3, 0], [NO_PARENT, -2, -3])
    assert plan.write_slots == [0, 1, 2]
    assert plan.read_slots == [0, 1, 2]
    assert plan.mask.tolist() == np.tri(3, dtype=bool).tolist()


def test_tree_mask_is_ancestry_and_commit_moves_slots_without_copy():
    m = SlotTable(8, 4)
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
    assert m.commit(1, [1]) == 1
    assert m.requests[1].committed == [0, 1, slot_of[1]]
    assert set(m.requests[1].spec) == {3}
    assert m.total_in_use() == 4
    assert len(m.requests[1].blocks) == 2 == m.blocks_in_use()  # the peak was 6 slots
    m.release(1)
    assert m.total_in_use() == 0 and m.blocks_in_use() == 0


def test_every_tree_row_reads_its_slots_in_position_order():
    """Attention sums over the read slots in read order: a tree row must read its committed
    prefix and then its ancestors root first, as plain decoding reads the same tokens, or its
    bits depend on the tree around it (float sums in another order round differently)."""
    m = SlotTable(16, 4)
    m.admit(1)
    m.plan(1, [-2, 0], [NO_PARENT, -2])
    m.commit(1, [-2, 0])
    m.computed(1)
    m.plan(1, [1, 2], [0, 0])  # layer 1 of the tree (its parent 0 committed)
    # a later message: layer 2 and, in the same rows, layer 3 (each after its parent, but before
    # its parent's siblings, so a column order taken from the rows' own order would not be
    # position order)
    nodes, parents = [3, 5, 4, 6, 7], [1, 3, 2, 4, 5]
    plan = m.plan(1, nodes, parents)
    depth = {0: 0, 1: 1, 2: 1, 3: 2, 4: 2, 5: 3, 6: 3, 7: 4}
    node_of = {m.requests[1].spec[n][0]: n for n in m.requests[1].spec}
    base = len(m.requests[1].committed)
    for i, n in enumerate(nodes):
        seen = [node_of[s] for j, s in enumerate(plan.read_slots[base:]) if plan.mask[i, base + j]]
        assert [depth[x] for x in seen] == sorted(depth[x] for x in seen), (n, seen)
        assert seen[-1] == n and len(seen) == depth[n]


def test_commit_of_a_node_not_yet_computed_waits():
    m = SlotTable(2, 4)
    m.admit(0)
    m.plan(0, [-2], [NO_PARENT])
    assert m.commit(0, [-2, 5]) == 1  # node 5 is still upstream of this stage
    assert m.requests[0].committed == [0] and list(m.requests[0].pending) == [5]
    m.plan(0, [5], [-2])
    assert m.computed(0) == 1
    assert m.requests[0].committed == [0, 1] and not m.requests[0].pending


def test_rows_pruned_in_transit_are_recognised():
    m = SlotTable(2, 4)
    m.admit(0)
    m.plan(0, [-2], [NO_PARENT])
    m.drop(0, [3, 4])
    assert m.live_rows(0, [3, 5, 4]) == [1]
    with pytest.raises(KVStateError):
        m.plan(0, [9], [3])  # a child of a pruned node must never be computed


def test_requests_own_their_blocks_and_a_sequence_reads_contiguous_slots():
    m = SlotTable(4, 4)
    m.admit(0)
    m.admit(1)
    a = m.plan(0, [10, 11, 12], [NO_PARENT, 10, 11])
    b = m.plan(1, [20], [NO_PARENT])
    assert a.write_slots == [0, 1, 2] and b.write_slots == [4]  # request 1 took block 1
    # Request 0 fills its own block before taking another, and the next block it gets is 2.
    c = m.plan(0, [13, 14], [12, 13])
    assert c.write_slots == [3, 8]
    assert m.requests[0].blocks == [0, 2] and m.requests[1].blocks == [1]
    m.release(0)
    m.admit(2)
    assert m.plan(2, [30], [NO_PARENT]).write_slots == [0]  # lowest free block first


def test_pool_exhaustion_fails_only_the_plan_and_leaks_nothing():
    m = SlotTable(2, 4)
    m.admit(0)
    m.admit(1)
    m.plan(0, list(range(5)), [NO_PARENT, 0, 1, 2, 3])  # two blocks: the whole pool
    with pytest.raises(KVCacheFull):
        m.plan(1, [100], [NO_PARENT])
    assert m.requests[1].blocks == [] and m.requests[1].spec == {}
    # Request 0 still has 3 free slots of its own: it does not need the pool.
    m.plan(0, [5, 6, 7], [4, 5, 6])
    with pytest.raises(KVCacheFull):
        m.plan(0, [8], [7])
    assert m.total_in_use() == 8 and 8 not in m.requests[0].spec
    m.fail(0)  # frees its KV, keeps it as failed until released
    assert m.blocks_in_use() == 0 and m.requests[0].failed
    assert m.live_rows(0, [8, 9]) == [] and m.commit(0, [8]) == 0
    m.drop(0, [1])  # pruning a failed request is a no-op
    with pytest.raises(KVStateError):
        m.plan(0, [8], [7])
    m.release(0)
    assert 0 not in m.requests


def test_rejected_plan_changes_nothing():
    m = SlotTable(2, 4)
    m.admit(0)
    m.plan(0, [1, 2], [NO_PARENT, 1])
    before = (m.requests[0].spec.copy(), list(m.requests[0].free), m.blocks_in_use())
    for nodes, parents in [([3, 2], [2, 3]),  # node 2 computed twice
                           ([3, 3], [2, 3]),  # the same node twice in one message
                           ([3, 4], [2]),  # a parent missing
                           ([], [])]:
        with pytest.raises(KVStateError):
            m.plan(0, nodes, parents)
        assert (m.requests[0].spec, list(m.requests[0].free), m.blocks_in_use()) == before


# -- property: random histories of several requests -----------------------------------------------

OPS = st.lists(st.tuples(st.sampled_from(["grow", "prune", "commit", "release", "fail"]),
                         st.integers(0, 2), st.integers(1, 7)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, num_blocks=st.integers(1, 6), block_size=st.integers(1, 5))
def test_paged_table_invariants(ops, num_blocks, block_size):
    """Any history of plans (chains and trees), prunes, commits, failures and releases: no slot is
    held twice, every slot lies in a block its request owns, each request holds exactly
    ceil(peak slots / block_size) blocks, a refused plan changes nothing, and a release frees all."""
    m = SlotTable(num_blocks, block_size)
    peak: dict[int, int] = {}
    next_node = iter(range(10**6))
    for op, rid, n in ops:
        if rid not in m.requests:
            m.admit(rid)
            peak[rid] = 0
        r = m.requests[rid]
        if op == "grow" and not r.failed:
            # n new nodes, each under a random live node (or the committed tip).
            live = list(r.spec)
            nodes, parents = [], []
            for i in range(n):
                nodes.append(next(next_node))
                options = live + nodes[:-1]
                parents.append(options[(nodes[-1] * 7) % len(options)] if options else r.tip)
            state = (dict(r.spec), list(r.free), list(r.blocks), m.pool.num_free())
            try:
                plan = m.plan(rid, nodes, parents)
            except KVCacheFull:
                assert (dict(r.spec), list(r.free), list(r.blocks), m.pool.num_free()) == state
                continue
            assert len(plan.write_slots) == n and (plan.mask is None or plan.mask.shape[0] == n)
        elif op == "prune" and r.spec:
            m.drop(rid, sorted(r.spec)[:n])
        elif op == "commit" and r.spec:
            m.commit(rid, sorted(r.spec)[:1])
            m.computed(rid)
        elif op == "release":
            m.release(rid)
            peak.pop(rid)
        elif op == "fail" and not r.failed:
            m.fail(rid)
            peak[rid] = 0
        held = []
        for q, rq in m.requests.items():
            slots = rq.committed + [v[0] for v in rq.spec.values()]
            held += slots
            owned = {s for b in rq.blocks for s in range(b * block_size, (b + 1) * block_size)}
            assert set(slots) <= owned and set(rq.free) == owned - set(slots)
            peak[q] = max(peak[q], len(slots))
            assert len(rq.blocks) == -(-peak[q] // block_size)
            assert len(m.requests[q].blocks) == len(rq.blocks)
        assert len(held) == len(set(held)) == m.total_in_use()
        assert m.blocks_in_use() == sum(len(rq.blocks) for rq in m.requests.values())
    for rid in list(m.requests):
        m.release(rid)
    assert m.blocks_in_use() == 0 and m.total_in_use() == 0 and m.pool.num_free() == num_blocks


def test_a_pruned_row_arriving_late_is_discarded_and_then_forgotten():
    """A stage at index 2 (horizon 3): a node pruned before its row arrived is discarded when it
    comes (within the horizon), and the id is forgotten once no row of it can still come."""
    m = SlotTable(8, 4, horizon=3)
    m.admit(1)
    m.tick()
    m.plan(1, [-2, 0], [NO_PARENT, -2])
    m.commit(1, [-2, 0])
    m.computed(1)
    m.tick()
    m.plan(1, [1], [0])
    m.drop(1, [1, 2, 3])  # 1 computed here: its row will not come again; 2 and 3 still travel
    assert set(m.requests[1].dropped) == {2, 3}
    for _ in range(3):
        m.tick()
    assert m.live_rows(1, [2, 4]) == [1]  # 2 arrives late: still discarded
    with pytest.raises(KVStateError):
        m.plan(1, [5], [2])  # and a child of it is refused
    m.tick()
    assert not m.requests[1].dropped  # past the horizon no row of 2 or 3 can come


def test_dropped_stays_bounded_over_a_long_request():
    """Every step a layer of nodes is sent and the previous one pruned while its rows are still
    in flight (never arriving here: discarded upstream): `dropped` holds a few steps' worth."""
    m = SlotTable(64, 4, horizon=3)
    m.admit(1)
    m.plan(1, [-2, 0], [NO_PARENT, -2])
    m.commit(1, [-2, 0])
    sizes = []
    for step in range(2000):
        m.tick()
        m.drop(1, [10 * step + k for k in range(4)])
        sizes.append(len(m.requests[1].dropped))
    assert max(sizes) <= 4 * 4


@pytest.mark.parametrize("nodes,parents", [([3], [3]), ([3, 4], [4, 3]), ([3, 4, 5], [5, 3, 4])])
def test_rows_whose_parents_form_a_cycle_are_refused_untouched(nodes, parents):
    """A self-parent or a cycle in a rows message (a hostile or corrupt peer) used to send the
    ancestor walk round for ever; now the plan is refused and the table left as it was."""
    import threading

    m = SlotTable(16, 4)
    m.admit(1)
    m.plan(1, [0], [NO_PARENT])
    free = m.pool.num_free()
    errors = []
    th = threading.Thread(target=lambda: errors.append(pytest.raises(KVStateError, m.plan, 1, nodes, parents)),
                          daemon=True)
    th.start()
    th.join(10)
    assert not th.is_alive(), "the plan never returned"
    assert "cycle" in str(errors[0].value) and m.pool.num_free() == free and not set(nodes) & set(m.requests[1].spec)


def _refused_in_time(m: SlotTable, *plans) -> KVStateError:
    """Run the plans in a thread (the old ancestor walk never returned): one must be refused."""
    import threading

    errors = []

    def run():
        try:
            for p in plans:
                m.plan(*p)
        except KVStateError as e:
            errors.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(10)
    assert not th.is_alive(), "the plan never returned"
    assert errors, "the plan was not refused"
    return errors[0]


def test_a_parent_cycle_across_two_messages_is_refused():
    """Issue 57 finding 5: step k A's parent B, step k+1 B's parent A passed the per-message check
    and the ancestor walk looped for ever. A row's parent must be a node held here (live, or the
    committed tip) or an earlier row, so A is refused at once, and B could not be declared after."""
    m = SlotTable(16, 4)
    m.admit(1)
    m.plan(1, [0], [NO_PARENT])
    m.commit(1, [0])
    e = _refused_in_time(m, (1, [10], [11]), (1, [11], [10]))
    assert "parent 11 is neither a node this stage holds" in str(e) and e.source == "rows"
    assert set(m.requests[1].spec) == set() and m.requests[1].tip == 0


def test_a_node_held_as_a_parent_cannot_be_declared_again():
    """A hostile driver commits around a live node (no drop): the node keeps the old tip as its
    parent; declaring that id again as the node's child would close a loop."""
    m = SlotTable(16, 4)
    m.admit(1)
    m.plan(1, [0, 1], [NO_PARENT, 0])
    m.commit(1, [0])
    m.plan(1, [2], [1])
    m.commit(1, [1])  # tip 1; node 2 lives on under it
    m.plan(1, [3], [1])  # a sibling of 2, never pruned
    m.commit(1, [3])
    e = _refused_in_time(m, (1, [1], [2]))
    assert "already held here" in str(e)


def test_after_a_cached_prefix_the_first_parent_named_becomes_the_tip():
    """Cached positions' node ids are the driver's: the first row names the tip, and that id
    cannot come back as a row below it."""
    m = SlotTable(16, 4)
    m.admit(1)
    m.plan(1, [-2, -3, -4, -5], [NO_PARENT, -2, -3, -4])
    m.commit(1, [-2, -3, -4, -5])
    m.computed(1)
    m.share(1, [0], [9])
    m.admit(2, [9])
    assert m.requests[2].tip is None
    plan = m.plan(2, [7], [-5], positions=[4])
    assert plan.write_slots and m.requests[2].tip == -5
    _refused_in_time(m, (2, [-5], [7]))
    with pytest.raises(KVStateError, match="parent 6 is neither"):
        m.plan(2, [8], [6])


def test_positions_follow_the_parents():
    m = SlotTable(16, 4)
    m.admit(1)
    with pytest.raises(KVStateError, match="position 1"):
        m.plan(1, [0], [NO_PARENT], positions=[1])
    m.plan(1, [0, 1], [NO_PARENT, 0], positions=[0, 1])
    with pytest.raises(KVStateError, match=r"node 2 at position 1000000000000, but its parent 1 is at 1"):
        m.plan(1, [2], [1], positions=[10**12])
    m.plan(1, [2, 3, 4], [1, 1, 3], positions=[2, 2, 3])
    assert {n: v[2] for n, v in m.requests[1].spec.items()} == {0: 0, 1: 1, 2: 2, 3: 2, 4: 3}


def test_the_ancestor_walk_is_bounded_by_the_live_nodes():
    """A second line of defence: should links ever form a loop, the walk is an error, not a hang."""
    m = SlotTable(16, 4)
    m.admit(1)
    m.plan(1, [0, 1, 2], [NO_PARENT, 0, 1])
    r = m.requests[1]
    r.spec[1] = (r.spec[1][0], 2, 1)  # corrupt: 1 <-> 2
    e = _refused_in_time(m, (1, [5], [2]))
    assert "loop" in str(e)
