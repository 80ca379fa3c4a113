"""Preallocated KV cache of one stage, addressed by slot.

The cache is a fixed pool of slots per layer. Which slot holds which token is bookkeeping kept by
the caller (see kv/slot_table.py, which also groups the slots into blocks), so freeing a
pruned tree node or rolling back a rejected draft costs nothing, and committing a node is a
slot-table update, never a copy of KV rows.

Two layouts, the same slots: K and V per KV head (every family but DeepSeek's), or one latent
per token (`latent=True`, multi-head latent attention, model/mla.py), where `k` holds the latent
and its RoPE key (num_slots, 1, kv_lora_rank + qk_rope_head_dim) and there is no `v`: every
query head reads keys and values out of that one row. Everything that moves, frees or plans
slots works on both alike.
"""

from __future__ import annotations

from typing import Optional

import torch

from specpipe.model.attention import Segment


class KVCache:
    """K and V tensors for `num_layers` layers: each (num_slots, Hkv, D); latent: K only."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, latent: bool = False) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        # Uninitialised: a slot is always written before it is read, and a large CPU pool then
        # does not touch all its pages up front.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v: Optional[torch.Tensor] = None if latent else torch.empty(shape, dtype=dtype, device=device)
        # The position each slot holds, for sliding-window layers' masks (attention.within_window).
        self.positions = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.num_slots = num_slots

    def write_positions(self, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.positions.index_copy_(0, slots, positions)

    def write(self, layer: int, k: torch.Tensor, v: Optional[torch.Tensor], slots: torch.Tensor) -> None:
        """Store the new rows' K/V (T, Hkv, D) in their slots (T,); a latent cache takes k alone."""
        self.k[layer].index_copy_(0, slots, k)
        if self.v is not None:
            self.v[layer].index_copy_(0, slots, v)

    def move(self, moves: list[tuple[int, int]]) -> None:
        """Copy slots' K/V and positions (from, to), every layer; all reads before any write."""
        src = torch.tensor([a for a, _ in moves], dtype=torch.long, device=self.k.device)
        dst = torch.tensor([b for _, b in moves], dtype=torch.long, device=self.k.device)
        self.k[:, dst] = self.k[:, src]
        if self.v is not None:
            self.v[:, dst] = self.v[:, src]
        self.positions[dst] = self.positions[src]

    def read(self, layer: int, seg: Segment) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The K/V a segment may attend to: (C, Hkv, D) each (V None in a latent cache)."""
        kc, vc = self.k[layer], (None if self.v is None else self.v[layer])
        if seg.read_range is not None:
            a, b = seg.read_range
            return kc[a:b], (None if vc is None else vc[a:b])
        k = kc.index_select(0, seg.read_slots)
        return k, (None if vc is None else vc.index_select(0, seg.read_slots))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)

    def bytes_per_token(self) -> int:
        """What one slot holds over all layers (the K/V bytes a token costs this stage)."""
        return self.nbytes() // max(self.num_slots, 1)
