"""A Hugging Face config.json -> ModelConfig, for every family SpecPipe runs.

Each family is a few lines saying which of ModelConfig's named options it switches on; the fields
they share (sizes, RoPE base, sliding layers, mixture of experts) are read once, below. Both the
older config.json layout (top-level rope_theta / rope_scaling) and transformers 5's
(`rope_parameters`, per layer type for Gemma 3) are read.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from specpipe.config import (SUPPORTED_ARCHITECTURES, ConfigError, LinearRope, LongRope, MoEConfig, ModelConfig,
                             RopeScaling, YarnRope, yarn_mscale)
from specpipe.loader import hf_deepseek

# model_type -> ModelConfig.arch. `gemma3` (the multimodal checkpoints, 4B-27B) holds the text
# model's settings in `text_config`; SpecPipe runs that text model.
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "qwen3": "qwen3",
               "qwen3_moe": "qwen3_moe", "mixtral": "mixtral", "gemma3_text": "gemma3", "gemma3": "gemma3",
               "phi3": "phi3", "glm4_moe": "glm4_moe", "minimax_m2": "minimax_m2", "deepseek_v2": "deepseek_v2",
               "deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss"}

# Families people ask for that need a piece SpecPipe does not have: the error names it.
MISSING_PIECE = {
    "deepseek_v32": "DeepSeek-V3.2's sparse attention (the lightning indexer that picks the keys each token reads)",
    "qwen2_moe": "shared experts (with their gate)",
    "gemma2": "Gemma 2's attention and final-logit soft-capping defaults and its norms (only Gemma 3 is supported)",
    "phi3small": "block-sparse attention",
    "phimoe": "Phi-MoE's sparse-mixer routing",
    "llama4": "chunked attention, interleaved NoPE layers and shared experts",
}

# Gemma3TextConfig's defaults: the text_config of a `gemma3` checkpoint lists only the values
# that differ from these (the 4B config.json has no head count, head dim or vocabulary size).
GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
    sliding_window=4096, sliding_window_pattern=6, final_logit_softcapping=None, attn_logit_softcapping=None,
    tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
)


def model_config_from_hf(cfg: dict) -> ModelConfig:
    if not isinstance(cfg, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type", "")
    arch = MODEL_TYPES.get(model_type)
    if arch is None:
        missing = MISSING_PIECE.get(model_type)
        why = f" (it needs {missing}, which SpecPipe does not implement)" if missing else ""
        raise ConfigError(f"unsupported model_type {model_type!r} in config.json{why}; SpecPipe runs "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if model_type == "gemma3":
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("a gemma3 config.json without text_config")
        # Token ids and tying may sit at the top level of a multimodal config.
        top = {k: cfg[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings") if k in cfg}
        cfg = {**GEMMA3_TEXT_DEFAULTS, **top, **text}
    elif model_type == "gemma3_text":
        cfg = {**GEMMA3_TEXT_DEFAULTS, **cfg}
    quant = cfg.get("quantization_config")
    if quant and arch == "gpt_oss" and isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
        quant = None  # OpenAI's MXFP4 experts: kept packed at load (loader/hf_gpt_oss.py)
    if quant:  # e.g. DeepSeek V3's block-scaled FP8: the stored numbers are not the weights
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ConfigError(f"config.json names a quantization_config ({method}); SpecPipe reads float safetensors "
                          "(float32, bfloat16, float16) only: use a bfloat16 conversion of the model or a GGUF file")
    try:
        if arch in hf_deepseek.DEEPSEEK:
            cfg = hf_deepseek.text_view(cfg)
        return _build(arch, cfg)
    except KeyError as e:
        raise ConfigError(f"config.json is missing the field {e.args[0]!r}") from None
    except ConfigError:
        raise
    except (ValueError, TypeError, AttributeError, ZeroDivisionError, OverflowError) as e:
        # A hostile or broken file ("x" where a size belongs, a list, a zero head count).
        raise ConfigError(f"config.json has a value of the wrong type or range ({e})") from None


def prediction_layers(cfg: dict) -> int:
    """How many multi-token-prediction layers the checkpoint appends after its decoder, stored as
    layers.{num_hidden_layers + i}.* (DeepSeek V3 and GLM-4.5: num_nextn_predict_layers;
    MiniMax-M2: num_mtp_modules). They draft tokens for their authors' own speculation; SpecPipe
    decodes with the main model only and never reads them."""
    if not isinstance(cfg, dict):
        return 0
    n = cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_modules")) or 0
    if not isinstance(n, int) or n < 0:
        raise ConfigError(f"config.json: the number of multi-token-prediction layers must be an integer >= 0, got {n!r}")
    return n


def _rope_params(cfg: dict, layer_type: str) -> dict:
    """The RoPE parameters of one layer type, whichever layout the file uses."""
    params = cfg.get("rope_parameters") or {}
    if layer_type in params:  # transformers 5, per layer type (Gemma 3)
        return params[layer_type]
    if "rope_type" in params or "rope_theta" in params or "type" in params:
        return params
    legacy = dict(cfg.get("rope_scaling") or {})
    if "rope_theta" in cfg:
        legacy["rope_theta"] = cfg["rope_theta"]
    return legacy


def _rope_scaling(rs: dict, cfg: dict, rope_dim: int):
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(factor=float(rs["factor"]), low_freq_factor=float(rs["low_freq_factor"]),
                           high_freq_factor=float(rs["high_freq_factor"]),
                           original_max_position=int(rs["original_max_position_embeddings"]))
    if kind == "linear":
        return LinearRope(float(rs["factor"]))
    if kind in ("longrope", "su"):
        original = int(rs.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
        max_pos = int(cfg.get("max_position_embeddings", original))
        short, long = tuple(map(float, rs["short_factor"])), tuple(map(float, rs["long_factor"]))
        if len(short) != rope_dim // 2 or len(long) != rope_dim // 2:
            raise ConfigError(f"longrope factors must have rope_dim / 2 = {rope_dim // 2} entries")
        factor = rs.get("factor") or max_pos / original  # as transformers: the context's growth
        attention = rs.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return LongRope(short, long, original, float(attention), long=max_pos > original)
    if kind == "yarn":
        original = int(rs.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
        factor = float(rs.get("factor") or int(cfg["max_position_embeddings"]) / original)
        attention = rs.get("attention_factor")
        if attention is None:  # as transformers' _compute_yarn_parameters
            mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
            attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                         else yarn_mscale(factor))
        return YarnRope(factor, original, float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1),
                        float(attention), bool(rs.get("truncate", True)))
    raise ConfigError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear, longrope, yarn)")


def _sliding(arch: str, cfg: dict, num_layers: int) -> tuple[Optional[int], tuple[int, ...]]:
    window = cfg.get("sliding_window")
    # transformers' glm4_moe and minimax_m2 attend to everything, whatever window a file names.
    if not window or cfg.get("use_sliding_window", True) is False or arch in ("glm4_moe", "minimax_m2"):
        return None, ()
    if cfg.get("layer_types"):
        layers = [i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention"]
    elif arch == "gemma3":  # every `pattern`-th layer is global, the others slide
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layers = [i for i in range(num_layers) if (i + 1) % pattern]
    elif "max_window_layers" in cfg:  # Qwen2 / Qwen3: the layers from max_window_layers on
        layers = list(range(int(cfg["max_window_layers"]), num_layers))
    else:  # Mistral, Mixtral, Phi-3: every layer
        layers = list(range(num_layers))
    return (int(window), tuple(layers)) if layers else (None, ())


def _moe(arch: str, cfg: dict, num_layers: int) -> Optional[MoEConfig]:
    if arch in hf_deepseek.DEEPSEEK:
        return hf_deepseek.moe_config(arch, cfg, num_layers)
    if arch == "mixtral":
        return MoEConfig(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]),
                         int(cfg["intermediate_size"]), True, tuple(range(num_layers)))
    if arch == "qwen3_moe":
        experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(num_layers) if i not in dense and step > 0 and (i + 1) % step == 0)
        return MoEConfig(experts, int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                         bool(cfg.get("norm_topk_prob", False)), layers)
    if arch == "glm4_moe":  # DeepSeek V3's router: dense layers first, then sigmoid routing over groups
        dense = int(cfg.get("first_k_dense_replace", 1))
        width = int(cfg["moe_intermediate_size"])
        return MoEConfig(int(cfg["n_routed_experts"]), int(cfg["num_experts_per_tok"]), width,
                         bool(cfg.get("norm_topk_prob", True)), tuple(range(dense, num_layers)), scoring="sigmoid",
                         correction_bias=True, num_groups=int(cfg.get("n_group", 1)),
                         top_groups=int(cfg.get("topk_group", 1)),
                         scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                         shared_intermediate_size=width * int(cfg.get("n_shared_experts", 1)))
    if arch == "gpt_oss":  # every layer sparse: top-k logits (with the router's bias) softmaxed, biased experts
        return MoEConfig(int(cfg["num_local_experts"]), int(cfg.get("num_experts_per_tok", 4)),
                         int(cfg["intermediate_size"]), True, tuple(range(num_layers)), scoring="topk_softmax",
                         router_bias=True, expert_bias=True, swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                         swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))
    if arch == "minimax_m2":  # every layer sparse, experts of intermediate_size, always renormalised
        return MoEConfig(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]), int(cfg["intermediate_size"]),
                         True, tuple(range(num_layers)), scoring="sigmoid", correction_bias=True)
    return None


def _build(arch: str, cfg: dict) -> ModelConfig:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    num_layers = int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    global_rope = _rope_params(cfg, "full_attention")
    partial = global_rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is None and arch == "minimax_m2" and cfg.get("rotary_dim"):  # its own files name the dims
        partial = int(cfg["rotary_dim"]) / head_dim
    if partial is None:  # transformers' Glm4MoeConfig rotates half a head unless told otherwise
        partial = 0.5 if arch == "glm4_moe" else 1.0
    rope_dim = int(head_dim * float(partial))
    window, sliding_layers = _sliding(arch, cfg, num_layers)
    eos = cfg.get("eos_token_id")
    gemma = arch == "gemma3"
    options: dict[str, Any] = {}
    if arch in ("qwen3", "qwen3_moe"):
        options.update(qk_norm=True)
    if arch in hf_deepseek.DEEPSEEK:
        options.update(mla=hf_deepseek.mla_config(arch, cfg, global_rope))
    if arch == "glm4_moe":  # GLM-4.5 / 4.6 leave it off, other GLM MoE checkpoints turn it on
        options.update(qk_norm=bool(cfg.get("use_qk_norm", False)))
    if arch == "minimax_m2":  # always on in transformers (the file's use_qk_norm / qk_norm_type are not read)
        options.update(qk_norm=True, qk_norm_whole=True)
    if arch == "gpt_oss":  # biases on q/k/v and o (attention_bias), a sink per head
        bias = bool(cfg.get("attention_bias", True))
        options.update(attention_sinks=True, o_proj_bias=bias, attention_bias=bias)
    if gemma:
        local = _rope_params(cfg, "sliding_attention")
        options.update(
            qk_norm=True, norm_plus_one=True, sandwich_norms=True, embed_scale=math.sqrt(hidden),
            query_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5,
            rope_local_theta=float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))),
            # Gemma 3 does not soft-cap attention scores: transformers and llama.cpp both ignore
            # the attn_logit_softcapping its configs inherit from Gemma 2.
            final_softcap=cfg.get("final_logit_softcapping"))
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    if act not in acts:
        raise ConfigError(f"unsupported activation {act!r} (supported: silu, gelu_pytorch_tanh)")
    return ModelConfig(
        arch=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(global_rope.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(global_rope, cfg, rope_dim),
        max_position=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=options.pop("attention_bias", arch == "qwen2" or bool(cfg.get("attention_bias", False))),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
        hidden_act=acts[act],
        rope_dim=rope_dim if rope_dim != head_dim else None,
        sliding_window=window,
        sliding_layers=sliding_layers,
        moe=_moe(arch, cfg, num_layers),
        **options,
    )
