"""GLM-4.5 / 4.6 (`glm4_moe`) and MiniMax-M2 (`minimax_m2`) against transformers' own classes.

Tiny random checkpoints written by transformers (tests/conftest.py TINY_FAMILIES, every feature
on: partial rotary, QKV bias and per-head q/k norm for GLM, whole-projection q/k norm for
MiniMax, sigmoid routing with a correction bias that changes choices, GLM's expert groups, shared
expert, scaled weights and dense first layer): logits at every position, prefill then cached
decode; greedy tokens against `generate`; the config fields these families read differently; and
the multi-token-prediction layers a checkpoint carries, skipped at load.
"""

from __future__ import annotations

import itertools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specpipe.config import ConfigError, StageSpec
from specpipe.loader import CheckpointError, open_checkpoint
from specpipe.loader.hf_config import model_config_from_hf, prediction_layers
from specpipe.model.stage import build_stage
from test_model_vs_hf import (Session, greedy_ours, hf_logits, hf_model, max_diff, prefill_then_decode, random_tokens,
                              whole_model)

transformers = pytest.importorskip("transformers")

CASES = {
    "glm4_moe": dict(arch="glm4_moe", seed=20),
    # the other side of each GLM switch: no q/k norm, no bias, whole heads rotating, one group,
    # weights neither renormalised nor scaled, two dense layers
    "glm4_moe-plain": dict(arch="glm4_moe", seed=21, use_qk_norm=False, attention_bias=False,
                           partial_rotary_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=False,
                           routed_scaling_factor=1.0, first_k_dense_replace=2),
    "minimax_m2": dict(arch="minimax_m2", seed=22),
}
RTOL = 2e-5  # of the logits' largest magnitude, as the other families (test_model_vs_hf.FAMILY_RTOL)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tiny_model_dir, case):
    kwargs = CASES[case]
    path = tiny_model_dir(**kwargs)
    ours, ref = whole_model(path), hf_model(path)
    cfg, rc = ours.cfg, ref.config
    assert cfg.arch == kwargs["arch"]
    assert cfg.rotary_dim == int(rc.head_dim * rc.rope_parameters.get("partial_rotary_factor", 1.0))
    sparse = [i for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "experts")]
    assert list(cfg.moe.layers) == sparse and sparse  # the dense layers are GLM's first ones
    if kwargs["arch"] == "minimax_m2":
        assert cfg.qk_norm and cfg.qk_norm_whole and cfg.rotary_dim == 16
    else:
        assert cfg.qk_norm == rc.use_qk_norm and cfg.attention_bias == rc.attention_bias

    tokens = random_tokens(30, cfg.vocab_size, seed=len(case))
    got = prefill_then_decode([ours], tokens, 22)
    want = hf_logits(ref, tokens)
    assert want.abs().max() > 1.0 and want.std() > 0.3, "reference logits degenerate: test too weak"
    assert max_diff(got, want) < RTOL * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("arch", ["glm4_moe", "minimax_m2"])
def test_the_routing_features_matter(tiny_model_dir, arch):
    """Guard for the test above: with the correction bias at zero the logits move, so a router
    that ignored it would have failed there."""
    path = tiny_model_dir(**CASES[arch])
    tokens = random_tokens(24, 300, seed=3)
    want = prefill_then_decode([whole_model(path)], tokens, 24)
    ckpt = open_checkpoint(path)
    stage = build_stage(ckpt, StageSpec.whole(ckpt.config))
    biases = [t for name, t in itertools.chain(stage.named_parameters(), stage.named_buffers())
              if name.endswith("e_score_correction_bias")]
    assert len(biases) == len(ckpt.config.moe.layers)
    with torch.no_grad():
        for t in biases:
            t.zero_()
    assert max_diff(prefill_then_decode([stage], tokens, 24), want) > 1e-3


@pytest.mark.parametrize("arch", ["glm4_moe", "minimax_m2"])
def test_greedy_matches_generate(tiny_model_dir, arch):
    path = tiny_model_dir(**CASES[arch])
    ours, ref = whole_model(path), hf_model(path)
    prompt = random_tokens(12, 300, seed=9)
    with torch.inference_mode():
        gen = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    want = gen[0, len(prompt):].tolist()
    assert len(want) == 32 and len(set(want)) > 3
    assert greedy_ours(ours, prompt, 32, eos=set()) == want


def _hub_style(path, **edits) -> dict:
    """The tiny model's config.json as the model's authors write theirs: top-level RoPE fields
    instead of transformers 5's rope_parameters, then `edits`."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg.update(edits)
    return {k: v for k, v in cfg.items() if v is not None}


def test_hub_configs(tiny_model_dir):
    """GLM-4.5's files without partial_rotary_factor rotate half a head (transformers' default for
    glm4_moe); MiniMax-M2's name the rotated dims as rotary_dim; neither family slides a window."""
    glm = _hub_style(tiny_model_dir(**CASES["glm4_moe"]))
    assert model_config_from_hf(glm).rotary_dim == 16
    glm["partial_rotary_factor"] = 0.25
    assert model_config_from_hf(glm).rotary_dim == 8
    glm.update(sliding_window=4)
    assert model_config_from_hf(glm).sliding_layers == ()
    mm = _hub_style(tiny_model_dir(**CASES["minimax_m2"]), rotary_dim=8, sliding_window=4)
    mm.pop("partial_rotary_factor", None)
    got = model_config_from_hf(mm)
    assert got.rotary_dim == 8 and got.sliding_layers == () and got.qk_norm_whole
    assert prediction_layers({**mm, "num_mtp_modules": 3}) == 3 and prediction_layers(glm) == 1
    with pytest.raises(ConfigError, match="multi-token-prediction"):
        prediction_layers({**mm, "num_mtp_modules": "three"})


def _with_mtp_layer(src, dst, key: str, count) -> None:
    """A copy of `src` whose checkpoint appends a multi-token-prediction layer after its decoder,
    as GLM-4.5 and DeepSeek V3 ship it (layers.{N}: the projection of [embedding; hidden], its
    norms, and a whole decoder layer, here a copy of the last one), declared by `key`."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    cfg.pop("num_nextn_predict_layers", None)
    if count is not None:
        cfg[key] = count
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(dst / "model.safetensors")
    last = f"model.layers.{n - 1}."
    for name in [k for k in tensors if k.startswith(last)]:
        tensors[name.replace(last, f"model.layers.{n}.")] = tensors[name].clone()
    h = cfg["hidden_size"]
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.randn(h, 2 * h)
    tensors[f"model.layers.{n}.enorm.weight"] = torch.ones(h)
    tensors[f"model.layers.{n}.hnorm.weight"] = torch.ones(h)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("arch, key", [("glm4_moe", "num_nextn_predict_layers"), ("minimax_m2", "num_mtp_modules")])
def test_multi_token_prediction_layers_are_skipped(tiny_model_dir, tmp_path, capfd, arch, key):
    src = tiny_model_dir(**CASES[arch])
    _with_mtp_layer(src, tmp_path / "mtp", key, 1)
    ckpt = open_checkpoint(tmp_path / "mtp")
    err = capfd.readouterr().err
    assert "skipping its multi-token-prediction layers (4 of layers 0..4)" in err
    assert ckpt.config.num_layers == 4 and not any(n.startswith("layers.4.") for n in ckpt.names())
    tokens = random_tokens(20, 300, seed=4)
    want = prefill_then_decode([whole_model(src)], tokens, 16)
    assert torch.equal(prefill_then_decode([build_stage(ckpt, StageSpec.whole(ckpt.config))], tokens, 16), want)
    # a stage copied to another node is never sent them: every byte of the file but theirs at most
    mtp_bytes = sum(t.numel() * t.element_size() for name, t in load_file(tmp_path / "mtp" / "model.safetensors").items()
                    if name.startswith("model.layers.4."))
    ranges = ckpt.stage_ranges(StageSpec.whole(ckpt.config)).ranges
    assert sum(n for rel, _, n in ranges if rel == "model.safetensors") <= (
        (tmp_path / "mtp" / "model.safetensors").stat().st_size - mtp_bytes)
    # undeclared, the extra layer is what it would be in any other checkpoint: a config mismatch
    _with_mtp_layer(src, tmp_path / "undeclared", key, None)
    with pytest.raises(CheckpointError, match="the config says 4 layers, the file holds tensors for layers 0..4"):
        open_checkpoint(tmp_path / "undeclared")
