"""Rotary position embeddings: the frequency table of each family's RoPE variant, and its use.

    plain     inv_freq[i] = theta^(-2i/R)                      (R = rotated dims of a head)
    llama3    low frequencies divided by `factor`, high ones kept, blended in between
    linear    every frequency divided by `factor` (Gemma 3's global layers)
    longrope  inv_freq[i] / ext[i], with Phi-3's short or long per-frequency factors, and
              cos/sin scaled by the attention factor
    yarn      (DeepSeek V2/V3) inv_freq[i] kept for fast dims, divided by `factor` for slow
              ones, blended along a linear ramp between; cos/sin scaled by the attention factor

Partial rotary (Phi-3): only the first R of a head's D dims rotate; the rest pass unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch

from specpipe.config import LinearRope, LongRope, ModelConfig, RopeScaling, YarnRope
from specpipe.kernels import native


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies (R/2,) of the global layers, or of the sliding ones with their own
    base (Gemma 3's rope_local_theta, never scaled) when `local`."""
    r = cfg.rotary_dim
    exponents = torch.arange(0, r, 2, dtype=torch.float64) / r
    if local and cfg.rope_local_theta is not None:
        return (1.0 / cfg.rope_local_theta ** exponents).float()
    s = cfg.rope_scaling
    if isinstance(s, LongRope):  # float32 throughout, as transformers computes it
        ext = torch.tensor(s.factors, dtype=torch.float32)
        return 1.0 / (ext * cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.int64).float() / r))
    if isinstance(s, YarnRope):
        return yarn_inv_freq(cfg.rope_theta, r, s)
    inv = 1.0 / (cfg.rope_theta ** exponents)
    if isinstance(s, LinearRope):
        return (inv / s.factor).float()
    if isinstance(s, RopeScaling):
        return llama3_scaled(inv, s).float()
    return inv.float()


def llama3_scaled(inv: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, (1 - smooth) * inv / s.factor + smooth * inv, scaled)


def yarn_inv_freq(base: float, r: int, s: YarnRope) -> torch.Tensor:
    """YaRN's frequencies, in float32 as transformers computes them (_compute_yarn_parameters)."""
    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over the original context
        return r * math.log(s.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, r - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = torch.clamp((torch.arange(r // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, r, 2, dtype=torch.float32) / r)
    extrapolation = 1 - ramp  # 1 = keep the original frequency (fast dims), 0 = divide by factor
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(cfg: ModelConfig, local: bool = False) -> float:
    s = cfg.rope_scaling
    scaled = isinstance(s, (LongRope, YarnRope)) and not (local and cfg.rope_local_theta)
    return s.attention_factor if scaled else 1.0


@dataclass
class Rope:
    """cos/sin of this call's rows: (T, 1, R) each; R may be less than the head dim."""

    cos: torch.Tensor
    sin: torch.Tensor

    @staticmethod
    def at(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> "Rope":
        freqs = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]  # (T, R/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, R)
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return Rope(cos.to(dtype), sin.to(dtype))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, heads, D). Hugging Face's rotate-half convention on the first R dims."""
        if x.dtype == torch.float32 == self.cos.dtype and x.is_cpu and native.available():
            return native.rope(x.contiguous(), self.cos, self.sin)  # the same bits, one C call
        r = self.cos.shape[-1]
        rot, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
        x1, x2 = rot.chunk(2, dim=-1)
        out = rot * self.cos + torch.cat((-x2, x1), dim=-1) * self.sin
        return out if rest is None else torch.cat((out, rest), dim=-1)


def local_rope_differs(cfg: ModelConfig) -> bool:
    return bool(cfg.sliding_layers) and cfg.rope_local_theta is not None


__all__ = ["Rope", "rope_inv_freq", "rope_attention_factor", "local_rope_differs", "llama3_scaled", "yarn_inv_freq"]
