"""RMSNorm, as every family SpecPipe runs uses it (Gemma's 1 + weight variant included)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from specpipe.kernels import native


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.plus_one = eps, plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.plus_one and x.dtype == torch.float32 == self.weight.dtype:
            if x.is_cpu and native.available():  # one C call (the path never depends on the rows)
                return native.rmsnorm(x.contiguous(), self.weight, self.eps)
            # torch's fused op: the same operations in the same order, bitwise (one call, not six)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 as the reference implementations do, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:  # Gemma stores weight - 1 and scales in float32
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)
