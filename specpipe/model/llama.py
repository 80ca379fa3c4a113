"""One readable decoder for every family SpecPipe runs, buildable as a slice.

Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3 are this decoder as written; the other families
switch on a few named options of ModelConfig, each used in exactly one place here:

    option            families            where
    qk_norm           Qwen3, Gemma 3,     Attention: RMSNorm over each query and key head
                      GLM-4.5 (optional)
    qk_norm_whole     MiniMax-M2          Attention: that RMSNorm over the whole q / k projection instead
    query_scale       Gemma 3             Attention: scores scaled by query_pre_attn_scalar^-0.5
    rope_dim          Phi-3, GLM-4.5,     Rope.apply: only the first rope_dim dims rotate
                      MiniMax-M2
    rope_scaling      Llama 3, Gemma 3, Phi-3, DeepSeek (model/rope.py: llama3, linear, longrope, yarn)
    sliding_layers    Gemma 3, Mistral    LlamaStage.forward: those layers see the last window only,
                                          with their own RoPE base (rope_local_theta) if set
    norm_plus_one     Gemma               RMSNorm scales by (1 + weight)
    sandwich_norms    Gemma 3             DecoderLayer: sublayer outputs normalised too
    hidden_act        Gemma (GeGLU)       MLP (model/moe.py)
    moe               Mixtral, Qwen3-MoE, DecoderLayer: SparseMoE instead of MLP on its layers
                      DeepSeek            (router: model/routing.py; shared experts)
    mla               DeepSeek V2/V3      DecoderLayer: LatentAttention (model/mla.py), and
                                          make_kv_cache: one latent row a token, not K and V
    embed_scale       Gemma               LlamaStage.forward: embeddings times sqrt(hidden)
    final_softcap     Gemma (if set)      LlamaStage.forward: cap * tanh(logits / cap)
    attention_sinks   gpt-oss             Attention: a logit per head in each softmax (attention.attend)
    o_proj_bias       gpt-oss             Attention: a bias on the output projection

A `LlamaStage` holds layers [start, end) of the model, plus the token embedding when it is the
first stage and the final norm + LM head when it is the last; the whole model is the stage
[0, num_layers) with both ends. Parameter names equal the canonical checkpoint names
(see loader/checkpoint.py), so loading is a checked copy.

Shapes: T = rows computed in this call, H = hidden size, Hq/Hkv = query/KV heads, D = head dim.
The T rows may pack several sequences: everything but attention runs once over all of them, and
attention runs per segment of the metadata (see attention.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from specpipe.config import ModelConfig, StageSpec
from specpipe.kernels.qlinear import FloatLinear, StackedLinear
from specpipe.model import fused
from specpipe.model.attention import AttentionMetadata, attend, within_window
from specpipe.model.kv_cache import KVCache
from specpipe.model.mla import LatentAttention
from specpipe.model.moe import MLP, SparseMoE
from specpipe.model.norm import RMSNorm
from specpipe.model.rope import Rope, local_rope_differs, rope_attention_factor, rope_inv_freq


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = FloatLinear(cfg.hidden_size, self.hq * self.d, bias=bias)
        self.k_proj = FloatLinear(cfg.hidden_size, self.hkv * self.d, bias=bias)
        self.v_proj = FloatLinear(cfg.hidden_size, self.hkv * self.d, bias=bias)
        self.o_proj = FloatLinear(self.hq * self.d, cfg.hidden_size, bias=cfg.o_proj_bias)
        # gpt-oss: a learned logit per query head in every softmax's denominator (attention.attend)
        self.sinks = nn.Parameter(torch.empty(self.hq)) if cfg.attention_sinks else None
        if cfg.qk_norm:
            # per head (Qwen3, Gemma 3, GLM-4.5), or across all heads of the projection (MiniMax-M2)
            q_dim, k_dim = (self.hq * self.d, self.hkv * self.d) if cfg.qk_norm_whole else (self.d, self.d)
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, cfg.norm_plus_one)
            self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, cfg.norm_plus_one)
        self.qk_norm, self.scale = cfg.qk_norm, cfg.query_scale
        self.qk_norm_whole = cfg.qk_norm and cfg.qk_norm_whole
        self.qkv: Optional[StackedLinear] = None  # q/k/v stacked after loading (stack_projections)

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata, kv: KVCache, layer: int) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        if self.qk_norm_whole:  # (T, Hq D) and (T, Hkv D): one RMS over every head of the row
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(t, self.hq, self.d)  # (T, Hq, D)
        k = k.view(t, self.hkv, self.d)  # (T, Hkv, D)
        v = v.view(t, self.hkv, self.d)  # (T, Hkv, D)
        if self.qk_norm and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q), rope.apply(k)
        kv.write(layer, k, v, meta.write_slots)  # every segment's rows first: a segment may read another's
        outs = []
        for seg in meta.segments:
            k_seg, v_seg = kv.read(layer, seg)  # (C, Hkv, D)
            outs.append(attend(q[seg.start:seg.end], k_seg, v_seg, seg.mask, self.scale, self.sinks))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.hq * self.d))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        h, eps, plus_one = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one
        self.input_layernorm = RMSNorm(h, eps, plus_one)
        self.self_attn = LatentAttention(cfg) if cfg.mla is not None else Attention(cfg)
        # Llama: the MLP's input norm. Gemma 3 (sandwich): the attention output's norm.
        self.post_attention_layernorm = RMSNorm(h, eps, plus_one)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, plus_one)
            self.post_feedforward_layernorm = RMSNorm(h, eps, plus_one)
        self.mlp = SparseMoE(cfg) if cfg.is_sparse(index) else MLP(h, cfg.intermediate_size, cfg.hidden_act)
        self.sliding = cfg.is_sliding(index)
        self.native = None  # the layer as one native call (model/fused.py), set after loading

    def forward(self, x, rope, meta, kv, layer):
        if self.native is not None and x.shape[0]:
            return fused.forward(self, x, rope, meta, kv, layer)
        a = self.self_attn(self.input_layernorm(x), rope, meta, kv, layer)
        if not self.sandwich:
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class LlamaStage(nn.Module):
    """Layers [spec.start, spec.end) of the model; embedding if spec.first; norm + head if spec.last."""

    def __init__(self, cfg: ModelConfig, spec: StageSpec, act_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        # Activations and the KV cache are in act_dtype whatever the weights are stored in.
        self.cfg, self.spec, self.act_dtype = cfg, spec, act_dtype
        if spec.first:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        # Keyed by the global layer index so that names match the checkpoint's.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i) for i in range(spec.start, spec.end)})
        self.num_sliding = sum(layer.sliding for layer in self.layers.values())  # sliding-window layers here
        if spec.last:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_plus_one)
            self.lm_head = FloatLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
            if cfg.tie_word_embeddings and spec.first:
                self.lm_head.weight = self.embed_tokens.weight
        self.init_rope(None)

    def init_rope(self, device: torch.device | str | None = "cpu") -> None:
        """(Re)build the RoPE tables on `device` (None: the current default device). They are not
        in the checkpoint, and built on the meta device they hold no values, so the loader calls
        this again. `inv_freq_local`: the sliding layers' own base, when they have one."""
        def table(local: bool) -> torch.Tensor:
            t = rope_inv_freq(self.cfg, local)
            return t if device is None else t.to(device)

        self.register_buffer("inv_freq", table(False), persistent=False)
        if local_rope_differs(self.cfg):
            self.register_buffer("inv_freq_local", table(True), persistent=False)

    @property
    def num_layers(self) -> int:
        return self.spec.end - self.spec.start

    def make_kv_cache(self, num_slots: int, layers: Optional[int] = None) -> KVCache:
        """A cache of `num_slots` slots for this stage's layers, or for `layers` of them (the
        global or the sliding-window ones, when they keep separate caches); the caller groups
        the slots in blocks."""
        n, cfg = self.num_layers if layers is None else layers, self.cfg
        if cfg.mla is not None:  # the latent and its RoPE key, read by every head (model/mla.py)
            return KVCache(n, num_slots, 1, cfg.mla.latent_dim, self.act_dtype, self.inv_freq.device, latent=True)
        return KVCache(n, num_slots, cfg.num_kv_heads, cfg.head_dim, self.act_dtype, self.inv_freq.device)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv: KVCache,
                head_rows: Optional[torch.Tensor] = None,
                window: Optional[tuple[AttentionMetadata, KVCache]] = None) -> torch.Tensor:
        """x: token ids (T,) on the first stage, hidden states (T, H) otherwise.

        Returns hidden states (T, H), or on the last stage logits (R, V) for the rows `head_rows`
        (all rows when None): prefill needs only the last row's logits, so the LM head, the
        largest matrix, runs only on the rows whose token is wanted.

        `window`: the sliding-window layers' own metadata and cache (the same rows, placed in a
        table that forgets what no row can see any more, kv/slot_table.py); then `kv` holds the
        global layers only. Without it every layer uses `kv`.
        """
        cfg = self.cfg
        if self.spec.first:
            x = self.embed_tokens(x).to(self.act_dtype)  # (T, H)
            if cfg.embed_scale != 1.0:
                x = x * cfg.embed_scale
        rope = Rope.at(meta.positions, self.inv_freq, x.dtype, rope_attention_factor(cfg))
        # Sliding-window layers: the same rows under masks that also hide keys beyond the window,
        # and (Gemma 3) RoPE of their own base. Built once per call, only if this stage has such layers.
        local_rope, local_meta = rope, meta
        local_kv = kv if window is None else window[1]
        if self.num_sliding:
            wmeta = meta if window is None else window[0]
            local_kv.write_positions(wmeta.positions, wmeta.write_slots)
            local_meta = within_window(wmeta, local_kv.positions, cfg.sliding_window)
            if local_rope_differs(cfg):
                local_rope = Rope.at(meta.positions, self.inv_freq_local, x.dtype, rope_attention_factor(cfg, True))
        index = {False: 0, True: 0}  # the next layer of each kind in its cache, with two caches
        for i, layer in enumerate(self.layers.values()):
            k = layer.sliding
            if window is not None:
                i, index[k] = index[k], index[k] + 1
            x = layer(x, local_rope if k else rope, local_meta if k else meta, local_kv if k else kv, i)
        if not self.spec.last:
            return x
        if head_rows is not None:
            x = x.index_select(0, head_rows)
        logits = self.lm_head(self.norm(x)).float()  # (R, V)
        if cfg.final_softcap:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits
