"""Attention with explicit metadata: positions, KV slots to write, and per segment what to read.

Nothing here is global: every forward call receives an `AttentionMetadata` describing the rows it
computes. The same code runs prefill (causal mask over a chain), plain decode (one row, no mask),
and tree attention (each node sees the committed prefix plus its own ancestors), for one sequence
or for several packed into one call.

Glossary:
  row        -- one token being computed in this call (T rows in total, all segments packed).
  slot       -- one entry of the preallocated KV cache (see kv_cache.py).
  segment    -- a run of consecutive rows that share what they may attend to (in practice one
                sequence's rows); segments never see each other's slots unless told to.
  read slots -- the C cache entries a segment may attend to, in any order; the segment's own
                slots are among them because every row's K/V is written before attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class SegmentPlan:
    """A segment as the caller plans it: plain lists and numpy, no device."""

    num_rows: int
    read_slots: Sequence[int]  # (C,)
    mask: Optional[np.ndarray]  # (num_rows, C) bool, True = may attend; None = every row sees all


@dataclass
class Segment:
    start: int  # rows [start, end) of the call
    end: int
    read_slots: torch.Tensor  # (C,) int64 cache entries visible to these rows
    read_range: Optional[tuple[int, int]]  # (a, b) when read_slots == range(a, b): a slice, no gather
    mask: Optional[torch.Tensor]  # (end - start, C) bool, True = may attend; None = all


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # (T,) int64 absolute positions, for RoPE
    write_slots: torch.Tensor  # (T,) int64 where each row's K/V is stored
    segments: list[Segment]  # consecutive, covering rows [0, T)

    @staticmethod
    def build(positions: Sequence[int], write_slots: Sequence[int], segments: Sequence[SegmentPlan],
              device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Control data arrives as plain lists; only here does it become tensors. All segments'
        read slots travel to the device as one tensor and all masks as another (two copies per
        call, however many segments), each segment keeping a view."""
        reads = [s for seg in segments for s in seg.read_slots]
        read_t = torch.tensor(reads, dtype=torch.long, device=device)  # (sum C,)
        masks = [seg.mask.reshape(-1) for seg in segments if seg.mask is not None]
        mask_t = torch.from_numpy(np.concatenate(masks).astype(bool, copy=False)).to(device) if masks else None
        out, row, col, flat = [], 0, 0, 0
        for seg in segments:
            c = len(seg.read_slots)
            rs = seg.read_slots
            contiguous = c > 0 and rs[-1] - rs[0] + 1 == c and all(b == a + 1 for a, b in zip(rs, rs[1:]))
            mask = None
            if seg.mask is not None:
                assert seg.mask.shape == (seg.num_rows, c), (seg.mask.shape, seg.num_rows, c)
                mask = mask_t[flat:flat + seg.num_rows * c].view(seg.num_rows, c)  # (rows, C)
                flat += seg.num_rows * c
            out.append(Segment(row, row + seg.num_rows, read_t[col:col + c],
                               (rs[0], rs[-1] + 1) if contiguous else None, mask))
            row, col = row + seg.num_rows, col + c
        assert row == len(positions) == len(write_slots), (row, len(positions), len(write_slots))
        return AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            write_slots=torch.tensor(write_slots, dtype=torch.long, device=device),
            segments=out,
        )


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """q: (T, Hq, D); k, v: (C, Hkv, D); mask: (T, C) bool or None. Returns (T, Hq, D).

    Grouped-query attention: Hq is a multiple of Hkv and SDPA broadcasts the KV heads itself.
    """
    q = q.transpose(0, 1).unsqueeze(0)  # (1, Hq, T, D)
    k = k.transpose(0, 1).unsqueeze(0)  # (1, Hkv, C, D)
    v = v.transpose(0, 1).unsqueeze(0)  # (1, Hkv, C, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)  # (T, Hq, D)
