"""Surviving a dead local stage process (killed, out of memory): start the stages again.

    submit / collect  --PipelineError-->  close the broken stages  ->  wait (back-off)  ->  start
    new ones  ->  raise StagesRestarted  ->  the core recomputes every request it had in the
    pipeline from its prompt plus the tokens it already emitted, under a new pid

Nothing is lost: sampling is keyed by seed and position, so a recomputed request goes on with
exactly the tokens it would have produced. A start that fails (whatever it raises) counts as one
restart in a row, with its back-off, and the next one is tried. Only local stage processes and
Ray stage actors are restarted (the driver owns them); under torchrun the driver cannot start a
rank elsewhere, so the failure goes to the requests and the operator restarts the job.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from specpipe.distributed.remote_pipeline import PipelineError
from specpipe.messages import Control, Pipeline, Results, Rows, StagesRestarted

HEALTHY_STEPS = 100  # steps after a restart that make the next failure count as a first one again ...
HEALTHY_S = 10.0  # ... or seconds up (one request at a time takes few steps: a fault a minute is not a loop)
BACKOFF_S = 0.5  # the first wait before starting again; doubled on each restart in a row ...
BACKOFF_MAX_S = 4.0  # ... up to this: a stage killed again and again must not wait minutes


class RestartingPipeline:
    """A local multi-process pipeline that starts its stages again, up to `restarts` times in a
    row, when one fails. `start` builds a fresh pipeline (new processes, a new store)."""

    def __init__(self, start: Callable[[], Pipeline], restarts: int,
                 progress: Optional[Callable[[str], None]] = None) -> None:
        self._start, self.restarts, self._progress = start, restarts, progress
        self.inner = start()
        self._up_since = time.monotonic()
        self.restarted = 0  # over the engine's life
        self._in_a_row = 0
        self._healthy = 0
        self._dead: Optional[PipelineError] = None
        self._steps_before = 0  # steps of the stages started before the current ones

    @property
    def num_stages(self) -> int:
        return self.inner.num_stages

    @property
    def concurrent(self) -> bool:
        return self.inner.concurrent

    @property
    def reported(self):
        return self.inner.reported

    @property
    def steps(self) -> int:
        """Counted on across restarts (the new stages count from 1 again)."""
        return self._steps_before + self.inner.steps

    @property
    def failed(self) -> Optional[str]:
        """Why the stages could not be started again (None while they serve)."""
        return None if self._dead is None else str(self._dead)

    @property
    def ready(self):
        return getattr(self.inner, "ready", None)

    def submit(self, control: Control, rows: list[Rows]) -> None:
        if self._dead is not None:
            raise self._dead
        try:
            self.inner.submit(control, rows)
        except PipelineError as e:
            self._restart(e)

    def collect(self) -> list[Results]:
        if self._dead is not None:
            raise self._dead
        try:
            results = self.inner.collect()
        except PipelineError as e:
            self._restart(e)
        self._healthy += 1
        if self._healthy >= HEALTHY_STEPS:
            self._in_a_row = 0
        return results

    def step(self, control: Control, rows: list[Rows]) -> list[Results]:
        self.submit(control, rows)
        return self.collect()

    def _restart(self, cause: PipelineError) -> None:
        self.inner.close()  # broken: what is left of the old stages ends at once
        self._steps_before += self.inner.steps
        if time.monotonic() - self._up_since >= HEALTHY_S:
            self._in_a_row = 0  # it served a while: a first failure again, with the shortest back-off
        why = str(cause)
        while self._in_a_row < self.restarts:
            self._in_a_row += 1
            time.sleep(backoff_s(self._in_a_row))
            if self._progress:
                self._progress(f"{why}; starting the stages again ({self._in_a_row}/{self.restarts})")
            try:
                self.inner = self._start()
            except Exception as e:  # noqa: BLE001  (KeyboardInterrupt and the like still stop it)
                # Whatever failed while starting (a node lost while its weights streamed, a cache
                # entry that would not verify, a stage that did not load) is one failed attempt:
                # the next one, after its back-off, may place the stage elsewhere. Escaping here
                # would instead end every request the core holds.
                why = str(e) if isinstance(e, PipelineError) else f"starting the stages failed: {failure_line(e)}"
                continue
            self.restarted += 1
            self._healthy = 0
            self._up_since = time.monotonic()
            raise StagesRestarted(f"{cause}; the stages were started again") from None
        self._dead = PipelineError(f"{why}; gave up after {self.restarts} restarts in a row" if self.restarts else why)
        raise self._dead from None

    def close(self) -> None:
        self.inner.close()


def failure_line(e: BaseException) -> str:
    """An exception in one line: its type and its message's first line."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def backoff_s(in_a_row: int) -> float:
    """The wait before the `in_a_row`-th restart in a row (1, 2, ...): 0.5, 1, 2, 4, 4, ... s."""
    return min(BACKOFF_S * 2 ** (in_a_row - 1), BACKOFF_MAX_S)
