"""One pipeline stage: apply the driver's control, drop pruned rows, compute, pass rows on.

    recv Control + Rows  ->  prune / commit bookkeeping  ->  forward over surviving rows
                         ->  Rows to the next stage (or, on the last stage, the target's tokens)

The worker is transport-agnostic: the in-process pipeline (local_pipeline.py) and the
torch.distributed stage process (dist/stage_process.py) both drive it the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


from specpipe.messages import Control, Results, Rows
from specpipe.model.llama import LlamaStage
from specpipe.model.runner import run_rows
from specpipe.sampling import SamplingParams, target_tokens
from specpipe.worker.slot_table import KVManager


@dataclass
class StageStats:
    """Cheap per-stage accounting, summed over the run (divide by steps for per-step figures)."""

    steps: int = 0
    compute_s: float = 0.0  # time in forward passes
    wait_s: float = 0.0  # time blocked on receiving (set by the transport loop)
    bytes_sent: int = 0  # activation + control bytes sent downstream (set by the transport)
    rows_computed: int = 0
    rows_committed: int = 0  # computed rows that ended on the committed path: useful work
    peak_slots: int = 0

    def as_dict(self) -> dict:
        d = self.__dict__.copy()
        d["occupancy"] = self.rows_committed / self.rows_computed if self.rows_computed else None
        return d


class StageWorker:
    def __init__(self, model: LlamaStage, num_slots: int) -> None:
        self.model = model
        self.first, self.last = model.spec.first, model.spec.last
        self.kv = model.make_kv_cache(num_slots)
        self.slots = KVManager(num_slots)
        self.sampling: dict[int, SamplingParams] = {}
        self.stats = StageStats()

    def apply(self, control: Control) -> None:
        for a in control.admit:
            self.slots.admit(a.request_id)
            self.sampling[a.request_id] = a.sampling
        for p in control.prune:
            if p.request_id not in self.slots.requests:
                continue
            before = len(self.slots.requests[p.request_id].committed)
            self.slots.drop(p.request_id, p.drop)
            self.slots.commit(p.request_id, p.commit)
            self.stats.rows_committed += len(self.slots.requests[p.request_id].committed) - before
        for rid in control.release:
            self.slots.release(rid)
            self.sampling.pop(rid, None)

    def compute(self, rows: Rows) -> Rows | Results | None:
        """Forward the surviving rows; None when all of them were pruned in transit."""
        rid = rows.request_id
        if rid not in self.slots.requests:
            return None  # released while these rows were in flight (EOS or max tokens mid-tree)
        rows = rows.select(self.slots.live_rows(rid, rows.node_ids))
        if not len(rows):
            return None
        t0 = time.perf_counter()
        plan = self.slots.plan(rid, rows.node_ids, rows.parent_ids)
        out = run_rows(self.model, self.kv, rows.data, rows.positions, plan.write_slots,
                       plan.read_slots, plan.mask, rows.head_rows if self.last else None)
        before = len(self.slots.requests[rid].committed)
        self.slots.computed(rid)
        self.stats.rows_committed += len(self.slots.requests[rid].committed) - before
        self.stats.rows_computed += len(rows)
        self.stats.peak_slots = max(self.stats.peak_slots, self.slots.total_in_use())
        if self.last:
            picked = rows.head_rows if rows.head_rows is not None else range(len(rows))
            node_ids = [rows.node_ids[i] for i in picked]
            tokens = target_tokens(out, [rows.positions[i] for i in picked], self.sampling[rid])
            result: Rows | Results = Results(rid, node_ids, tokens)
        else:
            result = Rows(rid, rows.node_ids, rows.parent_ids, rows.positions, out, rows.head_rows)
        self.stats.compute_s += time.perf_counter() - t0
        return result

    def step(self, control: Control, incoming: list[Rows]) -> list[Rows | Results]:
        """One pipeline step of this stage."""
        self.apply(control)
        self.stats.steps += 1
        return [out for rows in incoming if (out := self.compute(rows)) is not None]
