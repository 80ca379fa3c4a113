"""llama.cpp's files of the sparse-expert families: `deepseek2` (DeepSeek V2 / V3 / R1, Kimi K2),
`glm4moe` (GLM-4.5 / 4.6) and `minimax-m2`, as its converter writes them (convert_hf_to_gguf.py:
conversion/deepseek.py, glm.py, minimax.py) and its runtime reads them (src/models/*.cpp): their
tensor names -> canonical ones, and their metadata -> ModelConfig options (gguf_families.py and
gguf.py call these).

What the converter does that the loader undoes or reads here:
  * deepseek2 splits kv_b_proj per head into attn_k_b (H, kv_lora_rank, qk_nope_head_dim): the key
    half, transposed; and attn_v_b (H, v_head_dim, kv_lora_rank). They are joined back into
    kv_b_proj (join_kv_b), which model/mla.py splits again. Older files keep attn_kv_b whole.
  * deepseek2 metadata: head_count_kv 1 and key_length = kv_lora_rank + RoPE dims (the latent);
    the per-head sizes are key_length_mla (nope + RoPE dims) and value_length_mla (older files:
    key_length and value_length); q_lora_rank only when queries go through a LoRA. RoPE turns
    interleaved pairs (llama.cpp's NORM rope for deepseek2), so rope_interleave is always on.
  * YaRN: the converter writes yarn_log_multiplier = 0.1 * mscale_all_dim; llama.cpp scales the
    scores by (attn_factor * (1 + 0.1 * mscale_all_dim * ln factor))^2 / sqrt(key_length_mla) and
    cos/sin by attn_factor (rope.scaling.attn_factor, 1 when absent): transformers' numbers
    whenever mscale == mscale_all_dim, as in every released DeepSeek.
  * routers: expert_gating_func (1 softmax, 2 sigmoid; absent: softmax for deepseek2, as
    llama.cpp reads older V2 files, except its GLM-4.7-Flash rule; sigmoid for the others),
    exp_probs_b (the selection bias), expert_weights_norm (absent: off; MiniMax-M2: always on),
    expert_weights_scale, expert_group_count / expert_group_used_count (llama.cpp scores a group
    by the sum of its best two, V2 files included), leading_dense_block_count dense layers first,
    expert_shared_count shared experts of expert_feed_forward_length each.
  * nextn_predict_layers: the last blocks are multi-token-prediction layers (GLM files keep
    them); they are skipped at open, with a line that says so.
  * glm4moe and minimax-m2 keep Hugging Face's rotate-half layout (llama.cpp's NEOX rope): nothing
    is permuted; partial rotary from rope.dimension_count. MiniMax-M2's q/k norms span the whole
    projection; GLM's are per head, present only when the model uses them.
  * refused: deepseek2 files with an attention temperature scale (Mistral Large 3).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from specpipe.config import MLAConfig, MoEConfig, YarnRope, yarn_mscale

# llama.cpp's architecture -> ModelConfig.arch (deepseek2 files with softmax routing are V2's).
GGUF_ARCHS = {"deepseek2": "deepseek_v3", "glm4moe": "glm4_moe", "minimax-m2": "minimax_m2"}
LAYER_PARTS = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # older deepseek2 files: not split
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
KV_B = "self_attn.kv_b_proj.weight"
KV_B_HALVES = ("attn_k_b", "attn_v_b")  # joined, in this order, into a layer's KV_B
_GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE


def canonical_name(layer: int, part: str, kind: str) -> Optional[str]:
    """The canonical name of blk.{layer}.{part}.{kind} where it is one of these families' own
    parts (not Llama's), else None."""
    if part == "exp_probs_b":
        return f"layers.{layer}.mlp.gate.e_score_correction_bias"
    name = LAYER_PARTS.get(part)
    return None if name is None else f"layers.{layer}.{name}.{kind}"


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """kv_b_proj (H * (nope + v), R) from attn_k_b (H, R, nope) and attn_v_b (H, v, R)."""
    h, rank, _ = k_b.shape
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, rank)


def kv_b_shape(k_b: tuple[int, ...], v_b: tuple[int, ...]) -> tuple[int, int]:
    """join_kv_b's shape from the two halves' (torch-order) shapes."""
    if len(k_b) != 3 or len(v_b) != 3 or k_b[0] != v_b[0] or k_b[1] != v_b[2]:
        raise ValueError(f"attn_k_b {k_b} and attn_v_b {v_b} are not the two halves of one kv_b_proj")
    return k_b[0] * (k_b[2] + v_b[1]), k_b[1]


def main_layers(meta: dict[str, Any], gguf_arch: str) -> Optional[int]:
    """The decoder's layer count when the file also holds multi-token-prediction layers (the
    last nextn_predict_layers blocks), else None."""
    nextn = meta.get(f"{gguf_arch}.nextn_predict_layers")
    blocks = meta.get(f"{gguf_arch}.block_count")
    if gguf_arch not in GGUF_ARCHS or type(nextn) is not int or type(blocks) is not int or not 0 < nextn < blocks:
        return None
    return blocks - nextn


def options(md: Any, gguf_arch: str, names: set[str], num_layers: int, routed_layers: set[int]) -> dict[str, Any]:
    """ModelConfig fields for these families (overriding the generic reading of gguf.py).
    `md`: gguf.py's typed metadata; `names`: the canonical tensor names."""
    key = f"{gguf_arch}."
    out: dict[str, Any] = {}
    nextn = md.get_int(key + "nextn_predict_layers", 0)
    if nextn > 0:
        out["num_layers"] = num_layers = md.get_int(key + "block_count") - nextn
    gating = md.get_int(key + "expert_gating_func", None)
    if gating is None:  # llama.cpp's defaults: V2 / V2.5 files say nothing, nor do GLM-4.7-Flash's
        vocab = md.get_int(key + "vocab_size", None) or md.array_len("tokenizer.ggml.tokens")
        glm_lite = num_layers in (47, 48) and vocab == 154880
        gating = 1 if gguf_arch == "deepseek2" and not glm_lite else 2
    scoring = _GATING.get(gating)
    if scoring is None:
        raise ValueError(f"unknown expert gating function {gating} (llama.cpp: 1 softmax, 2 sigmoid)")
    if routed_layers:
        width = md.get_int(key + "expert_feed_forward_length")
        minimax = gguf_arch == "minimax-m2"
        out["moe"] = MoEConfig(
            md.get_int(key + "expert_count"), md.get_int(key + "expert_used_count"), width,
            norm_topk_prob=minimax or bool(md.get_raw(key + "expert_weights_norm", False)),
            layers=tuple(sorted(routed_layers)), scoring=scoring,
            correction_bias=any(n.endswith(".mlp.gate.e_score_correction_bias") for n in names),
            num_groups=md.get_int(key + "expert_group_count", 1),
            top_groups=md.get_int(key + "expert_group_used_count", 1),
            scaling_factor=md.get_float(key + "expert_weights_scale", 1.0) or 1.0,
            shared_intermediate_size=0 if minimax else width * md.get_int(key + "expert_shared_count", 0))
    if gguf_arch == "deepseek2":
        if md.get_float(key + "attention.temperature_scale", 0.0):
            raise ValueError("deepseek2 with attention.temperature_scale (Mistral Large 3's attention temperature "
                             "tuning) is not supported")
        out.update(_latent_attention(md, key), arch="deepseek_v3" if scoring == "sigmoid" else "deepseek_v2")
    elif gguf_arch == "glm4moe":
        out["qk_norm"] = "layers.0.self_attn.q_norm.weight" in names
    elif gguf_arch == "minimax-m2":
        out.update(qk_norm=True, qk_norm_whole=True)
    return out


def _latent_attention(md: Any, key: str) -> dict[str, Any]:
    rot = md.get_int(key + "rope.dimension_count")
    qk = md.get_int(key + "attention.key_length_mla", None) or md.get_int(key + "attention.key_length")
    v = md.get_int(key + "attention.value_length_mla", None) or md.get_int(key + "attention.value_length")
    scale = qk ** -0.5
    rope = None
    kind = md.get_str(key + "rope.scaling.type", None)
    if kind == "yarn":
        factor = md.get_float(key + "rope.scaling.factor")
        attn = md.get_float(key + "rope.scaling.attn_factor", 1.0)
        rope = YarnRope(factor, md.get_int(key + "rope.scaling.original_context_length"),
                        md.get_float(key + "rope.scaling.yarn_beta_fast", 32.0),
                        md.get_float(key + "rope.scaling.yarn_beta_slow", 1.0), attn)
        m = attn * yarn_mscale(factor, md.get_float(key + "rope.scaling.yarn_log_multiplier", 0.0) / 0.1)
        scale *= m * m
    elif kind not in (None, "none"):
        raise ValueError(f"deepseek2 with RoPE scaling {kind!r} is not supported (yarn or none)")
    mla = MLAConfig(q_lora_rank=md.get_int(key + "attention.q_lora_rank", None),
                    kv_lora_rank=md.get_int(key + "attention.kv_lora_rank"), qk_nope_head_dim=qk - rot,
                    qk_rope_head_dim=rot, v_head_dim=v, rope_interleave=True, softmax_scale=scale)
    return dict(mla=mla, head_dim=rot, rope_dim=None, num_kv_heads=1, rope_scaling=rope)
