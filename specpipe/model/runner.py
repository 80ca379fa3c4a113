"""Run a model over rows whose KV placement was planned by the caller (kv/slot_table.py)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from specpipe.model.attention import AttentionMetadata, SegmentPlan
from specpipe.model.kv_cache import KVCache
from specpipe.model.llama import LlamaStage


def run_segments(model: LlamaStage, kv: KVCache, data: torch.Tensor, positions: Sequence[int],
                 write_slots: Sequence[int], segments: Sequence[SegmentPlan],
                 head_rows: Optional[Sequence[int]] = None,
                 window: Optional[tuple[Sequence[int], Sequence[SegmentPlan], KVCache]] = None) -> torch.Tensor:
    """data: token ids (T,) or hidden states (T, H) of every segment's rows, packed in segment
    order. Returns the model's output for the rows (logits for `head_rows` only, when given and
    the model has the head). `window`: the same rows' write slots and segments in the
    sliding-window layers' own cache, and that cache."""
    device = model.inv_freq.device
    meta = AttentionMetadata.build(positions, write_slots, segments, device)
    head = None if head_rows is None else torch.tensor(list(head_rows), dtype=torch.long, device=device)
    local = None
    if window is not None:
        local = (AttentionMetadata.build(positions, window[0], window[1], device), window[2])
    with torch.inference_mode():
        return model(data.to(device), meta, kv, head, local)


def run_rows(model: LlamaStage, kv: KVCache, data: torch.Tensor, positions: Sequence[int],
             write_slots: Sequence[int], read_slots: Sequence[int], mask: Optional[np.ndarray],
             head_rows: Optional[Sequence[int]] = None) -> torch.Tensor:
    """`run_segments` for a single sequence: every row reads `read_slots` under `mask` (T, C)."""
    return run_segments(model, kv, data, positions, write_slots,
                        [SegmentPlan(len(write_slots), read_slots, mask)], head_rows)
