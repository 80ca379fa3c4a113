"""DeepSeek V2 / V3 config.json (deepseek_v2, deepseek_v3; Kimi K2 is a deepseek_v3) -> the
latent attention and the MoE of ModelConfig, read as transformers' DeepseekV2Config /
DeepseekV3Config and their modeling files use them (loader/hf_config.py calls these).

    num_kv_heads  1: every query head reads the one latent row (model/mla.py)
    head_dim      qk_rope_head_dim: the dims RoPE turns (transformers sets head_dim so too)
    mla           q_lora_rank (None: q_proj), kv_lora_rank, qk_nope/rope_head_dim, v_head_dim,
                  rope_interleave (V2 always: its complex rotation pairs adjacent dims), and the
                  softmax scale qk_head_dim^-0.5 times mscale(factor, mscale_all_dim)^2 under YaRN
    moe           layers from first_k_dense_replace on; V3: sigmoid scores, e_score_correction_bias,
                  groups scored by their best two, norm_topk_prob; V2: softmax, greedy or
                  group_limited_greedy (groups scored by their max), never renormalised (transformers'
                  DeepseekV2 ignores norm_topk_prob; the released V2 configs set it false);
                  both: routed_scaling_factor, n_shared_experts x moe_intermediate_size always on
"""

from __future__ import annotations

from typing import Optional

from specpipe.config import ConfigError, MLAConfig, MoEConfig, yarn_mscale

DEEPSEEK = ("deepseek_v2", "deepseek_v3")


def text_view(cfg: dict) -> dict:
    """The config with the fields the shared reader (hf_config._build) takes as a plain
    decoder's set to what they mean for latent attention."""
    if cfg.get("mlp_bias"):
        raise ConfigError("DeepSeek with mlp_bias (biases on the MLP projections) is not supported")
    if int(cfg.get("moe_layer_freq", 1) or 1) != 1:  # transformers reads no such field: every layer from k on
        raise ConfigError(f"DeepSeek with moe_layer_freq {cfg['moe_layer_freq']} is not supported (only 1)")
    return {**cfg, "head_dim": int(cfg["qk_rope_head_dim"]), "num_key_value_heads": 1}


def mla_config(model_type: str, cfg: dict, rope: dict) -> MLAConfig:
    """`rope`: the RoPE parameters as hf_config._rope_params read them (rope_type, factor, ...)."""
    nope, rot = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    scale = (nope + rot) ** -0.5
    kind = rope.get("rope_type", rope.get("type"))
    if kind not in (None, "default") and rope.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
        m = yarn_mscale(float(rope["factor"]), rope["mscale_all_dim"])
        scale *= m * m
    q_lora: Optional[int] = cfg.get("q_lora_rank")
    return MLAConfig(q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(cfg["kv_lora_rank"]),
                     qk_nope_head_dim=nope, qk_rope_head_dim=rot, v_head_dim=int(cfg["v_head_dim"]),
                     rope_interleave=model_type == "deepseek_v2" or bool(cfg.get("rope_interleave", True)),
                     softmax_scale=scale)


def moe_config(model_type: str, cfg: dict, num_layers: int) -> Optional[MoEConfig]:
    dense = int(cfg.get("first_k_dense_replace") or 0)
    layers = tuple(range(dense, num_layers))
    experts = cfg.get("n_routed_experts")
    if not layers or not experts:
        return None
    width = int(cfg["moe_intermediate_size"])
    shared = width * int(cfg.get("n_shared_experts") or 0)
    common = dict(num_experts=int(experts), top_k=int(cfg["num_experts_per_tok"]), intermediate_size=width,
                  layers=layers, scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                  shared_intermediate_size=shared)
    if model_type == "deepseek_v3":
        return MoEConfig(norm_topk_prob=bool(cfg.get("norm_topk_prob", True)), scoring="sigmoid",
                         correction_bias=True, num_groups=int(cfg.get("n_group") or 1),
                         top_groups=int(cfg.get("topk_group") or 1), **common)
    method = cfg.get("topk_method", "greedy")
    if method == "greedy":
        return MoEConfig(norm_topk_prob=False, **common)
    if method == "group_limited_greedy":
        return MoEConfig(norm_topk_prob=False, num_groups=int(cfg["n_group"]), top_groups=int(cfg["topk_group"]),
                         group_score="max", **common)
    raise ConfigError(f"deepseek_v2 with topk_method {method!r} is not supported (greedy, group_limited_greedy)")
