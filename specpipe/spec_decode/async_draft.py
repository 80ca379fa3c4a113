"""A draft source that runs off the pipeline's critical path (`--draft-async`, docs/design.md §4).

`AsyncDraft` wraps a model source and owns it: every call the driver makes on it (start, observe,
finish, propose) is queued and run in order by one worker, so the source sees exactly the
sequence of calls a synchronous driver would make, only later. `submit` hands a batch of propose
calls to the worker and returns at once with a `Ticket`; the engine (engine/async_drafting.py)
looks at the ticket at the start of each step and uses the proposals once they are there, so no
step waits for a draft forward. `propose_many` (submit and wait) stays for the phases that must
draft before sending (tree mode's rounds).

Two workers:
  a thread (real runs): torch's kernels and the native library (ctypes.CDLL, which drops the
      GIL around each call) compute while the driver's thread steps the pipeline;
  a modeled clock (`clock=DraftClock`, oracle runs for the simulator): every call runs at once,
      but a ticket is only ready when the clock says its forward would have finished, given the
      draft's cost and the steps' simulated times (sim/draft_clock.py).

Only for a source that reads nothing but the rows it is given (a draft model): the proposals are
computed while the driver changes the request's tree, which a tree-reading source (n-gram) would
race with.
"""

from __future__ import annotations

import dataclasses

import queue
import threading
from typing import Callable, Optional, Protocol, Sequence

from specpipe.config import ConfigError
from specpipe.spec_decode.sources import ProposeCall, TokenSource


class Clock(Protocol):
    def forward_done_ms(self, rows: int, context: int) -> float: ...

    def now_ms(self) -> float: ...


class Ticket:
    """One batch of propose calls on its way through the worker."""

    def __init__(self, calls: Sequence[ProposeCall]) -> None:
        self.calls = list(calls)
        self.rows = sum(len(c.rows.node_ids) for c in calls)
        self._done = threading.Event()
        self._out: Optional[list[dict]] = None
        self._error: Optional[BaseException] = None
        self._clock: Optional[Clock] = None
        self.ready_at_ms = 0.0  # modeled clock: when the forward would have finished

    def ready(self) -> bool:
        if self._clock is not None:
            return self._done.is_set() and self._clock.now_ms() >= self.ready_at_ms
        return self._done.is_set()

    def result(self) -> list[dict]:
        """The proposals, one dict per call (waits for the worker if it has not finished)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._out

    def _finish(self, out: Optional[list[dict]], error: Optional[BaseException]) -> None:
        self._out, self._error = out, error
        self._done.set()


class AsyncDraft(TokenSource):
    """`inner`'s calls, queued and run in order by one worker (see the module's docstring)."""

    def __init__(self, inner: TokenSource, clock: Optional[Clock] = None) -> None:
        if not inner.runs_model or getattr(inner, "reads_tree", False):
            raise ConfigError(f"--draft-async needs a draft model as the source, not {inner.name} "
                             "(a source that costs nothing gains nothing from it)")
        self.inner, self.clock = inner, clock
        self.name, self.runs_model = inner.name, True
        self.tokenizer_fingerprint = inner.tokenizer_fingerprint
        self._failed: list[int] = []
        self._lock = threading.Lock()
        # request id -> the failure of a queued start/observe/finish of that request, raised by its
        # next call (so the engine ends that request, engine/core.py own_fault), never another's
        self._errors: dict[int, BaseException] = {}
        self._queue: "queue.Queue[Optional[tuple[Callable, Optional[Ticket], object]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        if clock is None:
            self._thread = threading.Thread(target=self._work, name="specpipe-draft", daemon=True)
            self._thread.start()

    # -- the source's interface, queued -------------------------------------------------------------
    def start(self, request_id):
        self._run(request_id, lambda: self.inner.start(request_id))

    def observe(self, request_id, commit, drop):
        commit, drop = list(commit), list(drop)
        self._run(request_id, lambda: self.inner.observe(request_id, commit, drop))

    def finish(self, request_id):
        # The request is over: a failure of its earlier calls has nobody left to end (its tokens
        # were verified by the target either way); the draft still frees what it holds for it.
        with self._lock:
            self._errors.pop(request_id, None)
        self._run(request_id, lambda: self.inner.finish(request_id))

    def raise_failure(self, request_id) -> None:
        """Raise the failure of one of this request's queued calls, if one failed."""
        with self._lock:
            error = self._errors.pop(request_id, None)
        if error is not None:
            raise error

    def propose(self, request_id, tree, rows, want, k):
        return self.propose_many([ProposeCall(request_id, tree, rows, want, k)])[0]

    def propose_many(self, calls):
        return self.submit(calls).result()

    def submit(self, calls: Sequence[ProposeCall]) -> Ticket:
        """Queue one batch (one draft forward); returns at once."""
        # Structured output's masks read the grammar's state, which the driver's thread moves on:
        # take them now, not on the worker.
        calls = [c if c.masks is None else dataclasses.replace(c, masks=_taken(c.masks(list(c.want)))) for c in calls]
        ticket = Ticket(calls)
        if self.clock is not None:
            ticket._clock = self.clock
            context = max((max(c.rows.positions) + 1 for c in calls if c.rows.positions), default=1)
            ticket.ready_at_ms = self.clock.forward_done_ms(ticket.rows, context)
        self._queue_call(lambda: self.inner.propose_many(ticket.calls), ticket)
        return ticket

    def take_failures(self) -> list[int]:
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    def has_room(self, tokens: int) -> bool:
        self.drain()
        return self.inner.has_room(tokens)

    # -- the worker -----------------------------------------------------------------------------------
    def _run(self, request_id, fn: Callable) -> None:
        """One request's start/observe/finish: its own earlier failure first (raise_failure)."""
        self.raise_failure(request_id)
        self._queue_call(fn, None, request_id)

    def _queue_call(self, fn: Callable, ticket: Optional[Ticket] = None, request_id=None) -> None:
        if self._thread is None:
            self._call(fn, ticket, request_id)
        else:
            self._queue.put((fn, ticket, request_id))

    def _call(self, fn: Callable, ticket: Optional[Ticket], request_id=None) -> None:
        try:
            out = fn()
        except BaseException as e:  # noqa: BLE001  (handed to whoever waits on it)
            if ticket is None:
                with self._lock:
                    self._errors.setdefault(request_id, e)  # its first failure is the cause
            else:
                ticket._finish(None, e)
            return
        if ticket is not None:
            failed = self.inner.take_failures()
            with self._lock:
                self._failed += failed
            ticket._finish(out, None)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self._queue.task_done()
                return
            self._call(*item)
            self._queue.task_done()

    def drain(self) -> None:
        """Wait until every queued call has run (the inner source is then the driver's to read).
        A queued call's failure stays with its request (raise_failure)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Run what is queued, then stop the worker."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def _taken(masks):
    """A mask function answering with masks already computed (for the nodes it was made for)."""
    return lambda _want: masks
