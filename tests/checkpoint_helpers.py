"""Checkpoint variants the tests build from the tiny models."""

from __future__ import annotations

import json
import math
import shutil

import torch
from safetensors.torch import load_file, save_file


def bf16_copy(src, dst):
    """A copy of the Hugging Face directory `src` at `dst` with its weights stored as bfloat16."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        save_file({n: t.to(torch.bfloat16) for n, t in load_file(f).items()}, f, metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    return dst


# --- GGUF twins: a tiny Hugging Face model written the way llama.cpp's convert_hf_to_gguf.py does --

GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3", "phi3": "phi3"}


def _gguf_name(hf_name: str, arch: str) -> str | list[str] | None:
    """llama.cpp's name for a Hugging Face tensor, from gguf's own tables (independent of the
    loader under test); experts -> the stacked name; None for tensors the converter drops."""
    import re

    import gguf

    T = gguf.MODEL_TENSOR
    name = hf_name.removeprefix("model.")
    top = {"embed_tokens.weight": T.TOKEN_EMBD, "norm.weight": T.OUTPUT_NORM, "lm_head.weight": T.OUTPUT}
    if name in top:
        return gguf.TENSOR_NAMES[top[name]] + ".weight"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name)
    bid, part, kind = int(m.group(1)), m.group(2), m.group(3)
    m_exp = re.fullmatch(r"(?:mlp|block_sparse_moe)\.experts\.\d+\.(\w+)", part)
    if m_exp:
        part = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(m_exp.group(1), m_exp.group(1))
        tensor = {"gate_proj": T.FFN_GATE_EXP, "up_proj": T.FFN_UP_EXP, "down_proj": T.FFN_DOWN_EXP}[part]
        return gguf.TENSOR_NAMES[tensor].format(bid=bid) + "." + kind
    gemma = arch == "gemma3"
    parts = {
        "input_layernorm": T.ATTN_NORM, "self_attn.q_proj": T.ATTN_Q, "self_attn.k_proj": T.ATTN_K,
        "self_attn.v_proj": T.ATTN_V, "self_attn.o_proj": T.ATTN_OUT, "self_attn.qkv_proj": T.ATTN_QKV,
        "self_attn.q_norm": T.ATTN_Q_NORM, "self_attn.k_norm": T.ATTN_K_NORM,
        "post_attention_layernorm": T.ATTN_POST_NORM if gemma else T.FFN_NORM,
        "pre_feedforward_layernorm": T.FFN_NORM, "post_feedforward_layernorm": T.FFN_POST_NORM,
        "mlp.gate_proj": T.FFN_GATE, "mlp.up_proj": T.FFN_UP, "mlp.down_proj": T.FFN_DOWN,
        "mlp.gate_up_proj": T.FFN_UP, "mlp.gate": T.FFN_GATE_INP, "block_sparse_moe.gate": T.FFN_GATE_INP,
    }
    return gguf.TENSOR_NAMES[parts[part]].format(bid=bid) + "." + kind


def _permute(w, n_head: int):
    """LlamaModel.permute of convert_hf_to_gguf.py (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_twin(hf_dir, path, qtype=None):
    """Write the tiny Hugging Face model at `hf_dir` as a GGUF file at `path`, with llama.cpp's
    names, metadata and conventions: Q/K rows permuted for the llama architecture (Mixtral
    included), Gemma's norm weights stored as 1 + w, experts stacked per layer, Phi-3's LongRoPE
    factors as tensors. `qtype`: a GGML type for 2-D weights whose rows fit its blocks (else F32)."""
    from collections import defaultdict

    import gguf
    import numpy as np

    cfg = json.loads((hf_dir / "config.json").read_text())
    model_type = cfg["model_type"]
    arch = GGUF_ARCH[model_type]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(cfg["num_hidden_layers"])
    wr.add_context_length(cfg["max_position_embeddings"])
    wr.add_embedding_length(cfg["hidden_size"])
    wr.add_feed_forward_length(cfg["intermediate_size"])
    wr.add_head_count(heads)
    wr.add_head_count_kv(kv_heads)
    wr.add_key_length(head_dim)
    wr.add_value_length(head_dim)
    wr.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    wr.add_vocab_size(cfg["vocab_size"])
    wr.add_eos_token_id(cfg["eos_token_id"])
    rope_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    wr.add_rope_dimension_count(rope_dim)
    wr.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if "num_experts_per_tok" in cfg:
        wr.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        wr.add_expert_used_count(cfg["num_experts_per_tok"])
        if model_type == "qwen3_moe":
            wr.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if model_type == "gemma3_text":
        wr.add_sliding_window(cfg["sliding_window"])
        # llama.cpp fixes 1 global layer in 6; the tiny model alternates, said by the pattern key.
        wr.add_array(f"{arch}.attention.sliding_window_pattern",
                     [t == "sliding_attention" for t in cfg["layer_types"]])
        if cfg.get("final_logit_softcapping"):
            wr.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if rope.get("rope_type") == "longrope":
        wr.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        factor = cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]
        wr.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(rope["original_max_position_embeddings"])))
        wr.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        wr.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))

    tensors, experts = {}, defaultdict(dict)
    for f in sorted(hf_dir.glob("*.safetensors")):
        for hf_name, t in load_file(f).items():
            w = t.float().numpy()
            name = _gguf_name(hf_name, arch)
            if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
                w = _permute(w, heads if ".q_proj." in hf_name else kv_heads)
            if arch == "gemma3" and hf_name.endswith("norm.weight"):
                w = w + 1.0
            if "_exps." in name:
                experts[name][int(hf_name.split("experts.")[1].split(".")[0])] = w
            else:
                tensors[name] = w
    for name, per_expert in experts.items():
        tensors[name] = np.stack([per_expert[e] for e in sorted(per_expert)])  # (E, rows, cols)
    for name, w in tensors.items():
        block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 0
        if qtype is None or w.ndim == 1 or w.shape[-1] % block:
            wr.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        else:
            wr.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path
