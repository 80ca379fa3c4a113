"""What a stage accepts (issue 57, findings 5, 6, 8): each bad Control or Rows is refused with an
error naming the message at fault (`source`), before anything changes, so that the same stage
then serves a valid step exactly as if the bad one had never come."""

from __future__ import annotations

import torch

from specpipe.distributed.wire import RowsMalformed
from specpipe.kv.slot_table import ControlRefused, RowsRefused
from specpipe.messages import NO_PARENT, Admit, Control, Prune, Rows, Share
from worker_helpers import GREEDY, assert_refused, decode, prompt_rows, stages  # noqa: F401 (a fixture)


def test_a_refused_step_leaves_the_stage_as_it_was(stages):
    first, last = stages()
    want = decode(*stages(), rid=0, steps=5)
    # Half-applied before: the release went through, then "admitted twice" was raised.
    first.step(Control(admit=[Admit(9, GREEDY)]), [])
    assert_refused(first, ControlRefused, "control", Control(release=[9], admit=[Admit(3, GREEDY), Admit(3, GREEDY)]),
                   [], "admitted twice")
    assert_refused(first, ControlRefused, "control", Control(admit=[Admit(9, GREEDY)]), [], "admitted twice")
    assert_refused(first, ControlRefused, "control", Control(evict=[12]), [], "evicted while absent")
    assert_refused(first, ControlRefused, "control", Control(share=[Share(9, [-1], [4])]), [], "not settled")
    # Valid Control, bad Rows: neither is applied.
    assert_refused(first, RowsRefused, "rows", Control(admit=[Admit(0, GREEDY)], prune=[Prune(0, commit=[0])]),
                   [Rows(0, [1, 0], [0, NO_PARENT], [1, 0], torch.tensor([1, 2]))], "comes after it")
    first.step(Control(release=[9]), [])
    assert decode(first, last, rid=0, steps=5) == want


def test_a_cycle_across_two_messages_is_refused_by_the_worker(stages):
    """Issue 57 finding 5 through a stage: step k node A under B (not held), step k+1 B under A."""
    first, _ = stages()
    first.step(Control(admit=[Admit(0, GREEDY)], prune=[Prune(0, commit=[0])]),
               [Rows(0, [0], [NO_PARENT], [0], torch.tensor([3]))])
    assert_refused(first, RowsRefused, "rows", Control(), [Rows(0, [100], [101], [1], torch.tensor([3]))],
                   "parent 101 is neither")


def test_token_ids_sent_past_stage_one_are_named(stages):
    """Issue 57 finding 8: 1-D token ids into stage 2 were a RuntimeError inside the model."""
    first, last = stages()
    last.step(Control(admit=[Admit(0, GREEDY)]), [])
    assert_refused(last, RowsMalformed, "rows", Control(), [Rows(0, [0], [NO_PARENT], [0], torch.tensor([3]))],
                   "token ids go to stage 1 only")
    assert_refused(first, RowsMalformed, "rows", Control(admit=[Admit(0, GREEDY)]),
                   [Rows(0, [0], [NO_PARENT], [0], torch.zeros(1, first.limits.hidden))], "stage 1 takes token ids")
    assert_refused(first, RowsMalformed, "rows", Control(admit=[Admit(0, GREEDY)]),
                   [Rows(0, [0], [NO_PARENT], [0], torch.tensor([first.limits.vocab_size]))], "outside the vocabulary")


def test_masks_of_another_width_than_the_vocabulary_are_refused(stages):
    """Issue 57 finding 6, in-process: masks must be the vocabulary's width in int64 words."""
    first, last = stages()
    words = first.limits.mask_words
    assert words == -(-first.model.cfg.vocab_size // 64)
    for bad in (words + 1, 1 << 10):
        rows = prompt_rows()
        rows.masks = torch.zeros(1, bad, dtype=torch.long)
        assert_refused(first, RowsMalformed, "rows", Control(admit=[Admit(0, GREEDY)]), [rows], f"{bad} words")


def test_positions_must_follow_the_parents(stages):
    first, _ = stages()
    rows = prompt_rows()
    rows.positions = [0, 1, 2, 3, 4, 5, 10**15]
    assert_refused(first, RowsRefused, "rows", Control(admit=[Admit(0, GREEDY)]), [rows], "at position 1000000000000000")


def test_commits_and_requests_that_could_never_run_are_refused(stages):
    """A Control whose commits wait for more rows than the pool could ever hold, or that keeps
    more requests than it has slots (a deque, a table that would grow every step)."""
    first, _ = stages(blocks=2)
    first.step(Control(admit=[Admit(0, GREEDY)]), [])
    assert_refused(first, ControlRefused, "control", Control(prune=[Prune(0, commit=list(range(100, 109)))]), [],
                   "9 commits waiting")
    assert_refused(first, ControlRefused, "control", Control(admit=[Admit(rid, GREEDY) for rid in range(1, 9)]), [],
                   "9 requests held here")
