"""The gated MLP (SwiGLU / GeGLU) and the sparse mixture of experts built from it.

SparseMoE (Mixtral, Qwen3-MoE): a router scores every expert for each row; the row takes its
top-k experts, their softmax weights (renormalised to sum 1 when norm_topk_prob), and the
weighted sum of their outputs. Rows are grouped per expert, so each expert runs once per call on
exactly the rows that chose it, whatever mix of committed tokens, prompt chunks and tree nodes of
several requests the call packs.

Batch invariance (the lossless property, docs/design.md §7): a row's routing is a function of its own
router logits; each expert is a linear layer on the quantized-linear seam (FloatLinear /
QuantLinear), whose rows do not depend on the rows sharing the call; and a row sums its experts'
outputs in ascending expert order whatever else is in the batch. So a row computed alone equals
the same row among others, bitwise (tests/kernels/test_batch_invariance.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from specpipe.config import ModelConfig
from specpipe.kernels.native import layer as native_layer
from specpipe.kernels.qlinear import FloatLinear, StackedLinear

ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
# torch's vectorised elementwise kernels (silu, gelu) on this AVX-512 CPU give an element other
# bits when it falls in a loop's remainder than in its main body, so with a row width that is
# not a multiple of 32 (a 48-wide tiny expert) a row's activations depended on how many rows
# shared the call. Rows padded to a multiple of LANES columns put every element in the same place
# of the loop whatever the row count. Real models' widths are multiples of 64: no copy there.
LANES = 64


def gated(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up, (T, I) each, with every row's result independent of T (see LANES)."""
    if act is F.silu and gate.dtype == torch.float32 == up.dtype and gate.is_cpu and native_layer.available():
        return native_layer.silu_mul(gate, up)  # layer.c's arithmetic: the fused layer's bits (model/fused.py)
    cols = gate.shape[-1]
    pad = -cols % LANES
    if not pad:
        return act(gate) * up
    return (act(F.pad(gate, (0, pad))) * F.pad(up, (0, pad)))[:, :cols]


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu_tanh."""

    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = FloatLinear(hidden, intermediate, bias=False)
        self.up_proj = FloatLinear(hidden, intermediate, bias=False)
        self.down_proj = FloatLinear(intermediate, hidden, bias=False)
        self.act = ACTIVATIONS[act]
        self.gate_up: Optional[StackedLinear] = None  # gate/up stacked after loading (stack_projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(gated(self.act, gate, up))


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = FloatLinear(cfg.hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, moe.intermediate_size, cfg.hidden_act)
                                     for _ in range(moe.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts (T, k) and their weights (T, k), from its own logits only."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # (T, E)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)  # (T, k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(x)
        out = torch.zeros_like(x)  # (T, H)
        for e in torch.unique(chosen).tolist():  # ascending expert ids
            rows, k = torch.nonzero(chosen == e, as_tuple=True)  # the rows that chose e, and in which place
            y = self.experts[e](x.index_select(0, rows)) * weights[rows, k, None]  # (rows, H)
            out.index_add_(0, rows, y)
        return out
