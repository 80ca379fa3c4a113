"""The router of a sparse MLP: which experts each row takes, and with what weights.

One rule for every family, switched by MoEConfig's fields (config.py):

    family              scoring   correction bias  groups (n_group, topk_group, group score)  norm  scaling
    Mixtral, Qwen3-MoE  softmax   -                -                                        yes*  1
    DeepSeek V2         softmax   -                greedy: none; group_limited_greedy: max   no*   routed_scaling_factor
    DeepSeek V3, GLM-4.5 sigmoid  e_score_correction_bias  top2_sum                          yes*  routed_scaling_factor
    MiniMax-M2          sigmoid   e_score_correction_bias  -                                 yes   1
    gpt-oss             topk_softmax (the top_k logits, with the router's bias added, chosen first;
                        their weights the softmax over those k alone)                     -     1
    (* as the checkpoint's norm_topk_prob says)

For each row, from its router logits (T, E) in float32:
  1. scores   = softmax or sigmoid of the logits                                   (T, E)
  2. choice   = scores + correction bias (selection only: the weights never see it)  (T, E)
  3. groups   = with num_groups > 1, each group scored (sum of its best two choices, or its
                largest), the best top_groups groups kept, every other expert barred   (T, G)
  4. chosen   = the top_k experts by choice                                         (T, k)
  5. weights  = their *scores* (not choices), renormalised to sum 1 when norm_topk_prob,
                times scaling_factor                                                (T, k)

Differences from the references that never change a bit in practice: transformers' DeepSeek V3 /
GLM routers add 1e-20 to the renormalising sum (a sum of sigmoids is far above the point where
1e-20 is below its float32 rounding); its DeepSeek V2 masks barred experts with 0 instead of -inf
(no difference while top_groups groups hold at least top_k experts, which MoEConfig checks).

Batch invariance (model/moe.py): every step is a function of the row's own logits, so a row is
routed the same whatever rows share the call (the sigmoid over rows padded to whole vectors:
model/lanes.py; tiny test routers of 8 experts showed it).

Use (GLM-4.5 and MiniMax-M2 as well as DeepSeek): `Router(hidden, moe)` holds the checkpoint's
`mlp.gate.weight` (E, H) and, when `moe.correction_bias`, `mlp.gate.e_score_correction_bias`
(E,), both kept in float32 by the loader as transformers keeps them; `router(x)` returns
(chosen (T, k) int64, weights (T, k) float32). `SparseMoE` (model/moe.py) calls it and adds the
shared expert when `moe.shared_intermediate_size`. A checkpoint that stores the bias elsewhere
(MiniMax-M2: `mlp.e_score_correction_bias`) maps the name at load.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from specpipe.config import MoEConfig
from specpipe.kernels.torch_kernels import invariant_linear
from specpipe.model.lanes import pad_columns


def route(logits: torch.Tensor, moe: MoEConfig, bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (T, E) float32 -> (chosen experts (T, k) int64, their weights (T, k) float32)."""
    if moe.scoring == "topk_softmax":  # gpt-oss: choose by logit, weigh by a softmax over the chosen
        top, chosen = torch.topk(logits, moe.top_k, dim=-1)  # (T, k) each
        return chosen, torch.softmax(top, dim=-1)
    if moe.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)  # (T, E)
    else:  # elementwise: padded so a row's bits do not depend on the row count (model/lanes.py)
        scores = torch.sigmoid(pad_columns(logits))[:, :logits.shape[-1]]  # (T, E)
    choice = scores if bias is None else scores + bias  # (T, E): what selects, never what weighs
    if moe.num_groups > 1:
        t, e, g = choice.shape[0], choice.shape[1], moe.num_groups
        grouped = choice.view(t, g, e // g)  # (T, G, E/G)
        if moe.group_score == "max":
            group_scores = grouped.amax(dim=-1)  # (T, G)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # (T, G)
        kept = group_scores.topk(moe.top_groups, dim=-1).indices  # (T, top_groups)
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # (T, G)
        choice = choice.masked_fill(~allowed.repeat_interleave(e // g, dim=1), float("-inf"))
    if choice is scores:
        weights, chosen = torch.topk(scores, moe.top_k, dim=-1)  # (T, k) each
    else:
        chosen = torch.topk(choice, moe.top_k, dim=-1).indices  # (T, k)
        weights = scores.gather(1, chosen)  # (T, k)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if moe.scaling_factor != 1.0:
        weights = weights * moe.scaling_factor
    return chosen, weights


class Router(nn.Module):
    """The router's parameters (canonical names `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`)
    and `route` applied to them. Logits are computed in float32 whatever the activations' type, as
    transformers' sigmoid routers do (and, for float32 activations, exactly as before for the
    softmax families)."""

    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden))  # (E, H)
        self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.correction_bias else None
        self.bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.router_bias else None  # gpt-oss: on the logits

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bias = None if self.bias is None else self.bias.float()
        logits = invariant_linear(x.float(), self.weight.float(), bias)  # (T, E)
        bias = None if self.e_score_correction_bias is None else self.e_score_correction_bias.float()
        return route(logits, self.moe, bias)


# Parameters the loader keeps in float32 whatever the activations' type (model/stage.py).
FLOAT32_PARAMS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.gate.bias")

__all__ = ["route", "Router", "FLOAT32_PARAMS"]
