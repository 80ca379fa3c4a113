"""Preallocated KV cache of one stage, addressed by slot.

The cache is a fixed pool of slots per layer. Which slot holds which token is bookkeeping kept by
the caller (see sched/kv_manager.py), so freeing a pruned tree node
or rolling back a rejected draft costs nothing, and committing a node is a slot-table update, never
a copy of KV rows.
"""

from __future__ import annotations

import torch

from specpipe.model.attention import AttentionMetadata


class KVCache:
    """K and V tensors for `num_layers` layers: each (num_slots, Hkv, D)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots

    def write_and_read(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new rows' K/V (T, Hkv, D) in their slots, return the visible K/V (C, Hkv, D)."""
        kc, vc = self.k[layer], self.v[layer]
        kc.index_copy_(0, meta.write_slots, k)
        vc.index_copy_(0, meta.write_slots, v)
        if meta.read_range is not None:
            a, b = meta.read_range
            return kc[a:b], vc[a:b]
        return kc.index_select(0, meta.read_slots), vc.index_select(0, meta.read_slots)

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
