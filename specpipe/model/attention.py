"""Attention with explicit metadata: positions, KV slots to write, KV slots to read, and a mask.

Nothing here is global: every forward call receives an `AttentionMetadata` describing the rows it
computes. The same code runs prefill (causal mask over a chain), plain decode (one row, no mask),
and tree attention (each node sees the committed prefix plus its own ancestors).

Glossary:
  row        -- one token being computed in this call (T rows in total).
  slot       -- one entry of the preallocated KV cache (see kv_cache.py).
  read slots -- the C cache entries this call may attend to, in any order; the new rows' own
                slots are among them because their K/V are written before attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # (T,) int64 absolute positions, for RoPE
    write_slots: torch.Tensor  # (T,) int64 where each row's K/V is stored
    read_slots: torch.Tensor  # (C,) int64 cache entries visible to this call
    read_range: Optional[tuple[int, int]]  # (a, b) when read_slots == range(a, b): a slice, no gather
    mask: Optional[torch.Tensor]  # (T, C) bool, True = may attend; None = every row sees every read slot

    @staticmethod
    def build(positions: Sequence[int], write_slots: Sequence[int], read_slots: Sequence[int],
              mask: Optional[torch.Tensor], device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Control data arrives as plain lists; only here does it become tensors."""
        rs = list(read_slots)
        contiguous = bool(rs) and rs[-1] - rs[0] + 1 == len(rs) and all(
            b == a + 1 for a, b in zip(rs, rs[1:]))
        return AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            write_slots=torch.tensor(write_slots, dtype=torch.long, device=device),
            read_slots=torch.tensor(rs, dtype=torch.long, device=device),
            read_range=(rs[0], rs[-1] + 1) if contiguous else None,
            mask=None if mask is None else mask.to(device),
        )


def chain_mask(num_prefix: int, num_rows: int) -> torch.Tensor:
    """Mask for rows that extend a prefix one after another (prefill): row i sees the prefix and
    rows 0..i. Columns are [prefix slots..., row slots...]."""
    mask = torch.ones(num_rows, num_prefix + num_rows, dtype=torch.bool)
    mask[:, num_prefix:] = torch.ones(num_rows, num_rows, dtype=torch.bool).tril()
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """q: (T, Hq, D); k, v: (C, Hkv, D); mask: (T, C) bool or None. Returns (T, Hq, D).

    Grouped-query attention: Hq is a multiple of Hkv and SDPA broadcasts the KV heads itself.
    """
    q = q.transpose(0, 1).unsqueeze(0)  # (1, Hq, T, D)
    k = k.transpose(0, 1).unsqueeze(0)  # (1, Hkv, C, D)
    v = v.transpose(0, 1).unsqueeze(0)  # (1, Hkv, C, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)  # (T, Hq, D)
