"""Kernels built from what torch already offers (see registry.py for the interface).

Batch invariance of the float matmul: torch's float32 `F.linear` (oneDNN/MKL sgemm) picks its
code path, and with it the summation order, by the number of rows in the call. On an AMD EPYC
rows came out the same whenever a call had a multiple of 4 rows; on an Intel Xeon with AMX (Sapphire
Rapids) even calls of 4, 8 and 64 rows disagree. Every row's result does stay the same across
calls of one fixed size, wherever the row sits in the call (both measured by
tests/kernels/test_batch_invariance.py). So on CPU the float matmul runs in calls of exactly
ROW_TILE rows (the last one padded): a row's output never depends on how many rows share its
step. Decode pays nothing for it; a long prefill reads the weights once per ROW_TILE rows.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

import gguf
import torch
import torch.nn.functional as F

from specpipe.kernels.ggml_types import _f16, _k_scale_min, _nibbles, dequantize

Q = gguf.GGMLQuantizationType
ROW_TILE = 4


def invariant_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, w, bias), x (T, K) -> (T, N), in calls of exactly ROW_TILE rows on CPU (see
    above); on other devices one call with the rows padded to a multiple of ROW_TILE."""
    t = x.shape[0]
    pad = -t % ROW_TILE
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
    if not x.is_cpu or x.shape[0] == ROW_TILE:
        return F.linear(x, w, bias)[:t]
    out = x.new_empty(x.shape[0], w.shape[0])
    for i in range(0, x.shape[0], ROW_TILE):
        out[i:i + ROW_TILE] = F.linear(x[i:i + ROW_TILE], w, bias)
    return out[:t]


class DequantKernel:
    """The portable kernel: the weight stays packed; each call dequantizes it TILE_BYTES of float32
    at a time (a block of output rows, into a scratch buffer reused across calls) and multiplies
    each tile with the invariant float matmul. Memory: the packed rows plus one tile per thread,
    never the whole float matrix. The values are the reference dequantize's, bit for bit (fast
    paths for Q4_0 / Q4_1 / Q8_0 below, the reference itself for the other types); a row's output
    depends only on its own input row, since the tiling is fixed by the weight's shape."""

    name = "dequant"

    def supports(self, qtype: Q, device) -> bool:
        return qtype not in (Q.F32, Q.F16, Q.BF16)  # float weights are nn.Linear parameters

    def prepare(self, packed: torch.Tensor, qtype: Q, out_features: int, in_features: int) -> Any:
        return packed, qtype

    def matmul(self, x: torch.Tensor, prepared: Any) -> torch.Tensor:
        packed, qtype = prepared
        if not x.is_cpu:
            return invariant_linear(x, dequantize(packed, qtype).to(x.device))
        return tiled_dequant_linear(x, packed, qtype)


TILE_BYTES = 1 << 20  # float32 weights dequantized at a time: stays in L2 while the rows read it
_scratch = threading.local()


def _tile_buffer(numel: int) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    # A buffer made under torch.inference_mode (a model's forward) cannot be written outside it.
    if buf is None or buf.numel() < numel or (buf.is_inference() and not torch.is_inference_mode_enabled()):
        buf = _scratch.buf = torch.empty(numel)
    return buf[:numel]


def tile_rows(in_features: int) -> int:
    """Output rows per tile: about TILE_BYTES of float32, a multiple of 16."""
    return max(16, TILE_BYTES // (4 * in_features) // 16 * 16)


def tiled_dequant_linear(x: torch.Tensor, packed: torch.Tensor, qtype: Q) -> torch.Tensor:
    """x (T, K) float32 @ dequantize(packed)^T -> (T, N), a tile of weight rows at a time; each
    tile multiplies the rows in calls of ROW_TILE (see invariant_linear)."""
    t, k = x.shape
    n = packed.shape[0]
    pad = -t % ROW_TILE
    if pad:
        x = torch.cat((x, x.new_zeros(pad, k)))
    out = x.new_empty(x.shape[0], n)
    rows = tile_rows(k)
    buf = _tile_buffer(min(rows, n) * k)
    for i in range(0, n, rows):
        j = min(n, i + rows)
        w = dequantize_into(packed[i:j], qtype, buf[:(j - i) * k].view(j - i, k))
        for r in range(0, x.shape[0], ROW_TILE):
            out[r:r + ROW_TILE, i:j] = F.linear(x[r:r + ROW_TILE], w)
    return out[:t]


_LOW_NIBBLES = 0x0F0F0F0F


def dequantize_into(rows: torch.Tensor, qtype: Q, out: torch.Tensor) -> torch.Tensor:
    """ggml_types.dequantize(rows, qtype) written into out (N, K) float32, bit for bit: the same
    float32 operations (each product of an f16 scale and a small integer is exact). For Q4_0 /
    Q4_1 / Q8_0 the fields are read through views of the rows as 16- and 32-bit words (every
    block's size is even, Q4_1's a multiple of 4) instead of copied out byte slice by byte slice,
    and the nibbles are split four bytes at a time: about 3x the reference's speed."""
    if qtype not in (Q.Q4_0, Q.Q4_1, Q.Q8_0) or not rows.is_contiguous() or rows.storage_offset() % 4:
        return out.copy_(dequantize(rows, qtype))
    o = out.view(-1, 32)  # (B, 32): one block per row
    if qtype == Q.Q8_0:  # d f16 | 32 x int8
        d = rows.view(torch.float16).reshape(-1, 17)[:, 0:1].float()  # (B, 1)
        return o.copy_(rows.view(torch.int8).reshape(-1, 34)[:, 2:]).mul_(d).view_as(out)
    if qtype == Q.Q4_1:  # d f16 | m f16 | qs 16 bytes = 4 int32 words
        h = rows.view(torch.float16).reshape(-1, 10)
        d, m = h[:, 0:1].float(), h[:, 1:2].float()
        qs = rows.view(torch.int32).reshape(-1, 5)[:, 1:]  # (B, 4)
    else:  # Q4_0: d f16 | qs 16 bytes = 8 int16 words
        w = rows.view(torch.int16).reshape(-1, 9)
        d, m = w[:, 0:1].view(torch.float16).float(), None
        qs = w[:, 1:]  # (B, 8)
    # byte j holds element j (low nibble) and element j + 16 (high nibble); the arithmetic shift's
    # sign bits land above each word's top nibble, which the mask drops
    mask = _LOW_NIBBLES if qs.dtype == torch.int32 else 0x0F0F
    o.copy_(torch.cat(((qs & mask).view(torch.uint8), ((qs >> 4) & mask).view(torch.uint8)), 1))  # 0..15
    if m is None:
        return o.sub_(8).mul_(d).view_as(out)  # d * (q - 8)
    return o.mul_(d).add_(m).view_as(out)  # d * q + m


def q4_groups(packed: torch.Tensor, qtype: Q) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 / Q4_K rows -> 4-bit values q (N, K) uint8 in 0..15 and per-32-element
    scale and zero (N, K/32) float32 such that w = (q - 8) * scale + zero (torch's int4 form).
    Exact in float32 arithmetic except Q4_K's zero, 8 * scale - min, rounded once."""
    n = packed.shape[0]
    b = packed.reshape(-1, 144 if qtype == Q.Q4_K else (18 if qtype == Q.Q4_0 else 20))
    if qtype == Q.Q4_K:
        sc, mn = _k_scale_min(b[:, 4:16])
        scale, low = _f16(b[:, 0:2]) * sc, _f16(b[:, 2:4]) * mn  # (B, 8)
        q = _nibbles(b[:, 16:].reshape(-1, 4, 32)).reshape(-1, 8, 32)
        zero = 8 * scale - low
    else:
        scale = _f16(b[:, 0:2])  # (B, 1)
        q = _nibbles(b[:, 2:] if qtype == Q.Q4_0 else b[:, 4:])
        zero = torch.zeros_like(scale) if qtype == Q.Q4_0 else _f16(b[:, 2:4]) + 8 * scale
    return q.reshape(n, -1), scale.reshape(n, -1), zero.reshape(n, -1)


@dataclass
class Int4Packed:
    weight: torch.Tensor  # (N, K/2) uint8, torch's CPU int4 layout
    scale_zero: torch.Tensor  # (K/32, N, 2) bfloat16
    out_features: int


class Int4PackKernel:
    """torch.ops.aten._weight_int4pack_mm_for_cpu: 4-bit weights in groups of 32 with a bf16
    scale and zero per group. Its fast path takes bf16 activations and returns bf16 (a float32
    call exists but runs ~20x slower than float32 F.linear): so activations, scales and outputs
    are rounded to bf16, and the result is not the file's weights at float32 precision."""

    name = "int4pack"

    def supports(self, qtype: Q, device) -> bool:
        return qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) and torch.device(device).type == "cpu"

    def prepare(self, packed: torch.Tensor, qtype: Q, out_features: int, in_features: int) -> Int4Packed:
        if out_features % 16:
            raise ValueError(f"int4pack needs a multiple of 16 output features, got {out_features}")
        q, scale, zero = q4_groups(packed, qtype)
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        sz = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()  # (K/32, N, 2)
        return Int4Packed(weight, sz, out_features)

    def matmul(self, x: torch.Tensor, prepared: Int4Packed) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), prepared.weight, 32,
                                                        prepared.scale_zero)
        return y.float()


class NativeKernel:
    """specpipe.kernels.native (a C kernel built separately): float32 activations, packed rows."""

    name = "native"

    def __init__(self, module) -> None:
        self._native = module
        self._types = set(module.supported_types())

    def supports(self, qtype: Q, device) -> bool:
        return qtype in self._types and torch.device(device).type == "cpu"

    def prepare(self, packed: torch.Tensor, qtype: Q, out_features: int, in_features: int) -> Any:
        # QuantLinear checked the packed shape against the type and in_features; supports() the type
        return packed.contiguous(), int(qtype)

    def matmul(self, x: torch.Tensor, prepared: Any) -> torch.Tensor:
        packed, type_id = prepared
        return self._native.matmul_checked_packed(x, packed, type_id, torch.get_num_threads())
