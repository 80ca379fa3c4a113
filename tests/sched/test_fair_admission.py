"""Fair admission across clients (pure Python): while another client waits, no client holds more
than its share of the running slots; with one client the queue is plain FIFO."""

from __future__ import annotations

from collections import Counter

from specpipe.sched.block_manager import BlockManager
from specpipe.sched.scheduler import Scheduler, Want


def decode_want(rid: int) -> Want:
    return Want(must=1, held=4)


def running_by_client(sched: Scheduler) -> Counter:
    return Counter(sched.client[r] for r in sched.running)


def test_a_client_that_queued_first_does_not_take_every_slot():
    sched = Scheduler(BlockManager(1024, 16), max_num_seqs=4)
    for rid in range(6):
        sched.add(rid, "a")
    sched.add(6, "b")
    sched.add(7, "b")
    plan = sched.schedule(decode_want)
    assert plan.admitted == [0, 6, 1, 7]  # round-robin, the oldest of each client first
    assert running_by_client(sched) == {"a": 2, "b": 2}


def test_freed_slots_go_to_the_client_holding_fewest():
    sched = Scheduler(BlockManager(1024, 16), max_num_seqs=4)
    for rid in range(8):
        sched.add(rid, "a")
    sched.schedule(decode_want)
    assert sched.running == [0, 1, 2, 3]  # alone, "a" may use every slot
    sched.add(100, "b")
    sched.add(101, "b")
    # No preemption for fairness: "a" keeps what it runs, but every slot it frees goes to "b"
    # until both hold their share.
    admitted = []
    for done in (0, 1, 2):
        sched.remove(done)
        admitted += sched.schedule(decode_want).admitted
    assert admitted == [100, 101, 4]
    assert running_by_client(sched) == {"a": 2, "b": 2}
    assert list(sched.waiting) == [5, 6, 7]


def test_one_client_or_none_is_fifo():
    for client in (None, "k"):
        sched = Scheduler(BlockManager(1024, 16), max_num_seqs=3)
        for rid in range(5):
            sched.add(rid, client)
        assert sched.schedule(decode_want).admitted == [0, 1, 2]
        sched.remove(1)
        assert sched.schedule(decode_want).admitted == [3]


def test_a_request_that_does_not_fit_is_not_overtaken():
    """Fairness picks who is next; it never lets a small request pass a big one that waits for KV."""
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4)  # 64 slots, watermark 1 block
    sched.add(0, "a")
    sched.schedule(lambda rid: Want(must=40))
    sched.add(1, "b")  # needs more than is left
    sched.add(2, "a")
    plan = sched.schedule(lambda rid: Want(must=40) if rid == 1 else Want(must=1, held=40 if rid == 0 else 0))
    assert plan.admitted == [] and list(sched.waiting) == [1, 2]
