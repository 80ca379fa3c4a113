"""The engine's side of `--draft-async` (docs/design.md §4): drafting that no step waits for.

At the start of every step, before scheduling, `poll` looks at the one batch of draft calls in
flight (spec_decode/async_draft.py). If its forward has finished, each request still served takes
its proposals (the ones for nodes verification pruned meanwhile are dropped), and the next batch
starts at once: one call per request, from its tree as it is now (SpecPipeState.async_call: the
layer the last proposals allow is added, and the draft takes in what it has not seen: what was
sent, the new layer, and committed tokens it fell behind on). If the forward is still running,
the step goes on with the tree it has: the tree grows by a layer whenever the draft's result is
there, never by waiting for it. A finished forward is used in the step that finds it, before
that step's block is chosen.

One batch at a time, so the draft works through every request's calls in order and its forwards
hold all requests' rows at once, as the synchronous DURING phase does. Tree mode drafts its round
before sending it (the round needs its whole tree), so it keeps drafting synchronously through
the same worker; this drives modes specpipe and specpipe-db.

Structured output: each call carries the request's grammar masks, and the proposals that come
back are filtered by the grammar as synchronous drafting's are (engine/core.py _draft), so a
draft-ahead never puts a token the grammar forbids into the tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol

from specpipe.engine.observer import StepObserver
from specpipe.spec_decode.async_draft import AsyncDraft, Ticket

if TYPE_CHECKING:
    from specpipe.engine.modes.base import ModeState

ASYNC = "async"  # the observer's phase name for a forward started off the critical path


class DraftingCore(Protocol):
    """What this module needs from the engine core (engine/core.py EngineCore provides it), so
    the core imports this module and not the other way round."""

    observer: StepObserver

    def alive(self, st: "ModeState") -> bool:
        """The state still serves its request (not ended or restarted during this step)."""

    def own_fault(self, st: "ModeState", fn: Callable, *args, what: str = "drafting"):
        """fn(*args); an error there ends that request alone (returns None)."""

    def draft_failed(self, by_pid: dict) -> None:
        """Requests whose draft lost its KV go on unspeculated for now."""

    def allowed_proposals(self, st: "ModeState", want, k: int, props: dict) -> dict:
        """The proposals without the tokens the request's grammar forbids."""


class AsyncDrafting:
    def __init__(self, source: AsyncDraft) -> None:
        self.source = source
        self.ticket: Optional[Ticket] = None
        self._calls: list = []  # (state, call) of the batch in flight

    def poll(self, core: DraftingCore, states: list["ModeState"]) -> None:
        """Use the finished forward's proposals, then start the next forward (see the module)."""
        if self.ticket is not None:
            if not self.ticket.ready():
                return
            ticket, calls, self.ticket, self._calls = self.ticket, self._calls, None, []
            outs = ticket.result()
            core.observer.draft_ready()
            for (st, call), props in zip(calls, outs):
                if core.alive(st):
                    if call.masks is not None and not st.req.grammar.closed:
                        # as in synchronous drafting: no token the grammar forbids after its parent
                        props = core.own_fault(st, core.allowed_proposals, st, call.want, call.k, props)
                        if props is None:
                            continue  # the filter failed: the request ended with the cause
                    core.own_fault(st, st.async_proposals, call, props)
            core.draft_failed({st.pid: st for st, _ in calls})
        calls = [(st, c) for st in states
                 if core.alive(st) and (c := core.own_fault(st, self._next_call, st)) is not None]
        if not calls:
            return
        self.ticket, self._calls = self.source.submit([c for _, c in calls]), calls
        core.observer.drafted(ASYNC, self.ticket.rows)
        for st, _ in calls:
            st.req.stats.draft_calls += 1

    def _next_call(self, st: "ModeState"):
        """The request's next draft call, masked by its grammar; first, the failure of one of its
        earlier queued calls, if any, which ends this request alone (core.own_fault)."""
        self.source.raise_failure(st.pid)
        call = st.async_call()
        if call is not None:
            grammar_masks(st, call)
        return call

    def in_flight(self) -> bool:
        return self.ticket is not None


def grammar_masks(st: "ModeState", call) -> None:
    """Structured output: the call's draft masks its logits with the request's grammar, from the
    state after each wanted node's path (AsyncDraft.submit takes them on the driver's thread, since
    the grammar moves on with the tree), so it proposes allowed tokens only."""
    g = st.req.grammar
    if g is not None and not g.closed:
        call.masks = lambda nodes, g=g, tree=call.tree: g.masks(
            [tree.path_tokens(n) if n in tree else None for n in nodes])
