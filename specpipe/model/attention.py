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

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from specpipe.kernels import native


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
    # the segments as the fused native layer reads them (model/fused.py), built on first use
    native: Optional[object] = dataclasses.field(default=None, init=False, repr=False, compare=False)

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


def within_window(meta: AttentionMetadata, slot_positions: torch.Tensor, window: int) -> AttentionMetadata:
    """The metadata of a sliding-window layer: each row also may not attend to keys `window` or
    more positions behind it (Hugging Face's rule: key position > query position - window).
    slot_positions: (num_slots,) the position each cache slot holds (KVCache.positions). A row
    always sees itself, and its mask depends on its own position and context only."""
    segments = []
    for seg in meta.segments:
        q_pos = meta.positions[seg.start:seg.end]  # (rows,)
        k_pos = slot_positions.index_select(0, seg.read_slots)  # (C,)
        near = (q_pos[:, None] - k_pos[None, :]) < window  # (rows, C)
        if bool(near.all()):
            segments.append(seg)
            continue
        mask = near if seg.mask is None else seg.mask & near
        segments.append(dataclasses.replace(seg, mask=mask))
    return dataclasses.replace(meta, segments=segments)


ROW_TILE = 4  # rows per call padded to a multiple of this (see kernels/torch_kernels.py)
ROW_CHUNK = 256  # rows per score matrix, bounding its memory at ROW_CHUNK x C per head


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
           scale: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q: (T, Hq, D); k, v: (C, Hkv, D); mask: (T, C) bool or None. Returns (T, Hq, D).

    scale: the factor of the scores (default 1/sqrt(D)). Grouped-query attention: query head h
    reads KV head h // (Hq / Hkv). sinks: (Hq,) float32 or None (gpt-oss): a logit per query head
    that joins each row's softmax as one more score with no value, so the weights of the real
    slots sum to less than one (exp(sink - m) added to the denominator, m the row's maximum over
    its scores and the sink).

    A row's result must depend only on the slots it sees, in their order -- not on the other
    rows, on C, or on where masked slots sit -- so that a tree node's row equals the row plain
    decoding computes for the same token (the lossless property). torch's matmul and softmax
    group their additions by the call's shapes, so they cannot promise that
    (tests/kernels/test_batch_invariance.py measures it); the native kernel fixes every sum's
    order by the row alone (kernels/native/attention.c) and runs whenever it is built and the
    activations are float32 on CPU.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.dtype == torch.float32 and q.is_cpu and native.available():
        return native.attention(q, k, v, mask, scale, sinks=sinks)
    return attend_torch(q, k, v, mask, scale, sinks)


def attend_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                 scale: float, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The portable path: scores, exp and a weighted sum as batched matmuls, rows padded to a
    multiple of ROW_TILE. On CPU the sums run in float64 (exact products, rounding errors near
    2^-53), so rows computed in differently shaped calls can differ only where a float64 sum
    falls on a float32 rounding boundary; on other devices they run in the activations' dtype.
    The softmax denominator comes out of the same matmul as the numerators (a column of ones
    after V), so masked slots add exact zeros to both."""
    t, hq, d = q.shape
    if t > ROW_CHUNK:
        return torch.cat([attend_torch(q[i:i + ROW_CHUNK], k, v, None if mask is None else mask[i:i + ROW_CHUNK],
                                       scale, sinks) for i in range(0, t, ROW_CHUNK)])
    c, hkv, _ = k.shape
    g = hq // hkv
    pad = -t % ROW_TILE
    if pad:
        q = torch.cat((q, q.new_zeros(pad, hq, d)))
        if mask is not None:
            mask = torch.cat((mask, mask.new_ones(pad, c)))
    tp = t + pad
    acc = torch.float64 if q.is_cpu else q.dtype
    qh = q.permute(1, 0, 2).reshape(hkv, g * tp, d).to(acc)  # (Hkv, g T', D)
    scores = torch.matmul(qh, k.permute(1, 2, 0).to(acc)).view(hkv, g, tp, c) * scale  # (Hkv, g, T', C)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)  # (Hkv, g, T', 1)
    if sinks is not None:
        sink = sinks.to(acc).view(hkv, g, 1, 1)
        top = torch.maximum(top, sink)
    e = torch.exp(scores - top).view(hkv, g * tp, c)
    v1 = torch.cat((v.permute(1, 0, 2).to(acc), v.new_ones(hkv, c, 1, dtype=acc)), dim=-1)  # (Hkv, C, D + 1)
    out = torch.matmul(e, v1)  # (Hkv, g T', D + 1)
    den = out[..., d:]
    if sinks is not None:  # the sink's share of the denominator (it has no value)
        den = den + torch.exp(sink - top).view(hkv, g * tp, 1)
    out = (out[..., :d] / den).view(hq, tp, d).to(q.dtype)  # (Hq, T', D)
    return out.permute(1, 0, 2)[:t]  # (T, Hq, D)
