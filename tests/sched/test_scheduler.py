"""Property tests of the scheduler and block manager (pure Python, no model).

A simulated workload: requests with a prompt (chunkable must rows), then decode steps that each
need one committed row and would like up to W speculative rows; after each step some speculative
rows are pruned. Whatever the sizes, the scheduler must never exceed the row budget or the KV
pool, must hold enough blocks for everything each request has sent, must give every request its
full width when it is alone, and every request must finish.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specpipe.sched.block_manager import BlockManager, blocks_for
from specpipe.sched.scheduler import Grant, QueueFull, Scheduler, Want


@dataclass
class Sim:
    prompt: int
    decode_steps: int
    width: int
    prefilled: int = 0
    decoded: int = 0
    spec_live: int = 0
    preempted: int = 0

    @property
    def held(self) -> int:
        return self.prefilled + self.decoded + self.spec_live

    def want(self) -> Want:
        if self.prefilled < self.prompt:
            return Want(must=self.prompt - self.prefilled, chunkable=True, held=self.held)
        return Want(must=1, spec=self.width, held=self.held)

    def reset(self) -> None:  # preempted: recomputed later from prompt + what it decoded
        self.prompt += self.decoded
        self.decode_steps -= self.decoded
        self.prefilled = self.decoded = self.spec_live = 0
        self.preempted += 1


workloads = st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12), st.integers(0, 8)), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(workloads, st.integers(8, 64), st.sampled_from([None, 8, 16, 40]), st.integers(1, 6), st.integers(1, 16))
def test_budget_pool_and_progress(work, num_blocks, step_rows, max_num_seqs, block_size):
    step_rows = None if step_rows is None else max(step_rows, max_num_seqs)
    blocks = BlockManager(num_blocks, block_size)
    sched = Scheduler(blocks, max_num_seqs, step_rows)
    sims = {}
    for i, (prompt, steps, width) in enumerate(work):
        # The engine refuses a request that could not fit alone (committed tokens + its tree).
        if blocks_for(prompt + steps + width, block_size) > num_blocks - sched.watermark:
            continue
        sims[i] = Sim(prompt, steps, width)
        sched.add(i)
    done: set[int] = set()
    limit = sum(s.prompt + s.decode_steps for s in sims.values()) * 20 + 50
    for _ in range(limit):
        if not sched.has_work():
            break
        plan = sched.schedule(lambda r: sims[r].want())
        for r in plan.preempted:
            sims[r].reset()
            assert r in sched.waiting and blocks.held(r) == 0
        rows = 0
        for r, g in plan.grants.items():
            s, w = sims[r], sims[r].want()
            assert 0 <= g.must <= w.must and 0 <= g.spec <= w.spec
            rows += g.rows
            if s.prefilled < s.prompt:
                s.prefilled += g.must
            else:
                s.decoded += g.must
                s.spec_live += g.spec
            # Every slot it may hold at a stage is covered by its blocks.
            assert blocks.held(r) * block_size >= s.held
        if step_rows is not None:
            assert rows <= step_rows
        assert sum(blocks.pool.held.values()) <= num_blocks
        assert len(sched.running) <= max_num_seqs
        for r in list(sched.running):
            s = sims[r]
            s.spec_live //= 2  # verification prunes part of the tree
            if s.prefilled >= s.prompt and s.decoded >= s.decode_steps:
                sched.remove(r)
                done.add(r)
    assert done == set(sims), "a request never finished (starved)"
    assert blocks.num_free() == num_blocks


def test_alone_a_request_gets_its_full_width_and_narrows_as_others_arrive():
    blocks = BlockManager(1000, 16)
    sched = Scheduler(blocks, max_num_seqs=8, step_rows=24)
    wants = {r: Want(must=1, spec=8) for r in range(6)}
    sched.add(0)
    assert sched.schedule(wants.get).grants[0].spec == 8  # alone: the full width W
    for r in range(1, 6):
        sched.add(r)
    plan = sched.schedule(wants.get)
    assert all(g.must == 1 for g in plan.grants.values())
    assert sum(g.rows for g in plan.grants.values()) == 24
    assert {g.spec for g in plan.grants.values()} <= {3}  # 18 slack rows shared by 6


def test_leftover_speculative_rows_rotate_so_nobody_is_always_cut():
    sched = Scheduler(BlockManager(1000, 16), max_num_seqs=8, step_rows=10)
    wants = {r: Want(must=1, spec=4) for r in range(8)}
    for r in range(8):
        sched.add(r)
    got = {r: 0 for r in range(8)}
    for _ in range(8):
        for r, g in sched.schedule(wants.get).grants.items():
            got[r] += g.spec
    assert min(got.values()) >= 1  # 2 slack rows a step among 8 requests: everyone had some


def test_speculation_only_uses_kv_slack_and_must_rows_preempt_the_newest():
    blocks = BlockManager(10, 4)  # 40 slots
    sched = Scheduler(blocks, max_num_seqs=4, step_rows=None)
    wants = {0: Want(must=12, chunkable=True), 1: Want(must=12, chunkable=True)}
    sched.add(0)
    sched.add(1)
    plan = sched.schedule(wants.get)
    assert plan.admitted == [0, 1] and blocks.num_free() == 4
    wants = {0: Want(must=1, spec=30, held=12), 1: Want(must=1, spec=30, held=12)}
    plan = sched.schedule(wants.get)
    assert all(g.must == 1 for g in plan.grants.values())
    assert sum(blocks.held(r) for r in (0, 1)) <= 10 - sched.watermark  # the trees took only the slack
    wants = {0: Want(must=20, held=13), 1: Want(must=1, held=13)}  # request 0 now needs far more
    plan = sched.schedule(wants.get)
    assert plan.preempted == [1] and list(sched.waiting) == [1] and plan.grants[0].must == 20


def test_waiting_queue_is_bounded():
    sched = Scheduler(BlockManager(10, 4), max_num_seqs=1, max_waiting=2)
    sched.add(0)
    sched.add(1)
    with pytest.raises(QueueFull):
        sched.add(2)


def test_one_client_cannot_fill_the_waiting_queue():
    """Before, one key's burst took every waiting place and every other key got QueueFull."""
    sched = Scheduler(BlockManager(10, 4), max_num_seqs=1, max_waiting=6)
    assert sched.max_waiting_per_client == 3  # half the queue by default
    for r in range(3):
        sched.add(r, "key:a")
    with pytest.raises(QueueFull, match="this client already has 3 requests waiting"):
        sched.add(3, "key:a")
    for r in range(4, 7):  # another client still finds room
        sched.add(r, "key:b")
    sched.remove(0)  # a place of its own frees up: the first client may queue again
    sched.add(7, "key:a")
    anonymous = Scheduler(BlockManager(10, 4), max_num_seqs=1, max_waiting=3)
    for r in range(3):  # untagged requests (the Python API) share the whole queue
        anonymous.add(r)
    one = Scheduler(BlockManager(10, 4), max_num_seqs=1, max_waiting=4, max_waiting_per_client=1)
    one.add(0, "a")
    with pytest.raises(QueueFull):
        one.add(1, "a")
    for bad in (0, 5):
        with pytest.raises(ValueError, match="max_waiting_per_client"):
            Scheduler(BlockManager(10, 4), max_num_seqs=1, max_waiting=4, max_waiting_per_client=bad)


def test_a_budget_smaller_than_the_running_set_is_refused():
    with pytest.raises(ValueError):
        Scheduler(BlockManager(10, 4), max_num_seqs=8, step_rows=4)


def test_a_prompt_streaming_in_does_not_cut_the_running_trees():
    sched = Scheduler(BlockManager(1000, 16), max_num_seqs=4, step_rows=64)
    wants = {0: Want(must=1, spec=8, held=40), 1: Want(must=500, chunkable=True)}
    sched.add(0)
    sched.schedule(lambda r: Want(must=40, chunkable=True))  # request 0's prompt
    sched.add(1)
    plan = sched.schedule(wants.get)
    assert plan.grants[0] == Grant(1, 8)  # the running request keeps its full width
    assert plan.grants[1].must == 55  # the prompt takes the rest of the budget
    # Many trees never starve a prompt: it keeps at least half of the slack.
    many = Scheduler(BlockManager(1000, 16), max_num_seqs=40, step_rows=40)
    for r in range(33):
        many.add(r)
    many.schedule(lambda r: Want(must=1, chunkable=True))  # 33 one-token prompts: all admitted
    wants = {r: Want(must=1, spec=8, held=1) for r in range(32)}
    wants[32] = Want(must=100, chunkable=True, held=1)
    plan = many.schedule(wants.get)
    assert plan.grants[32].must >= 4  # (40 - 32 single rows) / 2


@pytest.mark.parametrize("num_blocks, block_size", [(2, 1), (8, 16), (300, 4)])
def test_a_request_of_admissible_size_is_admitted_on_an_empty_pool(num_blocks, block_size):
    sched = Scheduler(BlockManager(num_blocks, block_size), 4)
    sched.add(0)
    plan = sched.schedule(lambda rid: Want(must=sched.admissible_tokens))
    assert plan.admitted == [0]


def test_a_waiting_queue_without_room_is_refused():
    with pytest.raises(ValueError, match="max_waiting"):
        Scheduler(BlockManager(8, 16), 4, max_waiting=0)
