"""What a step looks like from outside: one call per phase, for tracing (sim/trace.py's
StepTracer records every step for the simulator and the pictures). The default observer sees
nothing and costs nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specpipe.messages import Control, Rows
from specpipe.request import Request

if TYPE_CHECKING:
    from specpipe.engine.modes.base import ModeState


class StepObserver:
    def added(self, req: Request) -> None:
        """A request joined the core."""

    def submitted(self, pipe_step: int, control: Control, rows: list[Rows], running: list["ModeState"]) -> None:
        """The step went to the stages: its control, the rows entering stage 1, and the state of
        every request in it (before verification). `pipe_step`: the number the stages give it."""

    def drafted(self, phase: str, rows: int) -> None:
        """One draft forward of `phase` over `rows` rows (all requests' calls together)."""

    def draft_ready(self) -> None:
        """The proposals of the asynchronous draft's forward in flight are used from this step on
        (`--draft-async`; its start was `drafted("async", rows)`)."""

    def collected(self, stage_spans: list) -> None:
        """The step's results are in; `stage_spans`: the stages' compute spans when they reported
        (per stage, (pipeline step, start ns, end ns)), else []."""

    def verified(self, requests: list[Request]) -> None:
        """The step's requests after verification."""


NO_OBSERVER = StepObserver()
