"""gpt-oss's Hugging Face tensors seen under the canonical per-expert names (loader/checkpoint.py).

transformers' GptOssExperts keeps all of a layer's experts in a few stacked tensors, and OpenAI
ships their matrices as MXFP4 blocks:

    stored (per layer, under mlp.experts.)       shape                 canonical, for expert e
    gate_up_proj        (bf16 files)             (E, H, 2I)   x @ W    gate_proj.weight = W[e][:, 0::2].T (I, H)
                                                                       up_proj.weight   = W[e][:, 1::2].T (I, H)
    gate_up_proj_bias                            (E, 2I)               gate_proj.bias = b[e][0::2], up_proj.bias = b[e][1::2]
    down_proj           (bf16 files)             (E, I, H)    x @ W    down_proj.weight = W[e].T (H, I)
    down_proj_bias                               (E, H)                down_proj.bias = b[e]
    gate_up_proj_blocks (MXFP4 files)            (E, 2I, H/32, 16)     gate rows 0::2, up rows 1::2 (out, in)
    gate_up_proj_scales                          (E, 2I, H/32)
    down_proj_blocks / _scales                   (E, H, I/32, 16) / (E, H, I/32)
    mlp.router.{weight,bias}                     (E, H) / (E,)         mlp.gate.{weight,bias}

Gate and up are interleaved (transformers' _apply_gate reads gate_up[..., ::2] and [..., 1::2]).

MXFP4 stays packed: each (row, block) of 32 weights becomes one GGML MXFP4 block (kernels/
ggml_lowbit.py), 17 bytes: [0] the E8M0 scale byte as stored, [1:17] the 32 E2M1 codes as nibbles.
The code tables agree (GGML's kvalues_mxfp4 are the E2M1 values doubled, and its scale is
2^(e - 128) where transformers' is 2^(e - 127)), so the scale byte and each 4-bit code are copied;
only the nibble order differs: transformers packs weights 2i (low nibble) and 2i + 1 (high) in
byte i (integrations/mxfp4.py convert_moe_packed_tensors), GGML weights j (low) and j + 16 (high)
in byte j. Only expert e's bytes of a stacked tensor are read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

import gguf
import torch

Q = gguf.GGMLQuantizationType

RENAMES = ((re.compile(r"\.mlp\.router\."), ".mlp.gate."),)
_STACKED = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


@dataclass(frozen=True)
class ExpertSlice:
    """One canonical expert tensor inside a stacked one."""

    stored: str  # the stacked tensor's canonical name (weights, biases or MXFP4 blocks)
    expert: int
    half: Optional[int]  # gate_up: 0 = gate, 1 = up (interleaved); None: down_proj
    kind: str  # "weight" (float, x @ W layout) | "bias" | "mxfp4" (blocks; scales beside them)

    @property
    def scales(self) -> str:
        return self.stored[:-len("_blocks")] + "_scales"


def expert_slices(name: str, shape: tuple[int, ...]) -> Optional[list[tuple[str, ExpertSlice]]]:
    """The canonical tensors a stacked gpt-oss expert tensor `name` (canonical, e.g.
    layers.3.mlp.experts.gate_up_proj_blocks) holds; [] for the scales (read with their blocks);
    None for any other tensor."""
    m = _STACKED.match(name)
    if m is None:
        return None
    prefix, proj, suffix = m.groups()
    if suffix == "_scales":
        return []
    kind = {None: "weight", "_bias": "bias", "_blocks": "mxfp4"}[suffix]
    leaf = "bias" if kind == "bias" else "weight"
    halves = ((0, "gate_proj"), (1, "up_proj")) if proj == "gate_up_proj" else ((None, "down_proj"),)
    return [(f"{prefix}.{e}.{part}.{leaf}", ExpertSlice(name, e, half, kind))
            for e in range(shape[0]) for half, part in halves]


def slice_shape(s: ExpertSlice, stored: tuple[int, ...]) -> tuple[int, ...]:
    """The canonical shape of `s`, from its stacked tensor's shape."""
    halved = (lambda n: n // 2) if s.half is not None else (lambda n: n)
    if s.kind == "bias":
        return (halved(stored[1]),)
    if s.kind == "weight":  # (E, in, out) -> (out, in)
        return (halved(stored[2]), stored[1])
    return (halved(stored[1]), stored[2] * 32)  # blocks (E, out, in / 32, 16)


def _rows(t: torch.Tensor, half: Optional[int]) -> torch.Tensor:
    return t if half is None else t[half::2]


def load_slice(s: ExpertSlice, expert: Callable[[str, int], torch.Tensor]) -> torch.Tensor:
    """A float (weight or bias) slice in canonical layout; `expert(name, e)` reads expert e of a
    stacked tensor."""
    t = expert(s.stored, s.expert)
    if s.kind == "bias":  # a copy, never the reader's tensor (which it may hand out again)
        return _rows(t, s.half).clone(memory_format=torch.contiguous_format)
    return _rows(t.t(), s.half).contiguous()  # (in, out) -> (out, in), then gate or up rows


def packed_slice(s: ExpertSlice, expert: Callable[[str, int], torch.Tensor]) -> torch.Tensor:
    """An MXFP4 slice as GGML MXFP4 rows (out, in / 32 * 17) uint8."""
    blocks = _rows(expert(s.stored, s.expert), s.half)  # (out, in / 32, 16)
    scales = _rows(expert(s.scales, s.expert), s.half)  # (out, in / 32)
    return ggml_mxfp4_rows(blocks, scales)


def ggml_mxfp4_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' MXFP4 (blocks (R, B, 16) uint8, scales (R, B) uint8) -> GGML MXFP4 rows (R, B * 17)."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32)  # weight order
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # (R, B, 16): GGML's nibble order
    return torch.cat((scales.unsqueeze(-1), qs), dim=-1).reshape(blocks.shape[0], -1).contiguous()


__all__ = ["RENAMES", "ExpertSlice", "expert_slices", "slice_shape", "load_slice", "packed_slice", "ggml_mxfp4_rows"]
