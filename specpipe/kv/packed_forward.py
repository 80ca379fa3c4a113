"""One packed forward over many requests' rows: plan each in the slot table, run once, split.

    parts (Rows, one or more per request)  ->  SlotTable.plan for each part (a request whose
    blocks run out fails here, alone)  ->  rows concatenated, one attention segment per part
    ->  one model forward  ->  outputs split back per part

Why packed: the linear layers and the MLP, most of a step's cost, then run once on all rows
instead of once per request; only attention loops over the segments. Used by StageWorker (every
pipeline step) and DraftModelSource (every drafting call), so both plan and pack the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from specpipe.messages import Rows
from specpipe.model.attention import SegmentPlan
from specpipe.model.kv_cache import KVCache
from specpipe.model.llama import LlamaStage
from specpipe.model.runner import run_segments
from specpipe.kv.slot_table import KVCacheFull, SlotTable


@dataclass
class PackedOutput:
    # Per part, in order: hidden states (T_i, H), or with the LM head logits (R_i, V) of the
    # part's head rows (all its rows when head_rows is None); None when its request failed.
    outputs: list[Optional[torch.Tensor]]
    failed: list[int]  # requests that ran out of KV blocks in this call, now failed in the table
    committed: int  # rows that joined a committed prefix once computed (commits that waited)


def run_packed(model: LlamaStage, kv: KVCache, table: SlotTable, parts: Sequence[Rows],
               window_kv: Optional[KVCache] = None) -> PackedOutput:
    """Compute every part's rows in one forward. Each part's request must be in `table` and not
    failed, and each part must have at least one row. Parts of one request may follow each other
    (parents first): all rows' K/V are written before any attention, so a later part sees an
    earlier one's nodes. `window_kv`: the sliding-window layers' cache, when `table` has a window
    table for them (then `kv` holds the global layers)."""
    plans, failed = [], []
    for rows in parts:
        rid = rows.request_id
        if table.requests[rid].failed:  # an earlier part of this request failed in this call
            plans.append(None)
            continue
        try:
            plans.append(table.plan(rid, rows.node_ids, rows.parent_ids, rows.positions))
        except KVCacheFull:
            # Only this request fails: free its KV here (parts of it planned earlier in this
            # call included) so the others keep their blocks and go on.
            table.fail(rid)
            failed.append(rid)
            plans.append(None)
    run = [i for i, (rows, plan) in enumerate(zip(parts, plans))
           if plan is not None and not table.requests[rows.request_id].failed]
    outputs: list[Optional[torch.Tensor]] = [None] * len(parts)
    if not run:
        return PackedOutput(outputs, failed, 0)

    with_head = model.spec.last
    positions, write, segments, head, counts = [], [], [], [], []
    window_write, window_segments = [], []
    offset = 0
    for i in run:
        rows, plan = parts[i], plans[i]
        positions += rows.positions
        write += plan.write_slots
        segments.append(SegmentPlan(len(rows), plan.read_slots, plan.mask))
        if plan.window is not None:
            window_write += plan.window.write_slots
            window_segments.append(SegmentPlan(len(rows), plan.window.read_slots, plan.window.mask))
        picked = rows.head_rows if rows.head_rows is not None else range(len(rows))
        head += [offset + h for h in picked]
        counts.append(len(picked) if with_head else len(rows))
        offset += len(rows)
    data = torch.cat([parts[i].data for i in run]) if len(run) > 1 else parts[run[0]].data  # (T,) or (T, H)
    window = (window_write, window_segments, window_kv) if table.window is not None else None
    out = run_segments(model, kv, data, positions, write, segments, head if with_head else None, window)
    for i, piece in zip(run, out.split(counts)):
        outputs[i] = piece
    committed = sum(table.computed(rid) for rid in dict.fromkeys(parts[i].request_id for i in run))
    return PackedOutput(outputs, failed, committed)
