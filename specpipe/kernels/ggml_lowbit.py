"""The low-bit GGML weight types: their block layouts and one plain reference dequantize each.

These are the types llama.cpp's quantizer writes below 4.5 bits (Q2_K, Q3_K, the importance-matrix
"IQ" types), the OCP 4-bit float MXFP4 that gpt-oss ships in, and the ternary TQ1_0 / TQ2_0.
Fields are little-endian; "f16" is IEEE half; offsets in bytes (the C structs of
kernels/native/ggml_blocks.h are the same, and checked against LAYOUTS when the library loads).
Values are numbered in storage order of the dequantized row; `grid[i]` is entry i of the type's
grid (kernels/native/ggml_grids.h: 8 values per entry, 4 for the IQ3 types), `ksigns[i]` the
8 sign bits (1 = negative) of a 7-bit sign index.

  Q2_K    256 values (16 sub-blocks of 16), 84 bytes: [0:16] scales: sub-block j's scale in the
          low nibble of byte j, its min in the high nibble | [16:80] qs | [80:82] d f16 |
          [82:84] dmin f16.  Value 128h + 32s + l (h < 2, s < 4, l < 32): q = qs[32h + l] >> 2s & 3.
          w = (d * sc[j]) * q - (dmin * m[j]),  j = value / 16
  Q3_K    256 values (16 sub-blocks of 16), 110 bytes: [0:32] hmask | [32:96] qs | [96:108]
          scales: 16 six-bit values, low 4 bits of j in byte j & 15 (j < 8) or byte j - 8 >> 4,
          high 2 bits in byte 8 + j % 4 >> 2 (j / 4) | [108:110] d f16.  Value 128h + 32s + l:
          q = (qs[32h + l] >> 2s & 3) - 4 * (1 - (hmask[l] >> (4h + s) & 1)).
          w = (d * (sc[j] - 32)) * q
  IQ2_XXS 256 values (8 sub-blocks of 32), 66 bytes: [0:2] d f16 | [2:66] qs: per sub-block two
          u32, a0 (4 grid indices, one per byte) and a1 (4 seven-bit sign indices at bits 7k,
          the scale ls in bits 28-31).  Value 32b + 8k + i = grid[byte k of a0][i] * sign,
          sign from ksigns[a1 >> 7k & 127] bit i.  w = (d * (0.5 + ls) * 0.25) * grid * sign
  IQ2_XS  256 values (16 sub-blocks of 16), 74 bytes: [0:2] d | [2:66] qs: 32 u16, group g of 8
          values: grid index q & 511, sign index q >> 9 | [66:74] scales: sub-block j's 4-bit ls
          in byte j / 2 (low nibble for even j).  w = (d * (0.5 + ls) * 0.25) * grid * sign
  IQ2_S   256 values (16 sub-blocks of 16), 82 bytes: [0:2] d | [2:34] qs: low 8 bits of group
          g's grid index | [34:66] signs: byte g's bits are group g's signs | [66:74] qh: bits
          2(g % 4) .. +1 of byte g / 4 are the index's bits 8-9 | [74:82] scales as IQ2_XS.
          w as IQ2_XS (1024-entry grid)
  IQ3_XXS 256 values (8 sub-blocks of 32), 98 bytes: [0:2] d | [2:66] qs: one grid index (4
          values) per byte, 8 per sub-block | [66:98] scales_signs: one u32 per sub-block, sign
          indices and ls as IQ2_XXS's a1.  w = (d * (0.5 + ls) * 0.5) * grid * sign
  IQ3_S   256 values (8 sub-blocks of 32), 110 bytes: [0:2] d | [2:66] qs: low 8 bits of grid
          index j (4 values) | [66:74] qh: bit j % 8 of byte j / 8 is index j's bit 8 |
          [74:106] signs: byte g's bits are values 8g..8g+7's signs | [106:110] scales: sub-block
          b's 4-bit ls in byte b / 2.  w = (d * (1 + 2 ls)) * grid * sign
  IQ1_S   256 values (8 sub-blocks of 32), 50 bytes: [0:2] d | [2:34] qs: low 8 bits of group
          g's grid index | [34:50] qh: a u16 per sub-block b: bits 3k..3k+2 = bits 8-10 of group
          4b + k's index, bits 12-14 the scale ls, bit 15 the delta's sign.
          w = (d * (2 ls + 1)) * (grid + delta),  delta = +-0.125
  IQ1_M   256 values (16 sub-blocks of 16), 56 bytes: [0:32] qs as IQ1_S | [32:48] qh: nibble g
          (low nibble of byte g / 2 for even g): bits 0-2 = index bits 8-10 of group g, bit 3 =
          group g's delta sign | [48:56] scales: four u16, bits 3(j % 4) .. +2 of u16 j / 4 are
          sub-block j's 3-bit ls; the top nibbles of u16 0, 1, 2, 3 are bits 0-3, 4-7, 8-11,
          12-15 of d (f16).  w = (d * (2 ls + 1)) * (grid + delta)
  IQ4_NL  32 values, 18 bytes: [0:2] d | [2:18] qs as Q4_0's nibbles.  w = d * kvalues_iq4nl[q]
  IQ4_XS  256 values (8 sub-blocks of 32), 136 bytes: [0:2] d | [2:4] scales_h u16: bits 2b, 2b+1
          = ls bits 4-5 of sub-block b | [4:8] scales_l: ls bits 0-3 in nibble b (low first) |
          [8:136] qs: bytes 16b.. as Q4_0's nibbles for sub-block b.
          w = (d * (ls - 32)) * kvalues_iq4nl[q]
  MXFP4   32 values, 17 bytes: [0] e (E8M0) | [1:17] qs as Q4_0's nibbles.
          w = 2^(e - 128) * kvalues_mxfp4[q] (the doubled E2M1 values; e < 2: a subnormal)
  TQ1_0   256 values, 54 bytes: [0:48] qs | [48:52] qh | [52:54] d f16; five (four in qh)
          base-3 digits per byte, stored as ceil(v * 256 / 243): digit p of byte c is
          ((c * 3^p mod 256) * 3) >> 8.  Values 32p + l from qs[l] (l < 32), 160 + 16p + l from
          qs[32 + l], 240 + 4p + l from qh[l].  w = d * (digit - 1)
  TQ2_0   256 values, 66 bytes: [0:64] qs | [64:66] d f16.  Value 128h + 32s + l:
          q = qs[32h + l] >> 2s & 3.  w = d * (q - 1)

Every formula is gguf-py's `gguf.quants` operation by operation (float32, one rounding each, in
its order), so the result is bitwise equal to it (tests/kernels/test_lowbit_types.py).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import gguf
import torch

from specpipe.kernels.ggml_layouts import LAYOUTS, _f16

Q = gguf.GGMLQuantizationType
GRIDS_H = Path(__file__).resolve().parent / "native" / "ggml_grids.h"
_CTYPES = {"uint64_t": (8, False), "uint32_t": (4, False), "uint8_t": (1, False), "int8_t": (1, True)}


@lru_cache(maxsize=None)
def c_tables() -> dict[str, torch.Tensor]:
    """ggml_grids.h's tables, parsed: name -> (entries, bytes per entry) int8/uint8 tensor (the
    grids' values, byte i of an entry = value i) or a 1-D table."""
    text = GRIDS_H.read_text()
    out = {}
    for ctype, name, count, body in re.findall(r"static const (\w+) (\w+)\[(\d+)\] = \{(.*?)\};", text, re.S):
        width, signed = _CTYPES[ctype]
        vals = [int(v, 0) for v in body.replace("\n", " ").split(",") if v.strip()]
        if len(vals) != int(count):
            raise ValueError(f"{GRIDS_H}: {name} has {len(vals)} entries, declared {count}")
        if width == 1:
            out[name] = torch.tensor(vals, dtype=torch.int8 if signed else torch.uint8)
        else:  # little-endian bytes of each entry; the IQ1 grid's bytes are int8
            b = torch.tensor([(v >> (8 * i)) & 0xFF for v in vals for i in range(width)], dtype=torch.uint8)
            out[name] = b.reshape(len(vals), width)
    return out


def _grid(name: str) -> torch.Tensor:
    """A grid as float32 values (IQ1's bytes read as int8)."""
    g = c_tables()[name]
    return (g.view(torch.int8) if name == "sp_iq1s_grid" else g).float()


def _bits8(b: torch.Tensor) -> torch.Tensor:
    """(..., n) uint8 -> (..., n, 8): bit i of each byte."""
    return (b[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1


def _signs(bits: torch.Tensor) -> torch.Tensor:
    return torch.where(bits == 0, 1.0, -1.0)


def _u16(b: torch.Tensor) -> torch.Tensor:
    """(B, 2n) uint8 -> (B, n) int64 little-endian u16."""
    b = b.long()
    return b[:, 0::2] | (b[:, 1::2] << 8)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """(B, 4n) uint8 -> (B, n) int64 little-endian u32."""
    b = b.long()
    return b[:, 0::4] | (b[:, 1::4] << 8) | (b[:, 2::4] << 16) | (b[:, 3::4] << 24)


def _ksigns(index: torch.Tensor) -> torch.Tensor:
    """Seven-bit sign indices (...) -> (..., 8) float32 +-1."""
    return _signs(_bits8(c_tables()["sp_ksigns_iq2xs"][index]))


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """(B, m, 16) uint8 -> (B, m, 32) long: the low nibbles, then the high ones (Q4_0's order)."""
    return torch.cat((qs & 15, qs >> 4), dim=-1).long()


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """(B, 64) uint8 -> (B, 256): value 128h + 32s + l = qs[32h + l] >> 2s & 3."""
    n = qs.shape[0]
    return ((qs.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3).reshape(n, 256)


def _iq2_db(d: torch.Tensor, ls: torch.Tensor, factor: float) -> torch.Tensor:
    return d * (0.5 + ls.float()) * factor


def dequantize_blocks(b: torch.Tensor, qtype: Q) -> torch.Tensor:
    """(B, type_size) uint8 -> (B, values) float32, bitwise gguf.quants.dequantize's."""
    f = LAYOUTS[qtype].field
    n = b.shape[0]
    if qtype == Q.Q2_K:
        sc = f(b, "scales")
        dl = (_f16(f(b, "d")) * (sc & 15).float())[:, :, None]  # (B, 16, 1)
        ml = (_f16(f(b, "dmin")) * (sc >> 4).float())[:, :, None]
        q = _crumbs(f(b, "qs")).reshape(n, 16, 16).float()
        return (dl * q - ml).reshape(n, 256)
    if qtype == Q.Q3_K:
        s = f(b, "scales")
        lo = (s[:, None, :8] >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]).reshape(n, 16) & 15
        hi = (s[:, None, 8:] >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]).reshape(n, 16) & 3
        dl = (_f16(f(b, "d")) * ((lo | (hi << 4)).to(torch.int8) - 32).float())[:, :, None]
        high = _bits8(f(b, "hmask")).transpose(1, 2).reshape(n, 256)  # value 32k + l: bit k of hmask[l]
        q = _crumbs(f(b, "qs")).to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)
        return (dl * q.reshape(n, 16, 16).float()).reshape(n, 256)
    if qtype in (Q.IQ2_XXS, Q.IQ3_XXS):
        d = _f16(f(b, "d"))
        if qtype == Q.IQ2_XXS:
            a = _u32(f(b, "qs")).reshape(n, 8, 2)
            idx, a1 = f(b, "qs").reshape(n, 8, 8)[:, :, :4].long(), a[..., 1]  # (B, 8, 4) grid indices
            grid = _grid("sp_iq2xxs_grid")[idx]  # (B, 8, 4, 8)
            db = _iq2_db(d, a1 >> 28, 0.25)
        else:
            a1 = _u32(f(b, "scales_signs"))  # (B, 8)
            grid = _grid("sp_iq3xxs_grid")[f(b, "qs").long()].reshape(n, 8, 4, 8)
            db = _iq2_db(d, a1 >> 28, 0.5)
        signs = _ksigns((a1[:, :, None] >> torch.tensor([0, 7, 14, 21])) & 127)  # (B, 8, 4, 8)
        return (db[:, :, None, None] * grid * signs).reshape(n, 256)
    if qtype in (Q.IQ2_XS, Q.IQ2_S):
        sc = f(b, "scales")
        ls = torch.stack((sc & 15, sc >> 4), dim=-1).reshape(n, 16)
        db = _iq2_db(_f16(f(b, "d")), ls, 0.25)
        if qtype == Q.IQ2_XS:
            q = _u16(f(b, "qs"))  # (B, 32)
            grid, signs = _grid("sp_iq2xs_grid")[q & 511], _ksigns(q >> 9)
        else:
            qh = (f(b, "qh")[:, :, None] >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)).reshape(n, 32) & 3
            grid = _grid("sp_iq2s_grid")[f(b, "qs").long() | (qh.long() << 8)]
            signs = _signs(_bits8(f(b, "signs")))
        return (db[:, :, None, None] * grid.reshape(n, 16, 2, 8) * signs.reshape(n, 16, 2, 8)).reshape(n, 256)
    if qtype == Q.IQ3_S:
        sc = f(b, "scales")
        ls = torch.stack((sc & 15, sc >> 4), dim=-1).reshape(n, 8)
        db = _f16(f(b, "d")) * (1 + 2 * ls).float()
        hi = _bits8(f(b, "qh")).reshape(n, 64).long()
        grid = _grid("sp_iq3s_grid")[f(b, "qs").long() | (hi << 8)].reshape(n, 8, 4, 8)
        signs = _signs(_bits8(f(b, "signs"))).reshape(n, 8, 4, 8)
        return (db[:, :, None, None] * grid * signs).reshape(n, 256)
    if qtype == Q.IQ1_S:
        qh = _u16(f(b, "qh"))  # (B, 8)
        dl = _f16(f(b, "d")) * (2 * ((qh >> 12) & 7) + 1).float()
        delta = torch.where((qh & 0x8000) == 0, 0.125, -0.125)
        hi = ((qh[:, :, None] >> torch.tensor([0, 3, 6, 9])) & 7).reshape(n, 32)
        grid = _grid("sp_iq1s_grid")[f(b, "qs").long() | (hi << 8)].reshape(n, 8, 4, 8)
        return (dl[:, :, None, None] * (grid + delta[:, :, None, None])).reshape(n, 256)
    if qtype == Q.IQ1_M:
        sc = _u16(f(b, "scales"))  # (B, 4)
        top = sc & 0xF000
        bits = (top[:, 0] >> 12) | (top[:, 1] >> 8) | (top[:, 2] >> 4) | top[:, 3]
        d = bits.to(torch.int16).view(torch.float16).float()[:, None]  # (B, 1)
        ls = ((sc[:, :, None] >> torch.tensor([0, 3, 6, 9])) & 7).reshape(n, 16)
        dl = (d * (2 * ls + 1).float()).reshape(n, 8, 2)
        nib = torch.stack((f(b, "qh") & 15, f(b, "qh") >> 4), dim=-1).reshape(n, 32).long()
        grid = _grid("sp_iq1s_grid")[f(b, "qs").long() | ((nib & 7) << 8)].reshape(n, 8, 2, 2, 8)
        delta = torch.where((nib & 8) == 0, 0.125, -0.125).reshape(n, 8, 2, 2, 1)
        return (dl[:, :, :, None, None] * (grid + delta)).reshape(n, 256)
    if qtype in (Q.IQ4_NL, Q.MXFP4):
        if qtype == Q.IQ4_NL:
            d, kv = _f16(f(b, "d")), c_tables()["sp_kvalues_iq4nl"]
        else:  # E8M0, halved (the values are doubled): 2^(e - 128), as ggml_e8m0_to_fp32_half
            e = f(b, "e").long()
            d = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(torch.int32).view(torch.float32)
            kv = c_tables()["sp_kvalues_mxfp4"]
        return d * kv[_nibbles32(f(b, "qs")[:, None, :])[:, 0]].float()
    if qtype == Q.IQ4_XS:
        sl = f(b, "scales_l")
        lo = torch.stack((sl & 15, sl >> 4), dim=-1).reshape(n, 8)
        hi = ((_u16(f(b, "scales_h")) >> torch.arange(0, 16, 2)) & 3).to(torch.uint8)  # (B, 8)
        dl = _f16(f(b, "d")) * ((lo | (hi << 4)).to(torch.int8) - 32).float()  # (B, 8)
        q = c_tables()["sp_kvalues_iq4nl"][_nibbles32(f(b, "qs").reshape(n, 8, 16))].float()  # (B, 8, 32)
        return (dl[:, :, None] * q).reshape(n, 256)
    if qtype == Q.TQ2_0:
        return _f16(f(b, "d")) * (_crumbs(f(b, "qs")).to(torch.int8) - 1).float()
    if qtype == Q.TQ1_0:
        qs, qh = f(b, "qs"), f(b, "qh")
        p5 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8)[:, None]
        digits = torch.cat(((qs[:, None, :32] * p5).reshape(n, 160), (qs[:, None, 32:] * p5).reshape(n, 80),
                            (qh[:, None, :] * p5[:4]).reshape(n, 16)), dim=-1)  # uint8: wraps mod 256
        q = ((digits.to(torch.int16) * 3) >> 8).to(torch.int8) - 1
        return _f16(f(b, "d")) * q.float()
    raise NotImplementedError(f"no dequantize for GGML type {qtype.name}")
