"""Which decoder layers run as one native call (kernels/native/layer.c), decided once at load.

A layer qualifies when it is the plain Llama layer (RMSNorm without the Gemma +1, no q/k norms,
no sandwich norms, no latent attention, a SiLU-gated MLP, no experts) and every projection is
packed GGUF rows on the native kernel, in a stage whose activations are float32 on the CPU. The
choice depends on the model alone, never on the rows of a call, so every mode computes a token
the same way. A layer that does not qualify keeps its torch-written forward (model/llama.py),
which gives the same bits on the same parts. SPECPIPE_FUSED_LAYERS=0 turns the fused path off (for comparisons).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn as nn

from specpipe.kernels.native import layer as native_layer
from specpipe.kernels.qlinear import QuantLinear, StackedLinear
from specpipe.model.mla import LatentAttention
from specpipe.model.moe import ACTIVATIONS, MLP


def enabled() -> bool:
    return os.environ.get("SPECPIPE_FUSED_LAYERS", "1").strip().lower() not in ("0", "false", "no", "off")


def fuse_layers(model: nn.Module) -> int:
    """Give every qualifying decoder layer of `model` (a LlamaStage: its `layers`) its native
    descriptor (layer.native); returns how many layers got one. Only llama.py imports this
    module, never the other way round: the stage hands its layers over."""
    if not (enabled() and native_layer.available()) or getattr(model, "act_dtype", None) != torch.float32:
        return 0
    count = 0
    for layer in model.layers.values():
        layer.native = layer_weights(layer)
        count += layer.native is not None
    return count


def _native_parts(module: nn.Module, *names: str, stacked_as: Optional[str] = None) -> Optional[list]:
    """The projections `names` of `module` (or the groups of its StackedLinear `stacked_as`) when
    each is packed rows on the native kernel, else None."""
    stacked = getattr(module, stacked_as, None) if stacked_as else None
    parts = stacked.groups if isinstance(stacked, StackedLinear) else [getattr(module, n, None) for n in names]
    out = []
    for p in parts:
        if not (isinstance(p, QuantLinear) and p.kernel == "native" and p.packed is not None
                and p.packed.device.type == "cpu"):
            return None
        out.append(p)
    return out


def layer_weights(layer: nn.Module):
    """The layer's native.layer.LayerWeights, or None when it does not qualify."""
    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if isinstance(attn, LatentAttention):  # layer.c computes per-head K/V attention only
        return None
    if attn.sinks is not None or attn.o_proj.bias is not None:  # gpt-oss: layer.c has neither
        return None
    if (layer.sandwich or attn.qk_norm or not isinstance(mlp, MLP) or mlp.act is not ACTIVATIONS["silu"]
            or mlp.swiglu is not None):
        return None
    if any(n.plus_one or n.eps != norms[0].eps or n.weight.device.type != "cpu" for n in norms):
        return None
    qkv = _native_parts(attn, "q_proj", "k_proj", "v_proj", stacked_as="qkv")
    gate_up = _native_parts(mlp, "gate_proj", "up_proj", stacked_as="gate_up")
    o, down = _native_parts(attn, "o_proj"), _native_parts(mlp, "down_proj")
    if qkv is None or gate_up is None or o is None or down is None:
        return None

    def proj(q: QuantLinear) -> native_layer.Projection:
        return native_layer.Projection(q.packed, int(q.qtype), None if q.bias is None else q.bias.detach().contiguous())

    try:
        return native_layer.LayerWeights(
            hidden=norms[0].weight.shape[0], inter=sum(p.out_features for p in gate_up) // 2,
            hq=attn.hq, hkv=attn.hkv, d=attn.d, eps=norms[0].eps, scale=attn.scale,
            in_norm=norms[0].weight.detach(), post_norm=norms[1].weight.detach(),
            qkv=[proj(p) for p in qkv], o=proj(o[0]), gate_up=[proj(p) for p in gate_up], down=proj(down[0]))
    except ValueError:  # a shape or dtype the C layer does not take: the torch-written forward
        return None


def forward(layer: nn.Module, x: torch.Tensor, rope, meta, kv, index: int) -> torch.Tensor:
    """layer(x) through its native descriptor; the metadata's C view is built by the first
    layer that needs it and shared by the rest of the stage's layers."""
    if meta.native is None:
        meta.native = native_layer.Segments(meta.segments)
    return native_layer.decoder_layer(layer.native, x.contiguous(), rope.cos, rope.sin, kv.k[index],
                                      kv.v[index], meta.write_slots, meta.native, torch.get_num_threads())
