"""The GGML block types' layouts, field by field: the table every reader slices blocks by
(ggml_types.py for the older types' dequantize and the sizes, ggml_lowbit.py for the low-bit
types'). It is the C structs of kernels/native/ggml_blocks.h written again, checked against them
when the native library loads. A module of its own so that both readers import it and neither
imports the other back."""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Layout:
    """One block type: `values` elements in `size` bytes, its fields (name -> (offset, bytes))
    in storage order."""

    values: int
    size: int
    fields: dict[str, tuple[int, int]]

    def field(self, b: torch.Tensor, name: str) -> torch.Tensor:
        """The bytes of field `name` of blocks b (B, size) uint8 -> (B, its bytes)."""
        off, n = self.fields[name]
        return b[:, off:off + n]


def _layout(values: int, *fields: tuple[str, int]) -> Layout:
    out, off = {}, 0
    for name, n in fields:
        out[name] = (off, n)
        off += n
    return Layout(values, off, out)


# The quantized block types, field by field (kernels/native/ggml_blocks.h: the same structs)
LAYOUTS: dict[Q, Layout] = {
    Q.Q4_0: _layout(32, ("d", 2), ("qs", 16)),
    Q.Q4_1: _layout(32, ("d", 2), ("m", 2), ("qs", 16)),
    Q.Q5_0: _layout(32, ("d", 2), ("qh", 4), ("qs", 16)),
    Q.Q5_1: _layout(32, ("d", 2), ("m", 2), ("qh", 4), ("qs", 16)),
    Q.Q8_0: _layout(32, ("d", 2), ("qs", 32)),
    Q.Q4_K: _layout(256, ("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128)),
    Q.Q5_K: _layout(256, ("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128)),
    Q.Q6_K: _layout(256, ("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)),
    # the low-bit types (ggml_lowbit.py describes each)
    Q.Q2_K: _layout(256, ("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2)),
    Q.Q3_K: _layout(256, ("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2)),
    Q.IQ2_XXS: _layout(256, ("d", 2), ("qs", 64)),
    Q.IQ2_XS: _layout(256, ("d", 2), ("qs", 64), ("scales", 8)),
    Q.IQ2_S: _layout(256, ("d", 2), ("qs", 32), ("signs", 32), ("qh", 8), ("scales", 8)),
    Q.IQ3_XXS: _layout(256, ("d", 2), ("qs", 64), ("scales_signs", 32)),
    Q.IQ3_S: _layout(256, ("d", 2), ("qs", 64), ("qh", 8), ("signs", 32), ("scales", 4)),
    Q.IQ1_S: _layout(256, ("d", 2), ("qs", 32), ("qh", 16)),
    Q.IQ1_M: _layout(256, ("qs", 32), ("qh", 16), ("scales", 8)),
    Q.IQ4_NL: _layout(32, ("d", 2), ("qs", 16)),
    Q.IQ4_XS: _layout(256, ("d", 2), ("scales_h", 2), ("scales_l", 4), ("qs", 128)),
    Q.MXFP4: _layout(32, ("e", 1), ("qs", 16)),
    Q.TQ1_0: _layout(256, ("qs", 48), ("qh", 4), ("d", 2)),
    Q.TQ2_0: _layout(256, ("qs", 64), ("d", 2)),
}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 -> (..., 1) float32."""
    return b.contiguous().view(torch.float16).float()
