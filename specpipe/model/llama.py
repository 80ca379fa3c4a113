"""One readable Llama-family decoder (Llama 2/3, Qwen2, SmolLM2, Mistral), buildable as a slice.

A `LlamaStage` holds layers [start, end) of the model, plus the token embedding when it is the
first stage and the final norm + LM head when it is the last; the whole model is the stage
[0, num_layers) with both ends. Parameter names equal the canonical checkpoint names
(see loader/checkpoint.py), so loading is a checked copy.

Shapes: T = rows computed in this call, H = hidden size, Hq/Hkv = query/KV heads, D = head dim.
The T rows may pack several sequences: everything but attention runs once over all of them, and
attention runs per segment of the metadata (see attention.py).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from specpipe.config import ModelConfig, RopeScaling, StageSpec
from specpipe.kernels.qlinear import FloatLinear
from specpipe.model.attention import AttentionMetadata, attend
from specpipe.model.kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as the reference implementations do, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (D/2,), with Llama 3's frequency-dependent scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s: Optional[RopeScaling] = cfg.rope_scaling
    if s is None:
        return inv.float()
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = torch.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)
    return scaled.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, D); cos/sin: (T, 1, D). Hugging Face's rotate-half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = FloatLinear(cfg.hidden_size, self.hq * self.d, bias=bias)
        self.k_proj = FloatLinear(cfg.hidden_size, self.hkv * self.d, bias=bias)
        self.v_proj = FloatLinear(cfg.hidden_size, self.hkv * self.d, bias=bias)
        self.o_proj = FloatLinear(self.hq * self.d, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache, layer: int) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.q_proj(x).view(t, self.hq, self.d), cos, sin)  # (T, Hq, D)
        k = apply_rope(self.k_proj(x).view(t, self.hkv, self.d), cos, sin)  # (T, Hkv, D)
        v = self.v_proj(x).view(t, self.hkv, self.d)  # (T, Hkv, D)
        kv.write(layer, k, v, meta.write_slots)  # every segment's rows first: a segment may read another's
        outs = []
        for seg in meta.segments:
            k_seg, v_seg = kv.read(layer, seg)  # (C, Hkv, D)
            outs.append(attend(q[seg.start:seg.end], k_seg, v_seg, seg.mask))  # (rows, Hq, D)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.hq * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = FloatLinear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = FloatLinear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = FloatLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, kv, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaStage(nn.Module):
    """Layers [spec.start, spec.end) of the model; embedding if spec.first; norm + head if spec.last."""

    def __init__(self, cfg: ModelConfig, spec: StageSpec, act_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        # Activations and the KV cache are in act_dtype whatever the weights are stored in.
        self.cfg, self.spec, self.act_dtype = cfg, spec, act_dtype
        if spec.first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # Keyed by the global layer index so that names match the checkpoint's.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg) for i in range(spec.start, spec.end)})
        if spec.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = FloatLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if cfg.tie_word_embeddings and spec.first:
                self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def num_layers(self) -> int:
        return self.spec.end - self.spec.start

    def make_kv_cache(self, num_slots: int) -> KVCache:
        """A cache of `num_slots` slots for this stage's layers (the caller groups them in blocks)."""
        return KVCache(self.num_layers, num_slots, self.cfg.num_kv_heads, self.cfg.head_dim, self.act_dtype,
                       self.inv_freq.device)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv: KVCache,
                head_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: token ids (T,) on the first stage, hidden states (T, H) otherwise.

        Returns hidden states (T, H), or on the last stage logits (R, V) for the rows `head_rows`
        (all rows when None): prefill needs only the last row's logits, so the LM head, the
        largest matrix, runs only on the rows whose token is wanted.
        """
        if self.spec.first:
            x = self.embed_tokens(x).to(self.act_dtype)  # (T, H)
        freqs = meta.positions.to(self.inv_freq.dtype)[:, None] * self.inv_freq[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, D)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for i, layer in enumerate(self.layers.values()):
            x = layer(x, cos, sin, meta, kv, i)
        if not self.spec.last:
            return x
        if head_rows is not None:
            x = x.index_select(0, head_rows)
        return self.lm_head(self.norm(x)).float()  # (R, V)
