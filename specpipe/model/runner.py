"""Run a model over rows whose KV placement was planned by the caller (sched/kv_manager.py)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from specpipe.model.attention import AttentionMetadata
from specpipe.model.kv_cache import KVCache
from specpipe.model.llama import LlamaStage


def run_rows(model: LlamaStage, kv: KVCache, data: torch.Tensor, positions: Sequence[int],
             write_slots: Sequence[int], read_slots: Sequence[int], mask: Optional[np.ndarray],
             head_rows: Optional[Sequence[int]] = None) -> torch.Tensor:
    """data: token ids (T,) or hidden states (T, H). Returns the model's output for the rows
    (logits for `head_rows` only, when given and the model has the head)."""
    device = model.inv_freq.device
    meta = AttentionMetadata.build(positions, write_slots, read_slots,
                                   None if mask is None else torch.from_numpy(mask), device)
    head = None if head_rows is None else torch.tensor(list(head_rows), dtype=torch.long, device=device)
    with torch.inference_mode():
        return model(data.to(device), meta, kv, head)
