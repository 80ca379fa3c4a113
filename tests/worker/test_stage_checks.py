"""What a stage accepts (issue 57, findings 5, 6, 8): each bad Control or Rows is refused with an
error naming the message at fault (`source`), before anything changes, so that the same stage
then serves a valid step exactly as if the bad one had never come."""

from __future__ import annotations

import copy

import pytest
import torch

from specpipe.config import StageSpec
from specpipe.distributed.wire import RowsMalformed
from specpipe.kv.slot_table import ControlRefused, RowsRefused
from specpipe.loader import open_checkpoint
from specpipe.messages import NO_PARENT, Admit, Control, Prune, Rows, Share
from specpipe.model.stage import build_stage
from specpipe.sampling import SamplingParams
from specpipe.worker.stage_worker import StageWorker

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
PROMPT = [5, 17, 33, 90, 5, 17, 33]


@pytest.fixture(scope="module")
def stages(tiny_llama_dir):
    """Builds (first, last) stage workers of the tiny model afresh, two layers each."""
    ckpt = open_checkpoint(tiny_llama_dir)
    n = ckpt.config.num_layers

    def make(blocks: int = 16) -> tuple[StageWorker, StageWorker]:
        return (StageWorker(build_stage(ckpt, StageSpec(0, n // 2, True, False)), blocks, BLOCK, horizon=1),
                StageWorker(build_stage(ckpt, StageSpec(n // 2, n, False, True)), blocks, BLOCK, horizon=2))
    return make


def state(w: StageWorker):
    t = w.slots
    return copy.deepcopy((t.requests, t.cached, dict(t.readers), t.lost, t.clock, sorted(t.pool._free), t.idle,
                          sorted(w.sampling), w.stats.steps)), w.kv.k.clone()


def assert_refused(w: StageWorker, error, source: str, control: Control, rows: list[Rows], match: str = ""):
    before, k = state(w)
    with pytest.raises(error, match=match) as e:
        w.step(control, rows)
    assert e.value.source == source
    after, k2 = state(w)
    assert after == before and torch.equal(k, k2), "a refused step changed the stage"


def prompt_rows(rid: int = 0) -> Rows:
    n = len(PROMPT)
    return Rows(rid, list(range(n)), [NO_PARENT] + list(range(n - 1)), list(range(n)), torch.tensor(PROMPT),
                head_rows=[n - 1])


def decode(first: StageWorker, last: StageWorker, rid: int, steps: int) -> list[int]:
    """Greedy pp decoding through the two stages (node id = position)."""
    n = len(PROMPT)
    control = Control(admit=[Admit(rid, GREEDY)], prune=[Prune(rid, commit=list(range(n)))])
    hidden = first.step(control, [prompt_rows(rid)])
    tokens = []
    for _ in range(steps):
        (res,) = last.step(control, hidden)
        tok, pos = res.tokens[-1], n + len(tokens)
        tokens.append(tok)
        control = Control(prune=[Prune(rid, commit=[pos])])
        hidden = first.step(control, [Rows(rid, [pos], [pos - 1], [pos], torch.tensor([tok]))])
    release = Control(release=[rid])
    first.step(release, [])
    last.step(release, [])
    return tokens


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


def test_commits_that_could_never_settle_are_refused(stages):
    """A Control whose commits wait for more rows than the pool could ever hold (a deque that
    would grow every step)."""
    first, _ = stages(blocks=2)
    first.step(Control(admit=[Admit(0, GREEDY)]), [])
    assert_refused(first, ControlRefused, "control", Control(prune=[Prune(0, commit=list(range(100, 109)))]), [],
                   "9 commits waiting")
