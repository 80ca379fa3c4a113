"""The distinct-experts counter of SparseMoE (model/moe.py EXPERTS_READ): what a step of several
rows reads, as the MoE row-cost profile records it."""

import torch

from specpipe.config import ModelConfig, MoEConfig
from specpipe.model.moe import EXPERTS_READ, SparseMoE


def _moe(E=8, k=2, hidden=16) -> SparseMoE:
    cfg = ModelConfig(arch="mixtral", vocab_size=32, hidden_size=hidden, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, moe=MoEConfig(E, k, 8, True, (0,)))
    torch.manual_seed(0)
    m = SparseMoE(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def test_counts_distinct_experts_per_call_only_when_on():
    m = _moe()
    x = torch.randn(5, 16)
    chosen, _ = m.route(x)
    EXPERTS_READ.reset()
    m(x)
    assert EXPERTS_READ.calls == 0  # off: nothing counted
    EXPERTS_READ.on = True
    try:
        m(x)
        m(x[:1])
    finally:
        EXPERTS_READ.on = False
    assert EXPERTS_READ.calls == 2
    assert EXPERTS_READ.experts == len(torch.unique(chosen)) + 2  # one row reads its top-2
    assert EXPERTS_READ.mean() == EXPERTS_READ.experts / 2
    EXPERTS_READ.reset()
    assert EXPERTS_READ.mean() == 0.0
