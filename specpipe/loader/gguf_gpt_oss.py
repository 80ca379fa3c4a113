"""llama.cpp's `gpt-oss` files (convert_hf_to_gguf.py: conversion/gpt_oss.py; src/models/openai-moe-iswa.cpp)
-> ModelConfig options (gguf_families.py calls these; names: gguf_families.canonical_parts).

What the converter writes and the loader reads here:
  * tensors: attn_sinks (H,) per layer (-> self_attn.sinks), biases on attn_q/k/v/output, the
    router ffn_gate_inp with its bias, ffn_{gate,up,down}_exps with their biases (E, N) (one row
    an expert), post_attention_norm as the MLP's input norm; MXFP4 experts as GGML MXFP4 blocks
    (its repack_mxfp4), float ones de-interleaved into gate and up. Nothing is permuted (NEOX rope).
  * metadata: expert_count, expert_used_count, expert_feed_forward_length, sliding_window;
    YaRN in rope.scaling.{type,factor,original_context_length}.
  * what llama.cpp fixes rather than reads, so do we: every other layer slides, the first one
    first (its swa pattern 2); the clamped SwiGLU's alpha 1.702 and limit 7.0; the router's
    softmax over the chosen logits. One choice differs from llama.cpp: YaRN's ramp ends are not
    rounded to whole dims (transformers' `truncate: false` for gpt-oss; llama.cpp's
    ggml_rope_yarn_corr_dims rounds them), so a GGUF file gives the Hugging Face model's numbers.
"""

from __future__ import annotations

from typing import Any

from specpipe.config import MoEConfig, YarnRope, yarn_mscale

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # llama.cpp's constants for gpt-oss (and transformers' defaults)


def options(md: Any, key: str, num_layers: int, names: set[str]) -> dict[str, Any]:
    moe = MoEConfig(md.get_int(key + ".expert_count"), md.get_int(key + ".expert_used_count"),
                    md.get_int(key + ".expert_feed_forward_length"), True, tuple(range(num_layers)),
                    scoring="topk_softmax", router_bias="layers.0.mlp.gate.bias" in names, expert_bias=True,
                    swiglu_limit=SWIGLU_LIMIT, swiglu_alpha=SWIGLU_ALPHA)
    out: dict[str, Any] = dict(moe=moe, attention_sinks=True, o_proj_bias="layers.0.self_attn.o_proj.bias" in names)
    window = md.get_int(key + ".attention.sliding_window", None)
    if window:
        out.update(sliding_window=window, sliding_layers=tuple(range(0, num_layers, 2)))
    prefix = key + ".rope.scaling."
    if md.get_str(prefix + "type", None) == "yarn":
        factor = md.get_float(prefix + "factor")
        attention = md.get_float(prefix + "attn_factor", 1.0) * yarn_mscale(factor)
        out["rope_scaling"] = YarnRope(factor, md.get_int(prefix + "original_context_length"),
                                       md.get_float(prefix + "yarn_beta_fast", 32.0),
                                       md.get_float(prefix + "yarn_beta_slow", 1.0), attention, truncate=False)
    return out
