"""Preallocated KV cache of one stage, addressed by slot.

The cache is a fixed pool of slots per layer. Which slot holds which token is bookkeeping kept by
the caller (see kv/slot_table.py, which also groups the slots into blocks), so freeing a
pruned tree node or rolling back a rejected draft costs nothing, and committing a node is a
slot-table update, never a copy of KV rows.
"""

from __future__ import annotations

import torch

from specpipe.model.attention import Segment


class KVCache:
    """K and V tensors for `num_layers` layers: each (num_slots, Hkv, D)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        # Uninitialised: a slot is always written before it is read, and a large CPU pool then
        # does not touch all its pages up front.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        # The position each slot holds, for sliding-window layers' masks (attention.within_window).
        self.positions = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.num_slots = num_slots

    def write_positions(self, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.positions.index_copy_(0, slots, positions)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store the new rows' K/V (T, Hkv, D) in their slots (T,)."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)

    def move(self, moves: list[tuple[int, int]]) -> None:
        """Copy slots' K/V and positions (from, to), every layer; all reads before any write."""
        src = torch.tensor([a for a, _ in moves], dtype=torch.long, device=self.k.device)
        dst = torch.tensor([b for _, b in moves], dtype=torch.long, device=self.k.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        self.positions[dst] = self.positions[src]

    def read(self, layer: int, seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V a segment may attend to: (C, Hkv, D) each."""
        kc, vc = self.k[layer], self.v[layer]
        if seg.read_range is not None:
            a, b = seg.read_range
            return kc[a:b], vc[a:b]
        return kc.index_select(0, seg.read_slots), vc.index_select(0, seg.read_slots)

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
