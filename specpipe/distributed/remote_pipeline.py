"""The driver's end of a multi-process pipeline: the `Pipeline` protocol over a Transport."""

from __future__ import annotations

import time
from typing import Callable, Optional

from specpipe.distributed.transport import (HEARTBEAT_S, TAG_CONTROL, TAG_REPORT, TAG_RESULTS, TAG_ROWS, LinkError,
                                     Transport, short_error)
from specpipe.distributed.wire import decode_report, decode_results, encode_control, encode_rows
from specpipe.messages import Control, Results, Rows


class PipelineError(RuntimeError):
    """The pipeline cannot go on (a stage died or a link stopped); in-flight requests fail."""


class RemotePipeline:
    concurrent = True  # the stage processes compute while the driver drafts

    def __init__(self, transport: Transport, num_stages: int,
                 describe_exits: Optional[Callable[[], dict[int, str]]] = None,
                 on_close: Optional[Callable[[bool], None]] = None) -> None:
        self.t = transport
        self.num_stages = num_stages
        self._describe_exits = describe_exits  # rank -> "exited with code N", for local processes
        self._on_close = on_close  # called with True when the stages cannot be shut down cleanly
        self._broken: Optional[PipelineError] = None
        # A Ctrl-C that lands inside a step leaves the links out of lock-step (a control message
        # sent to some stages only, or a result never read), so the pipeline is unusable after it:
        # later steps re-raise the interrupt and close() tears the stages down instead.
        self._interrupted = False
        self._report = False  # the step in flight asked every stage for its report
        self.reported: Optional[list[dict]] = None
        self.steps = 0

    @property
    def failed(self) -> Optional[str]:
        """Why the pipeline stopped (None while it serves)."""
        return None if self._broken is None else str(self._broken)

    def submit(self, control: Control, rows: list[Rows]) -> None:
        self._check()
        try:
            self.t.end_step()
            values = encode_control(control)
            self._report = control.report
            for rank in range(1, self.num_stages + 1):
                self.t.send_ints(rank, TAG_CONTROL, values)
            header, tensors = encode_rows(rows)
            self.t.send_ints(1, TAG_ROWS, header)
            for data in tensors:
                self.t.send_tensor(1, TAG_ROWS, data)
            self.steps += 1
        except (LinkError, RuntimeError) as e:
            raise self._fail(e) from None
        except KeyboardInterrupt:
            self._interrupted = True
            raise

    def collect(self) -> list[Results]:
        self._check()
        try:
            timeout = self.t.options.timeout_s
            results = decode_results(self.t.recv_ints(self.num_stages, TAG_RESULTS, timeout))
            # Each stage sends its report after the step that asked for it (see stage_main.py).
            self.reported = [decode_report(self.t.recv_ints(rank, TAG_REPORT, timeout))
                             for rank in range(1, self.num_stages + 1)] if self._report else None
            return results
        except (LinkError, RuntimeError) as e:
            raise self._fail(e) from None
        except KeyboardInterrupt:
            self._interrupted = True
            raise

    def step(self, control: Control, rows: list[Rows]) -> list[Results]:
        self.submit(control, rows)
        return self.collect()

    def _check(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._interrupted:
            raise KeyboardInterrupt("the pipeline was interrupted mid-step")

    def _fail(self, cause: Exception) -> PipelineError:
        """Name the stage that stopped: a process that died, a stage that reported an error, or a
        stale heartbeat. Stages that merely lost their link to the failed one (they record it in
        the store before exiting) are not blamed. Returns as soon as a culprit is known; waits at
        most long enough for the heartbeat of a stage that died just now to go stale."""
        deadline = time.monotonic() + 5 * HEARTBEAT_S
        while True:
            exits = self._describe_exits() if self._describe_exits else {}
            lost = {r for r in range(1, self.num_stages + 1) if self._store_has(f"lost/{r}")}
            failed = {r: self._store_get(f"failed/{r}") for r in range(1, self.num_stages + 1)
                      if self._store_has(f"failed/{r}")}
            culprits = {r: f"failed: {why}" for r, why in failed.items()}
            for r in range(1, self.num_stages + 1):  # a stage that refused what a peer sent blames the peer
                if self._store_has(f"bad/{r}"):
                    sender, _, why = self._store_get(f"bad/{r}").partition(" ")
                    culprit = int(sender) if sender.isdigit() else r
                    culprits.setdefault(culprit, f"sent stage {r} a message it refused: {why}")
            culprits.update({r: why for r, why in exits.items() if r not in lost and r not in culprits})
            silent = [r for r in self.t.silent_ranks() if r not in exits and r not in lost and r not in culprits]
            if culprits or silent or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        parts = [f"{'stage ' + str(r) if r else 'the driver'} {why}" for r, why in sorted(culprits.items())]
        parts += [f"stage {r} stopped responding (no heartbeat)" for r in silent]
        if not parts:
            gone = sorted(lost)
            parts = [f"a link failed ({short_error(cause)})"]
            if gone:
                parts.append(f"stage{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} lost a link")
        self._broken = PipelineError(f"pipeline failed: {'; '.join(parts)}; in-flight requests were aborted")
        return self._broken

    def _store_has(self, key: str) -> bool:
        try:
            return self.t.store.check([key])
        except Exception:
            return False

    def _store_get(self, key: str) -> str:
        try:
            return self.t.store.get(key).decode(errors="replace")
        except Exception:
            return "unknown error"

    def close(self) -> None:
        clean = self._broken is None and not self._interrupted
        if clean:
            try:
                values = encode_control(Control(shutdown=True))
                for rank in range(1, self.num_stages + 1):
                    self.t.send_ints(rank, TAG_CONTROL, values)
                clean = self.t.flush(timeout_s=5.0)  # the stages have the shutdown before we go
            except (LinkError, RuntimeError):
                clean = False
        if self._on_close is not None:
            self._on_close(not clean)
        self.t.close()

