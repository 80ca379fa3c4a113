"""The speculative mode's record (engine/modes/draft_progress.py): its phases as a request goes
through them, and each invariant `check` states caught when a path breaks it. (Every engine in
the suite runs `check` after each step: tests/conftest.py sets SPECPIPE_CHECK_STATE.)"""

from __future__ import annotations

import pytest

from specpipe.engine.core import EngineCore
from specpipe.engine.modes.draft_progress import CHECK_STATE, DraftStateError, Phase
from specpipe.engine.modes.specpipe import SpecPipeState
from specpipe.request import Request
from specpipe.sampling import SamplingParams
from test_lossless import TINY_PROMPT, make_pipeline, self_draft, tiny8  # noqa: F401

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_the_suite_checks_every_step():
    assert CHECK_STATE


@pytest.fixture
def running(tiny8):
    """A specpipe request at S = 2 stepped until it has speculated (a hit on a sent node)."""
    target, _ = tiny8
    core = EngineCore(make_pipeline(target, 2, 8, len(TINY_PROMPT) + GREEDY.max_tokens), "specpipe",
                      self_draft(target, 2), width=2, kv_blocks=64, block_size=16)
    req = Request(0, TINY_PROMPT, GREEDY, frozenset())
    core.add_request(req)
    phases = []
    while core.has_work():
        core.step()
        st = next(iter(core.states.values()), None)
        if st is None:
            break
        phases.append(st.phase)
        if req.stats.hits and st.d.sent - {st.tree.root_id} and st.d.fed - {st.tree.root_id}:
            return st, phases
    pytest.fail("the self-draft never hit")


def test_phases_in_order(running):
    st, phases = running
    assert isinstance(st, SpecPipeState)
    assert phases[0] in (Phase.PROMPT, Phase.NEW_ROOT, Phase.FLOWING)
    assert Phase.FLOWING in phases
    # the prompt comes first and never again
    firsts = [p for p in phases if p is not Phase.PROMPT]
    assert phases[:len(phases) - len(firsts)] == [Phase.PROMPT] * (len(phases) - len(firsts))
    st.check()  # a consistent record passes


def source_lost_the_root(st):
    """The source's record says it took in the root's children but not the root."""
    st.d.props.pop(st.tree.root_id, None)
    st.d.fed.discard(st.tree.root_id)


def proposals_for_an_unseen_node(st):
    n = max(st.d.sent)
    st.d.props[n] = [(1, 0.0)]
    st.d.fed.discard(n)


def a_depth_for_an_unsent_node(st):
    st.d.drafted_depth[st.tree.root_id] = 0
    st.d.sent.discard(st.tree.root_id)


def held_back_without_lagging(st):
    st.d.lagging = False
    st.d.behind.append((1, 0, 1, 1))


@pytest.mark.parametrize("break_it, message", [
    (source_lost_the_root, "without its parent"),
    (proposals_for_an_unseen_node, "never took in"),
    (lambda st: st.d.sent.add(10 ** 6), "no longer has"),
    (a_depth_for_an_unsent_node, "never sent"),
    (held_back_without_lagging, "cannot lag"),
])
def test_each_invariant_is_caught(running, break_it, message):
    st, _ = running
    break_it(st)
    with pytest.raises(DraftStateError, match=message):
        st.check()


def test_the_counters_are_checked(running):
    st, _ = running
    st.req.stats.hits_by_depth[7] = st.req.stats.hits_by_depth.get(7, 0) + 1
    with pytest.raises(DraftStateError, match="hits by depth"):
        st.check()
