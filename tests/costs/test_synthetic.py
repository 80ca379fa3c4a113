"""Synthetic checkpoints (costs/synthetic.py): llama.cpp's Q4_K_M rule, random blocks of the right
shapes and types with finite values of a trained layer's scale, a stage built from them through
the real path, and a `specpipe profile --synthetic` file the simulator loads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specpipe.config import StageSpec
from specpipe.costs import synthetic
from specpipe.costs.synthetic import Q, SyntheticCheckpoint, random_blocks, tensor_types, use_more_bits

MODELS = Path.home() / ".cache/specpipe/models"
TINY = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=16,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)


def tiny(**changes) -> SyntheticCheckpoint:
    from specpipe.loader.hf_config import model_config_from_hf

    return SyntheticCheckpoint("tiny", model_config_from_hf({**TINY, **changes}))


def test_q4_k_m_rule_on_a_tiny_config():
    ckpt = tiny()
    t = ckpt.types
    assert t["lm_head.weight"] == Q.Q6_K and t["embed_tokens.weight"] == Q.Q4_K
    assert t["layers.3.self_attn.q_proj.weight"] == Q.Q4_K and t["layers.3.mlp.up_proj.weight"] == Q.Q4_K
    assert t["layers.3.input_layernorm.weight"] == Q.F32
    # 16 layers in file order 0, 1, 10, ..., 15, 2, ..., 9: use_more_bits counts positions.
    order = sorted(range(16), key=str)
    more = {order[i] for i in range(16) if use_more_bits(i, 16)}
    assert more == {0, 1, 12, 15, 4, 7, 8, 9}
    for layer in range(16):
        want = Q.Q6_K if layer in more else Q.Q4_K
        assert t[f"layers.{layer}.self_attn.v_proj.weight"] == want
        assert t[f"layers.{layer}.mlp.down_proj.weight"] == want
    assert sum(ckpt.types[f"layers.{i}.mlp.down_proj.weight"] == Q.Q6_K for i in range(16)) == 8  # about half


def test_k_quants_fall_back_where_rows_are_not_whole_superblocks():
    ckpt = tiny(hidden_size=224, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    assert ckpt.types["layers.0.self_attn.q_proj.weight"] == Q.Q5_0  # 224 inputs: not 256s
    assert ckpt.types["lm_head.weight"] == Q.Q8_0
    assert ckpt.types["layers.0.mlp.down_proj.weight"] == Q.Q6_K  # 512 inputs
    assert tensor_types(ckpt.config, {"x.weight": (8, 256)}, "q8_0") == {"x.weight": Q.Q8_0}
    with pytest.raises(ValueError, match="type mix"):
        tensor_types(ckpt.config, {}, "q9_9")


def test_moe_experts_count_their_layer_number():
    ckpt = tiny(model_type="qwen3_moe", moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
                head_dim=64)
    t = ckpt.types
    assert t["layers.0.mlp.gate.weight"] == Q.F32  # the router
    for layer in range(16):
        want = Q.Q6_K if use_more_bits(layer, 16) else Q.Q4_K
        assert all(t[f"layers.{layer}.mlp.experts.{e}.down_proj.weight"] == want for e in range(4))
    b = synthetic.weight_bytes(ckpt, ckpt.nbytes)
    assert b["layer_bytes_active_mean"] < b["layer_bytes_mean"]


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_1, Q.Q5_1])
def test_random_blocks_decode_to_finite_weights_of_a_trained_scale(qtype):
    blocks = random_blocks(qtype, 16, 1024, np.random.default_rng(1))
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    assert blocks.shape == (16, 1024 // values * size) and blocks.dtype == np.uint8
    w = gguf.quants.dequantize(blocks, qtype)
    assert np.isfinite(w).all()
    assert 0.5 < w.std() * 1024 ** 0.5 < 2.0 and abs(w.mean()) < 0.2 * w.std()


def test_a_stage_builds_and_computes_finite_outputs():
    from specpipe.model.stage import build_stage

    ckpt = tiny()
    model = build_stage(ckpt, StageSpec(0, 2, False, False))
    assert ckpt.load_packed("layers.0.mlp.down_proj.weight")[1].shape == (256, 512 // 256 * 210)
    from specpipe.kernels.qlinear import QuantLinear

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, QuantLinear):
                y = m(torch.randn(4, m.in_features))
                assert torch.isfinite(y).all() and 0.1 < y.std() < 10


@pytest.mark.skipif(not (MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf").exists(), reason="Qwen file not here")
@pytest.mark.parametrize("preset,file", [("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
                                         ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")])
def test_the_rule_gives_the_real_files_types(preset, file):
    from specpipe.loader import open_checkpoint

    real = open_checkpoint(MODELS / file)
    name, cfg = synthetic.model_config(preset)
    ckpt = SyntheticCheckpoint(name, cfg)
    assert real.names() == ckpt.names()
    for n in real.names():
        found = real.load_packed(n)
        assert tuple(real.shape(n)) == ckpt.shape(n)
        if found is not None:
            assert found[0] == ckpt.types[n], n


def test_profile_synthetic_writes_a_profile_the_simulator_loads(tmp_path):
    from specpipe.costs.balance import balanced_stage_layers
    from specpipe.costs.profile import load_profile
    from specpipe.sim import calibrate

    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({**TINY, "num_hidden_layers": 4}))
    p = argparse.ArgumentParser()
    calibrate.add_arguments(p)
    out = tmp_path / "p.json"
    args = p.parse_args(["--synthetic", str(config), "--rows", "1,2", "--contexts", "16", "--repeats", "1",
                         "--threads", "1", "--out", str(out)])
    assert calibrate.main(args) == 0
    prof = load_profile(out)
    assert prof.num_layers == 4 and prof.rows == [1, 2] and len(prof.head_ms) == 2
    assert prof.model["name"] == "synthetic-tiny" and prof.model["type_mix"] == "q4_k_m"
    assert prof.model["head_bytes"] > 0 and prof.assumptions[0].startswith("synthetic")
    assert sum(balanced_stage_layers(prof, 4, 2)) == 4 and prof.stage(2, True, 1) > 0
    for preset in ("qwen2.5-32b", "llama-3.1-70b", "qwen3-30b-a3b"):
        name, cfg = synthetic.model_config(preset)
        assert name == preset and cfg.num_layers in (64, 80, 48)
