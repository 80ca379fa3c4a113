"""llama.cpp's names for the families: GGUF architecture -> ModelConfig options, tensor -> canonical.

What llama.cpp's converter does per family that the loader undoes or reads here:
  * names: blk.N.attn_q_norm / attn_k_norm (Qwen3, Gemma 3), post_attention_norm, ffn_norm (the
    MLP's input norm: Gemma 3's pre_feedforward_layernorm), post_ffw_norm, ffn_gate_inp (router),
    ffn_{gate,up,down}_exps (every expert of a layer stacked in one 3-D tensor; older Mixtral
    files have blk.N.ffn_gate.E.weight per expert), attn_qkv and Phi-3's ffn_up (gate and up
    fused). Stacked and fused tensors are exposed as row ranges under canonical names.
  * Mixtral is written as architecture `llama` (with expert_count and expert tensors): it is
    detected by its experts, and its Q/K rows are permuted like any llama file's.
  * Gemma 3: every norm weight is stored as 1 + w (the converter folds Gemma's (1 + weight)
    into the file), so a GGUF Gemma uses plain RMSNorm. llama.cpp fixes what the metadata does
    not say: one global layer in 6 (unless sliding_window_pattern says otherwise), sliding
    layers' RoPE base 10000 (unless rope.freq_base_swa), query scale 1/sqrt(key_length)
    (1/sqrt(hidden / heads) for the 27B model, 62 layers); we do the same.
  * Phi-3: LongRoPE factors as the tensors rope_factors_short / rope_factors_long, with
    rope.scaling.attn_factor and rope.scaling.original_context_length; partial rotary from
    rope.dimension_count.
  * deepseek2, glm4moe, minimax-m2 (latent attention, shared experts, routers): gguf_sparse.py.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional

import gguf

from specpipe.config import SUPPORTED_ARCHITECTURES, LongRope, MoEConfig
from specpipe.loader import gguf_gpt_oss
from specpipe.loader import gguf_sparse as sparse

# GGUF general.architecture -> ModelConfig.arch (llama becomes mixtral when it has experts).
GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
              "gemma3": "gemma3", "phi3": "phi3", "gpt-oss": "gpt_oss", **sparse.GGUF_ARCHS}
MISSING_PIECE = {
    "qwen2moe": "shared experts (with their gate)",
    "gemma2": "Gemma 2's soft-capping and norms (only Gemma 3 is supported)",
    "gemma3n": "Gemma 3n's per-layer embeddings and AltUp",
    "llama4": "chunked attention, interleaved NoPE layers and shared experts",
    "phimoe": "Phi-MoE's sparse-mixer routing",
}

_TOP_LEVEL = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: fused, split by checkpoint.fused_parts
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",  # Gemma 3: the attention output's norm
    "ffn_norm": "post_attention_layernorm",  # the MLP's input norm (Llama's name for it)
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "attn_sinks": "self_attn.sinks",  # gpt-oss: (heads,), canonical name without .weight
}
# Where a family names a part differently from the table above.
_FAMILY_PARTS = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # gate and up fused, gate first
}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)(?:\.(\d+))?\.(weight|bias)")


def canonical_parts(gguf_name: str, shape: tuple[int, ...], arch: str) -> list[tuple[str, Optional[tuple[int, int]]]]:
    """The canonical tensors a GGUF tensor holds: [(name, row range or None for all)], where
    rows count the tensor as 2-D (all dims but the last; `shape` is the torch order). Stacked
    experts give one entry per expert; Phi-3's fused tensors are left whole here (their split
    needs the model's sizes: checkpoint.fused_parts). [] for tensors SpecPipe does not use."""
    if gguf_name in _TOP_LEVEL:
        return [(_TOP_LEVEL[gguf_name], None)]
    m = _LAYER_NAME.fullmatch(gguf_name)
    if m is None:
        return []
    layer, part, expert, kind = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    prefix = f"layers.{layer}."
    if part in _EXPERTS:  # (E, rows, cols): expert e is rows [e * rows, (e + 1) * rows)
        n, rows = shape[0], (1 if kind == "bias" else shape[1])  # gpt-oss's biases (E, out): a row each
        return [(f"{prefix}mlp.experts.{e}.{_EXPERTS[part]}.{kind}", (e * rows, (e + 1) * rows)) for e in range(n)]
    if expert is not None and part in ("ffn_gate", "ffn_up", "ffn_down"):  # older Mixtral files
        return [(f"{prefix}mlp.experts.{expert}.{part[4:]}_proj.{kind}", None)]
    if arch in sparse.GGUF_ARCHS and expert is None:  # DeepSeek's latent attention, shared experts, ...
        own = sparse.canonical_name(layer, part, kind)
        if own is not None:
            return [(own, None)]
    name = _FAMILY_PARTS.get(arch, {}).get(part) or _LAYER_PARTS.get(part)
    if name is None or expert is not None:
        return []
    return [(f"{prefix}{name}" if part == "attn_sinks" else f"{prefix}{name}.{kind}", None)]


def model_arch(gguf_arch: str, has_experts: bool, file_name: str, error: Callable[[str], Exception]) -> str:
    if gguf_arch not in GGUF_ARCHS:
        missing = MISSING_PIECE.get(gguf_arch)
        why = f" (it needs {missing}, which SpecPipe does not implement)" if missing else ""
        raise error(f"{file_name}: unsupported architecture {gguf_arch!r}{why}; SpecPipe runs "
                    f"{', '.join(SUPPORTED_ARCHITECTURES)} (llama.cpp: {', '.join(GGUF_ARCHS)})")
    arch = GGUF_ARCHS[gguf_arch]
    return "mixtral" if arch in ("llama", "mistral") and has_experts else arch


def family_options(md: Any, gguf_arch: str, arch: str, hidden: int, heads: int, head_dim: int, num_layers: int,
                   layers_with_router: set[int], names: set[str]) -> dict[str, Any]:
    """ModelConfig options beyond the Llama defaults. `md`: loader/gguf.py's typed metadata;
    `names`: the canonical tensor names."""
    if gguf_arch in sparse.GGUF_ARCHS:
        return sparse.options(md, gguf_arch, names, num_layers, layers_with_router)
    if gguf_arch == "gpt-oss":
        return gguf_gpt_oss.options(md, gguf_arch, num_layers, names)
    key = f"{gguf_arch}."
    out: dict[str, Any] = {}
    if arch in ("qwen3", "qwen3_moe", "gemma3"):
        out["qk_norm"] = True
    if arch in ("mixtral", "qwen3_moe"):
        if not layers_with_router:
            raise ValueError("a mixture-of-experts model without any ffn_gate_inp (router) tensor")
        ff = md.get_int(key + "expert_feed_forward_length", None) or md.get_int(key + "feed_forward_length")
        out["moe"] = MoEConfig(md.get_int(key + "expert_count"), md.get_int(key + "expert_used_count"), ff,
                               bool(md.get_raw(key + "expert_weights_norm", True)), tuple(sorted(layers_with_router)))
    window = md.get_int(key + "attention.sliding_window", None)
    if arch == "gemma3":
        pattern = md.get_raw(key + "attention.sliding_window_pattern", 6)
        sliding = ([i for i, s in enumerate(pattern) if s] if isinstance(pattern, list)
                   else [i for i in range(num_layers) if (i + 1) % int(pattern)])
        out.update(sandwich_norms=True, embed_scale=math.sqrt(hidden), hidden_act="gelu_tanh",
                   query_scale=(hidden / heads if num_layers == 62 else head_dim) ** -0.5,
                   rope_local_theta=md.get_float(key + "rope.freq_base_swa", 10_000.0),
                   final_softcap=md.get_float(key + "final_logit_softcapping", None),
                   sliding_window=window, sliding_layers=tuple(sliding) if window else ())
    elif window:  # Mistral-style: every layer slides
        out.update(sliding_window=window, sliding_layers=tuple(range(num_layers)))
    return out


def longrope(md: Any, gguf_arch: str, extras: dict[str, Any], rope_dim: int, context: int) -> Optional[LongRope]:
    """Phi-3's LongRoPE from its factor tensors, or None when the file has none."""
    short, long = extras.get("rope_factors_short.weight"), extras.get("rope_factors_long.weight")
    if short is None or long is None:
        return None
    tables = [tuple(float(x) for x in gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1)) for t in (short, long)]
    if any(len(t) != rope_dim // 2 for t in tables):
        raise ValueError(f"rope factor tables must have rope_dim / 2 = {rope_dim // 2} entries")
    original = md.get_int(f"{gguf_arch}.rope.scaling.original_context_length", context)
    attention = md.get_float(f"{gguf_arch}.rope.scaling.attn_factor", None)
    if attention is None:
        factor = context / original
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRope(tables[0], tables[1], original, attention, long=context > original)


def has_experts(gguf_names) -> bool:
    """Whether the file holds experts (stacked, or one tensor per expert)."""
    return any(re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)(_exps|\.\d+)\.weight", n) for n in gguf_names)
