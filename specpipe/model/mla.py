"""Multi-head latent attention (MLA): DeepSeek V2 / V3 (and Kimi K2, a deepseek_v3), as
transformers' `deepseek_v2` / `deepseek_v3` define it, run in the absorbed form over a latent cache.

What a token stores, per layer, is what kv_a_proj_with_mqa makes of it: a latent c (kv_lora_rank
values, after kv_a_layernorm) and a RoPE key k_r (qk_rope_head_dim values) that every head shares.
transformers expands c through kv_b_proj into per-head keys and values for every cached token at
every step; here the cache keeps [c, k_r] (KVCache latent=True) and the expansion is moved onto
the queries and the output instead, so a step never expands the cache:

    kv_b_proj = [W_uk; W_uv] per head h:  k_h = W_uk[h] c   (nope dims),  v_h = W_uv[h] c
    score_h   = q_nope_h . (W_uk[h] c) + q_rope_h . k_r  =  [W_uk[h]^T q_nope_h, q_rope_h] . [c, k_r]
    out_h     = sum_j p_j W_uv[h] c_j  =  W_uv[h] (sum_j p_j c_j)

So attention is multi-query attention with one "head" of kv_lora_rank + qk_rope_head_dim dims that
all query heads read (the same model/attention.attend as every family, with its tree masks and
segments), whose values are the same cached rows; the output keeps their first kv_lora_rank dims
(the latent part) and W_uv lifts them to v_head_dim a head. The scores are transformers' up to the
order of the additions (float tolerance, tests/model/test_deepseek.py).

RoPE: DeepSeek's weights rotate interleaved pairs (x0, x1), (x2, x3), ...; gathering the even dims
before the odd ones turns that into the rotate-half rotation model/rope.py applies (the same
formula transformers' interleaved path computes; V2's complex form equals it up to rounding and
lays the dims out in another order, which the dot products do not see). YaRN scales cos/sin by its
attention factor (rope.py) and the softmax by mscale(factor, mscale_all_dim)^2 (MLAConfig.softmax_scale).

Batch invariance: the projections are FloatLinear / QuantLinear; the per-head absorptions are
batched matmuls over fixed tiles of ROW_TILE rows (head_matmul), or, where a GGUF file stores
llama.cpp's attn_k_b / attn_v_b quantized, one QuantLinear a head over those blocks (per_head), so
a row's result never depends on the rows sharing its call; attention is model/attention.attend. The native attention takes at most
native.MAX_GROUP query heads per KV head, so heads go to it in chunks of that many (a head's result
does not depend on the other heads): DeepSeek V3's 128 heads run as two calls.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from specpipe.config import ModelConfig
from specpipe.kernels import native
from specpipe.kernels.qlinear import FloatLinear, QuantLinear
from specpipe.model.attention import ROW_TILE, AttentionMetadata, attend
from specpipe.model.kv_cache import KVCache
from specpipe.model.norm import RMSNorm
from specpipe.model.rope import Rope

# transformers builds q_a_layernorm and kv_a_layernorm with their default eps, not rms_norm_eps
LORA_NORM_EPS = 1e-6


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (T, H, K) times each head's w (H, K, N) -> (T, H, N), in calls of exactly ROW_TILE rows on
    a CPU (one padded call elsewhere), as kernels/torch_kernels.invariant_linear does: the shape of
    every call is fixed by the weights, so a row's result is the same whatever T."""
    t = x.shape[0]
    pad = -t % ROW_TILE
    if pad:
        x = torch.cat((x, x.new_zeros(pad, *x.shape[1:])))
    w = w.to(x.dtype)
    if not x.is_cpu:
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)[:t]
    out = x.new_empty(x.shape[0], w.shape[0], w.shape[2])  # (T', H, N)
    for i in range(0, x.shape[0], ROW_TILE):
        out[i:i + ROW_TILE] = torch.bmm(x[i:i + ROW_TILE].transpose(0, 1), w).transpose(0, 1)
    return out[:t]


def per_head(linears: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """x (T, H, K) through head h's own linear (K -> N) for each h -> (T, H, N)."""
    return torch.stack([lin(x[:, i].contiguous()) for i, lin in enumerate(linears)], dim=1)


def attend_latent(q: torch.Tensor, latent: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """q (T, Hq, L) over the cached rows latent (C, 1, L), which serve as keys and values -> (T, Hq, L).
    Query heads go to the native kernel at most native.MAX_GROUP at a time."""
    step = native.MAX_GROUP if q.dtype == torch.float32 and q.is_cpu and native.available() else q.shape[1]
    if q.shape[1] <= step:
        return attend(q, latent, latent, mask, scale)
    return torch.cat([attend(q[:, h:h + step], latent, latent, mask, scale) for h in range(0, q.shape[1], step)], dim=1)


class LatentAttention(nn.Module):
    """The attention of a DeepSeek layer; parameter names are the checkpoint's (self_attn.*)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None
        self.h, self.nope, self.rope_dim, self.vd = cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.rank, self.scale = m.kv_lora_rank, m.softmax_scale
        hidden, qk, bias = cfg.hidden_size, m.qk_nope_head_dim + m.qk_rope_head_dim, cfg.attention_bias
        self.lora = m.q_lora_rank is not None
        if self.lora:
            self.q_a_proj = FloatLinear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = FloatLinear(m.q_lora_rank, self.h * qk, bias=False)
        else:
            self.q_proj = FloatLinear(hidden, self.h * qk, bias=False)
        self.kv_a_proj_with_mqa = FloatLinear(hidden, m.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LORA_NORM_EPS)
        # Read as two per-head matrices (absorbed into queries and output), never called as a layer.
        self.kv_b_proj = FloatLinear(m.kv_lora_rank, self.h * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        # Or, where a GGUF file stores llama.cpp's halves quantized, those kept packed (use_packed_halves).
        self.k_b: Optional[nn.ModuleList] = None
        self.v_b: Optional[nn.ModuleList] = None
        self.o_proj = FloatLinear(self.h * m.v_head_dim, hidden, bias=bias)
        self.interleaved = m.rope_interleave

    def use_packed_halves(self, k_b: tuple, v_b: tuple) -> None:
        """kv_b_proj's two halves as llama.cpp's files store them, kept in their GGML blocks instead
        of joined and dequantized to float32 (loader/gguf.py kv_b_halves): k_b = (type, rows
        (H * R, row_bytes), kernel), head h's R rows W_uk[h]^T (R, nope); v_b = (type, rows
        (H * v, row_bytes), kernel), head h's v rows W_uv[h] (v, R). One QuantLinear a head each
        (over a view of the rows), so the absorption is a head's own matrix times its own input, as
        head_matmul computes it from the float kv_b_proj."""
        (kq, kp, kk), (vq, vp, vk) = k_b, v_b
        h, r, nope, vd = self.h, self.rank, self.nope, self.vd
        self.kv_b_proj = None
        self.k_b = nn.ModuleList(QuantLinear(kp[i * r:(i + 1) * r], kq, nope, r, None, kk) for i in range(h))
        self.v_b = nn.ModuleList(QuantLinear(vp[i * vd:(i + 1) * vd], vq, r, vd, None, vk) for i in range(h))

    def _rotary(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        if self.interleaved:  # even dims first, then odd: DeepSeek's pairs as rotate-half's two halves
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return rope.apply(x.contiguous())

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata, kv: KVCache, layer: int) -> torch.Tensor:
        t, h, nope = x.shape[0], self.h, self.nope
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.lora else self.q_proj(x)
        q = q.view(t, h, nope + self.rope_dim)  # (T, H, nope + r)
        ckv = self.kv_a_proj_with_mqa(x)  # (T, R + r)
        latent = self.kv_a_layernorm(ckv[:, :self.rank].contiguous())  # (T, R)
        k_rot = self._rotary(ckv[:, None, self.rank:], rope)  # (T, 1, r)
        kv.write(layer, torch.cat((latent[:, None, :], k_rot), dim=-1), None, meta.write_slots)  # (T, 1, R + r)
        if self.k_b is None:
            w = self.kv_b_proj.weight.view(h, nope + self.vd, self.rank)  # (H, nope + v, R)
            q_latent = head_matmul(q[..., :nope], w[:, :nope])  # (T, H, R): W_uk^T q_nope
        else:
            q_latent = per_head(self.k_b, q[..., :nope])
        q_full = torch.cat((q_latent, self._rotary(q[..., nope:], rope)), dim=-1)  # (T, H, R + r)
        outs = []
        for seg in meta.segments:
            cached, _ = kv.read(layer, seg)  # (C, 1, R + r)
            outs.append(attend_latent(q_full[seg.start:seg.end], cached, seg.mask, self.scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (T, H, R + r)
        if self.v_b is None:
            out = head_matmul(out[..., :self.rank], w[:, nope:].transpose(1, 2))  # (T, H, v): W_uv o
        else:
            out = per_head(self.v_b, out[..., :self.rank])
        return self.o_proj(out.reshape(t, h * self.vd))
