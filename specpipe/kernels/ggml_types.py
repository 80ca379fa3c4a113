"""GGML weight types: block sizes and one plain reference dequantize per type.

A quantized matrix (out, in) is stored as `out` rows of `in / block_size` blocks; a row is
`row_bytes = in / block_size * type_size` bytes, so any subset of rows can be decoded alone
(an embedding lookup decodes only the rows it reads). Within a block, element j of the block
is weight [row, block * block_size + j]. All multi-byte fields are little-endian; "f16" is
IEEE half. The layouts, as in llama.cpp's ggml-common.h / ggml-quants.c:

  Q4_0  32 elements, 18 bytes: [0:2] d f16 | [2:18] qs: byte j holds element j (low nibble)
        and element j+16 (high nibble).                    w = d * (q - 8)
  Q4_1  32 elements, 20 bytes: [0:2] d f16 | [2:4] m f16 | [4:20] qs as Q4_0.  w = d * q + m
  Q5_0  32 elements, 22 bytes: [0:2] d f16 | [2:6] qh u32: bit j is the 5th bit of element j |
        [6:22] qs as Q4_0 (low 4 bits).                   w = d * (q - 16)
  Q5_1  32 elements, 24 bytes: [0:2] d | [2:4] m | [4:8] qh | [8:24] qs.   w = d * q + m
  Q8_0  32 elements, 34 bytes: [0:2] d f16 | [2:34] qs int8.              w = d * q
  Q4_K  256 elements (8 sub-blocks of 32), 144 bytes: [0:2] d f16 | [2:4] dmin f16 |
        [4:16] 8 six-bit scales sc and 8 six-bit mins m, packed (see _k_scale_min) |
        [16:144] qs: for chunk c of 64 elements, bytes [32c, 32c+32) hold sub-block 2c in
        their low nibbles and sub-block 2c+1 in their high nibbles.
        w = (d * sc[s]) * q - (dmin * m[s])
  Q5_K  256 elements, 176 bytes: [0:2] d | [2:4] dmin | [4:16] scales as Q4_K |
        [16:48] qh: bit s of byte l is the 5th bit of element l of sub-block s |
        [48:176] qs as Q4_K.                   w = (d * sc[s]) * q - (dmin * m[s])
  Q6_K  256 elements (16 sub-blocks of 16), 210 bytes: [0:128] ql | [128:192] qh |
        [192:208] scales int8 | [208:210] d f16. Each half h of 128 elements uses
        ql[64h:64h+64] (low nibbles: elements 0-63 of the half, high nibbles: 64-127) and
        qh[32h:32h+32] (bits 2g..2g+1 of byte l: top 2 bits of element 32g + l).
        w = (d * scale[s]) * (q - 32)
  F16 / BF16 / F32: one element per "block" of 2 / 2 / 4 bytes.

The low-bit types (Q2_K, Q3_K, the IQ types, MXFP4, TQ1_0, TQ2_0) have their layouts and their
reference dequantize in ggml_lowbit.py, beside these; LAYOUTS holds them all.

The field offsets are the table LAYOUTS (ggml_layouts.py), which the reader slices by; it is the C structs'
of kernels/native/ggml_blocks.h written again, and checked against them (their offsetof and
sizeof, exported by the library) when the native library loads and in
tests/kernels/test_native_boundary.py.

The arithmetic (which products are formed first, f16 -> f32 before multiplying) follows
gguf-py's `gguf.quants`, operation by operation, so the result is bitwise equal to it; each
step is a separately rounded float32 operation (no fused multiply-add).
"""

from __future__ import annotations

import gguf
import torch

from specpipe.kernels import ggml_lowbit
from specpipe.kernels.ggml_layouts import LAYOUTS, Layout, _f16  # noqa: F401  (importers' names)

Q = gguf.GGMLQuantizationType


LOWBIT_TYPES = (Q.Q2_K, Q.Q3_K, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M,
                Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, Q.TQ1_0, Q.TQ2_0)

# qtype -> (elements per block, bytes per block)
BLOCKS: dict[Q, tuple[int, int]] = {
    **{q: (lay.values, lay.size) for q, lay in LAYOUTS.items()},
    Q.F16: (1, 2), Q.BF16: (1, 2), Q.F32: (1, 4),
}
FLOAT_TYPES = (Q.F16, Q.BF16, Q.F32)


def layout_text(qtype: Q) -> str:
    """LAYOUTS[qtype] as the native library's sp_block_layout writes its struct:
    "values bytes name:offset:size ..." (what the load-time check compares)."""
    lay = LAYOUTS[qtype]
    return " ".join([f"{lay.values} {lay.size}", *(f"{k}:{o}:{n}" for k, (o, n) in lay.fields.items())])


def block_size(qtype: Q) -> int:
    return BLOCKS[qtype][0]


def type_size(qtype: Q) -> int:
    return BLOCKS[qtype][1]


def row_bytes(qtype: Q, in_features: int) -> int:
    n, size = BLOCKS[qtype]
    if in_features % n:
        raise ValueError(f"{qtype.name} rows must be a multiple of {n} elements, got {in_features}")
    return in_features // n * size


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(B, n) uint8 -> (B, 2n): all low nibbles, then all high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(b: torch.Tensor, n: int) -> torch.Tensor:
    """(B, n/8) uint8 -> (B, n) uint8: bit i of the little-endian bit string."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b[..., :, None] >> shifts) & 1).reshape(*b.shape[:-1], n)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> 8 scales and 8 mins, 6 bits each.

    Bytes 0-3: scales 0-3 (low 6 bits), top 2 bits = bits 4-5 of scales 4-7;
    bytes 4-7: mins 0-3 likewise for mins 4-7; bytes 8-11: low nibble = low 4 bits of
    scales 4-7, high nibble = low 4 bits of mins 4-7.
    """
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mn.float()  # (B, 8) each


def _dequantize_blocks(b: torch.Tensor, qtype: Q) -> torch.Tensor:
    """(B, type_size) uint8 -> (B, block_size) float32."""
    f = LAYOUTS[qtype].field
    if qtype == Q.Q8_0:
        return f(b, "qs").contiguous().view(torch.int8).float() * _f16(f(b, "d"))
    if qtype == Q.Q4_0:
        return _f16(f(b, "d")) * (_nibbles(f(b, "qs")).to(torch.int8) - 8).float()
    if qtype == Q.Q4_1:
        return _f16(f(b, "d")) * _nibbles(f(b, "qs")).float() + _f16(f(b, "m"))
    if qtype in (Q.Q5_0, Q.Q5_1):
        q = _nibbles(f(b, "qs")) | (_bits(f(b, "qh"), 32) << 4)
        if qtype == Q.Q5_0:
            return _f16(f(b, "d")) * (q.to(torch.int8) - 16).float()
        return _f16(f(b, "d")) * q.float() + _f16(f(b, "m"))
    if qtype in (Q.Q4_K, Q.Q5_K):
        n = b.shape[0]
        sc, mn = _k_scale_min(f(b, "scales"))
        d = (_f16(f(b, "d")) * sc)[:, :, None]  # (B, 8, 1)
        dm = (_f16(f(b, "dmin")) * mn)[:, :, None]
        q = _nibbles(f(b, "qs").reshape(n, 4, 32)).reshape(n, 8, 32)  # sub-blocks 2c, 2c+1 per chunk c
        if qtype == Q.Q5_K:
            hi = ((f(b, "qh")[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1)  # (B, 32 l, 8 s)
            q = q | (hi.transpose(1, 2) << 4)
        return (d * q.float() - dm).reshape(n, 256)
    if qtype == Q.Q6_K:
        n = b.shape[0]
        ql = _nibbles(f(b, "ql").reshape(n, 2, 64)).reshape(n, 2, 4, 32)  # (B, half, group, l)
        qh = (f(b, "qh").reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3
        q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
        d = _f16(f(b, "d")) * f(b, "scales").contiguous().view(torch.int8).float()  # (B, 16)
        return (d[:, :, None] * q).reshape(n, 256)
    if qtype in LOWBIT_TYPES:
        return ggml_lowbit.dequantize_blocks(b, qtype)
    raise NotImplementedError(f"no dequantize for GGML type {qtype.name}")


def dequantize(rows: torch.Tensor, qtype: Q) -> torch.Tensor:
    """Packed rows (N, row_bytes) uint8 -> (N, K) float32 (the reference every kernel matches)."""
    n, nbytes = rows.shape
    if qtype == Q.F32:
        return rows.contiguous().view(torch.float32).clone()
    if qtype == Q.F16:
        return rows.contiguous().view(torch.float16).float()
    if qtype == Q.BF16:
        return rows.contiguous().view(torch.bfloat16).float()
    bs, ts = BLOCKS[qtype]
    if nbytes % ts:
        raise ValueError(f"{qtype.name}: a row of {nbytes} bytes is not a whole number of {ts}-byte blocks")
    blocks = rows.reshape(n * (nbytes // ts), ts)
    return _dequantize_blocks(blocks, qtype).reshape(n, nbytes // ts * bs)
