"""Speculation on sparse experts (issue 59 item 6): the DeepSeek-V3 and GLM-4.6 presets, a
`specpipe profile --synthetic` of a mixture of experts (its sparse layer timed, the distinct
experts each row count read recorded and kept through the file), and `--layers-per-step auto`
planning smaller blocks where rows cost about linearly, as a sparse layer's do on a CPU."""

from __future__ import annotations

import argparse
import json

import pytest

from specpipe.config import ConfigError
from specpipe.costs import synthetic
from specpipe.costs.profile import CostProfile
from specpipe.spec_decode.planner import HitProfile, StepCost, plan_block

TINY_V3 = dict(model_type="deepseek_v3", hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
               num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=2,
               n_shared_experts=1, n_group=4, topk_group=2, num_attention_heads=4, num_key_value_heads=4,
               kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
               vocab_size=1000)


def test_presets_have_the_published_shapes_and_scale_their_expert_count():
    _, v3 = synthetic.model_config("deepseek-v3")
    assert (v3.num_layers, v3.hidden_size, v3.moe.num_experts, v3.moe.top_k, v3.moe.layers[0]) == (61, 7168, 256, 8, 3)
    assert (v3.mla.kv_lora_rank, v3.mla.q_lora_rank, v3.moe.num_groups, v3.moe.top_groups) == (512, 1536, 8, 4)
    assert v3.kv_values_per_token == 576  # the latent and the RoPE key
    _, glm = synthetic.model_config("glm-4.6")
    assert (glm.num_layers, glm.moe.num_experts, glm.moe.intermediate_size, glm.num_kv_heads) == (92, 160, 1536, 8)
    name, small = synthetic.model_config("deepseek-v3:e32")
    assert name == "deepseek-v3:e32" and small.moe.num_experts == 32
    assert (small.moe.intermediate_size, small.moe.top_k, small.moe.num_groups) == (2048, 8, 8)
    with pytest.raises(ConfigError):
        synthetic.model_config("deepseek-v3:e12")  # not 8 equal groups


def test_profile_of_a_sparse_model_times_its_sparse_layer_and_records_experts_read(tmp_path):
    from specpipe.sim import calibrate

    config = tmp_path / "tiny-v3" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TINY_V3))
    p = argparse.ArgumentParser()
    calibrate.add_arguments(p)
    out = tmp_path / "p.json"
    args = p.parse_args(["--synthetic", str(config), "--rows", "1,8", "--contexts", "16", "--repeats", "1",
                         "--threads", "1", "--stage-layers", "2", "--idle-gaps", "none", "--out", str(out)])
    assert calibrate.main(args) == 0
    prof = CostProfile.load(out)
    assert prof.model["num_experts"] == 16 and prof.model["top_k"] == 2
    one, eight = prof.experts_read
    assert one == 2 and 2 < eight <= 16  # one row reads its top 2; 8 rows read more, at most all
    assert any("stages start at layer 1" in a for a in prof.assumptions)  # layer 0 is dense
    assert CostProfile.from_json(json.loads(json.dumps(prof.to_json()))).experts_read == prof.experts_read
    with pytest.raises(ValueError):
        CostProfile("cpu", [1, 2], [[1.0, 2.0]], [1.0, 1.0], experts_read=[8.0])


def _profile(layer_ms: list[float]) -> CostProfile:
    rows = [1, 2, 4, 8, 16, 32, 64]
    return CostProfile("cpu", rows, [layer_ms], [5.0] * len(rows), model={"num_layers": 60})


def test_auto_plans_a_smaller_block_where_rows_cost_about_linearly():
    # Dense: the one-row step is the weights streamed, extra rows nearly free (docs/benchmarks.md
    # §3). Sparse: each row brings experts of its own, so rows cost about linearly.
    dense = _profile([10.0, 10.5, 11.0, 12.0, 14.0, 18.0, 26.0])
    sparse = _profile([10.0, 18.0, 33.0, 60.0, 105.0, 170.0, 290.0])
    hits = HitProfile(16)
    for _ in range(200):
        hits.record(0, True)
    for _ in range(40):
        hits.record(None, False)
    plans = {}
    for name, prof in (("dense", dense), ("sparse", sparse)):
        cost = StepCost(prof, 8, draft_cost=False)
        plans[name] = plan_block(hits, 16, 8, 4, [1, 2, 4, 8, 16], cost, 256)
    (dd, dw), (sd, sw) = plans["dense"], plans["sparse"]
    assert sd * sw < dd * dw and sd <= dd and sw <= dw
