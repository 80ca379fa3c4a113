"""model/routing.py against transformers' own routers: DeepSeek V3 (sigmoid, correction bias,
groups by the sum of their best two), DeepSeek V2 (softmax, greedy and group-limited by the max),
MiniMax-M2 (sigmoid, bias, no groups), and the softmax top-k of Mixtral / Qwen3-MoE; plus the
routing of a row alone equal to the same row among others, bitwise."""

from __future__ import annotations

import pytest
import torch

from specpipe.config import ConfigError, MoEConfig
from specpipe.model.routing import Router, route

transformers = pytest.importorskip("transformers")

E, H, T = 16, 32, 64


def rows(seed: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


def ours(moe: MoEConfig, weight: torch.Tensor, bias, x: torch.Tensor):
    r = Router(H, moe)
    with torch.no_grad():
        r.weight.copy_(weight)
        if bias is not None:
            r.e_score_correction_bias.copy_(bias)
    return r(x)


def same_choice(got, want_idx, want_w):
    """Chosen sets equal per row, and each expert's weight equal (the references do not sort)."""
    chosen, weights = got
    for i in range(T):
        g = dict(zip(chosen[i].tolist(), weights[i].tolist()))
        w = dict(zip(want_idx[i].tolist(), want_w[i].tolist()))
        assert g.keys() == w.keys(), f"row {i}: {sorted(g)} vs {sorted(w)}"
        for e in g:
            assert g[e] == pytest.approx(w[e], rel=1e-6, abs=1e-7)


def test_deepseek_v3_grouped_sigmoid_router():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=3, n_group=4, topk_group=2,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    ref = DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ref.weight.copy_(0.3 * torch.randn(E, H, generator=gen))
        ref.e_score_correction_bias.copy_(0.2 * torch.randn(E, generator=gen))
    moe = MoEConfig(E, 3, 8, True, (0,), scoring="sigmoid", correction_bias=True, num_groups=4, top_groups=2,
                    scaling_factor=2.5)
    x = rows(1)
    _, w, idx = ref(x)
    got = ours(moe, ref.weight, ref.e_score_correction_bias, x)
    same_choice(got, idx, w)
    # the bias changed some choices (else it would be untested), and groups barred some experts
    unbiased = route(torch.nn.functional.linear(x, ref.weight), moe, None)[0]
    assert not torch.equal(unbiased.sort(-1).values, got[0].sort(-1).values)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_softmax_router(method):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    groups = 4 if method == "group_limited_greedy" else None
    cfg = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=3, topk_method=method,
                           n_group=groups, topk_group=2 if groups else None, routed_scaling_factor=1.5)
    ref = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(2)))
    moe = MoEConfig(E, 3, 8, False, (0,), num_groups=groups or 1, top_groups=2 if groups else 1, group_score="max",
                    scaling_factor=1.5)
    x = rows(3)
    _, w, idx = ref(x)
    same_choice(ours(moe, ref.weight, None, x), idx, w)


def test_minimax_m2_router():
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    cfg = MiniMaxM2Config(hidden_size=H, num_local_experts=E, num_experts_per_tok=2)
    ref = MiniMaxM2TopKRouter(cfg)
    gen = torch.Generator().manual_seed(4)
    bias = 0.2 * torch.randn(E, generator=gen)
    with torch.no_grad():
        ref.weight.copy_(0.3 * torch.randn(E, H, generator=gen))
    moe = MoEConfig(E, 2, 8, True, (0,), scoring="sigmoid", correction_bias=True)
    x = rows(5)
    _, w, idx = ref(x, bias)
    same_choice(ours(moe, ref.weight, bias, x), idx, w)


def test_softmax_topk_is_the_old_rule_bitwise():
    """Mixtral / Qwen3-MoE: softmax, top-k, renormalised: exactly the bits of the rule before routing.py."""
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(6))
    chosen, weights = route(logits, MoEConfig(E, 2, 8, True, (0,)))
    w, c = torch.topk(torch.softmax(logits, dim=-1), 2, dim=-1)
    assert torch.equal(chosen, c) and torch.equal(weights, w / w.sum(-1, keepdim=True))


def test_a_row_routes_alone_as_among_others():
    moe = MoEConfig(E, 3, 8, True, (0,), scoring="sigmoid", correction_bias=True, num_groups=4, top_groups=2,
                    scaling_factor=2.5)
    gen = torch.Generator().manual_seed(7)
    weight, bias, x = torch.randn(E, H, generator=gen), torch.randn(E, generator=gen), rows(8)
    chosen, weights = ours(moe, weight, bias, x)
    for i in range(0, T, 7):
        c, w = ours(moe, weight, bias, x[i:i + 1])
        assert torch.equal(c[0], chosen[i]) and torch.equal(w[0], weights[i])


@pytest.mark.parametrize("bad", [dict(num_groups=3), dict(num_groups=4, top_groups=5), dict(num_groups=8, top_groups=1,
                                                                                               top_k=3),
                                 dict(scoring="relu")])
def test_impossible_routers_are_refused(bad):
    kwargs = dict(num_experts=E, top_k=2, intermediate_size=8, norm_topk_prob=True, layers=(0,))
    kwargs.update(bad)
    with pytest.raises(ConfigError):
        MoEConfig(**kwargs)
