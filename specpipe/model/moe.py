"""The gated MLP (SwiGLU / GeGLU) and the sparse mixture of experts built from it.

SparseMoE (Mixtral, Qwen3-MoE, DeepSeek V2/V3): a router (model/routing.py: softmax or sigmoid
scores, an optional selection bias, optional expert groups) picks each row's top-k experts and
their weights; the row gets the weighted sum of their outputs, plus an always-on shared expert
when the model has one (DeepSeek, GLM-4.5); gpt-oss's experts have biases and the clamped
SwiGLU (clamped_swiglu). Rows are grouped per expert, so each expert runs once
per call on exactly the rows that chose it, whatever mix of committed tokens, prompt chunks and
tree nodes of several requests the call packs.

Batch invariance (the lossless property, docs/design.md §7): a row's routing is a function of its own
router logits; each expert is a linear layer on the quantized-linear seam (FloatLinear /
QuantLinear), whose rows do not depend on the rows sharing the call; and a row sums its experts'
outputs in ascending expert order whatever else is in the batch. So a row computed alone equals
the same row among others, bitwise (tests/kernels/test_batch_invariance.py).

EXPERTS_READ counts, while a profiler turns it on, the distinct experts each call ran: what a
step of several rows reads from memory (docs/benchmarks.md, the MoE row cost); off, it costs
one attribute check a call.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from specpipe.config import ModelConfig
from specpipe.kernels.native import layer as native_layer
from specpipe.kernels.qlinear import FloatLinear, StackedLinear
from specpipe.model.lanes import pad_columns
from specpipe.model.routing import Router


class ExpertsRead:
    """Distinct experts run per SparseMoE call, summed while `on` (costs/measure.py reads it)."""

    def __init__(self) -> None:
        self.on, self.calls, self.experts = False, 0, 0

    def reset(self) -> None:
        self.calls = self.experts = 0

    def mean(self) -> float:
        """Distinct experts a call read, on average since the last reset (0 without calls)."""
        return self.experts / self.calls if self.calls else 0.0


EXPERTS_READ = ExpertsRead()

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def gated(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up, (T, I) each, with every row's result independent of T (model/lanes.py)."""
    if act is F.silu and gate.dtype == torch.float32 == up.dtype and gate.is_cpu and native_layer.available():
        return native_layer.silu_mul(gate, up)  # layer.c's arithmetic: the fused layer's bits (model/fused.py)
    return (act(pad_columns(gate)) * pad_columns(up))[:, :gate.shape[-1]]


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation, as transformers' GptOssExperts._apply_gate: the gate clamped
    from above and up on both sides at `limit`, then (up + 1) * gate * sigmoid(alpha * gate).
    (T, I) each; element-wise over rows padded to whole vectors (model/lanes.py)."""
    g = pad_columns(gate).clamp(max=limit)
    u = pad_columns(up).clamp(min=-limit, max=limit)
    return ((u + 1) * (g * torch.sigmoid(g * alpha)))[:, :gate.shape[-1]]


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu_tanh; with `swiglu` (alpha,
    limit) gpt-oss's clamped SwiGLU instead, and `bias` on all three projections (its experts)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False,
                 swiglu: Optional[tuple[float, float]] = None) -> None:
        super().__init__()
        self.gate_proj = FloatLinear(hidden, intermediate, bias=bias)
        self.up_proj = FloatLinear(hidden, intermediate, bias=bias)
        self.down_proj = FloatLinear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]
        self.swiglu = swiglu
        self.gate_up: Optional[StackedLinear] = None  # gate/up stacked after loading (stack_projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        if self.swiglu is not None:
            return self.down_proj(clamped_swiglu(gate, up, *self.swiglu))
        return self.down_proj(gated(self.act, gate, up))


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.gate = Router(cfg.hidden_size, moe)
        swiglu = None if moe.swiglu_limit is None else (moe.swiglu_alpha, moe.swiglu_limit)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, moe.intermediate_size, cfg.hidden_act, moe.expert_bias, swiglu)
                                     for _ in range(moe.num_experts))
        self.shared_experts = (MLP(cfg.hidden_size, moe.shared_intermediate_size, cfg.hidden_act)
                               if moe.shared_intermediate_size else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts (T, k) and their weights (T, k), from its own logits only."""
        chosen, weights = self.gate(x)
        return chosen, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(x)
        out = torch.zeros_like(x)  # (T, H)
        experts = torch.unique(chosen).tolist()  # ascending expert ids
        if EXPERTS_READ.on:
            EXPERTS_READ.calls, EXPERTS_READ.experts = EXPERTS_READ.calls + 1, EXPERTS_READ.experts + len(experts)
        for e in experts:
            rows, k = torch.nonzero(chosen == e, as_tuple=True)  # the rows that chose e, and in which place
            y = self.experts[e](x.index_select(0, rows)) * weights[rows, k, None]  # (rows, H)
            out.index_add_(0, rows, y)
        if self.shared_experts is not None:  # the routed sum first, then the shared expert, as transformers adds them
            out = out + self.shared_experts(x)
        return out
