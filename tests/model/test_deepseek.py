"""DeepSeek V2 (no query LoRA, softmax routing, YaRN with mscale 0.707) and V3 (query LoRA,
grouped sigmoid routing with a correction bias, a dense first layer, interleaved RoPE, YaRN) on
tiny random checkpoints written by transformers' own classes (tests/conftest.py TINY_FAMILIES):
logits equal to transformers' at every position, greedy tokens equal to its generate, stage slices
equal to the whole model, a latent-attention row the same alone as among others (bitwise), the
KV bytes a token holds equal to the latent's size, and what is refused at load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specpipe.config import StageSpec
from specpipe.engine.kv_pool import bytes_per_token
from specpipe.loader import CheckpointError, open_checkpoint
from specpipe.model.mla import LatentAttention
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage
from specpipe.worker.stage_worker import StageWorker
from test_model_vs_hf import Session, greedy_ours, hf_logits, hf_model, max_diff, prefill_then_decode, random_tokens

transformers = pytest.importorskip("transformers")

FAMILIES = ["deepseek_v2", "deepseek_v3"]


def whole(ckpt):
    return build_stage(ckpt, StageSpec.whole(ckpt.config))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_at_every_position(tiny_model_dir, family):
    path = tiny_model_dir(family, seed=21)
    ckpt = open_checkpoint(path)
    ours = whole(ckpt)
    assert isinstance(ours.layers["0"].self_attn, LatentAttention)
    assert ours.cfg.mla.q_lora_rank == (None if family == "deepseek_v2" else 24)
    tokens = random_tokens(80, 300, seed=5)  # positions past YaRN's original 64
    want = hf_logits(hf_model(path), tokens)
    got = prefill_then_decode([ours], tokens, 50)  # a prefill, then one cached row at a time
    assert max_diff(got, want) < 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_generate(tiny_model_dir, family):
    path = tiny_model_dir(family, seed=22)
    ref = hf_model(path)
    prompt = random_tokens(12, 300, seed=6)
    with torch.inference_mode():
        gen = ref.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    want = gen[0, len(prompt):].tolist()
    assert len(want) == 32 and len(set(want)) > 3
    assert greedy_ours(whole(open_checkpoint(path)), prompt, 32, set()) == want


@pytest.mark.parametrize("family", FAMILIES)
def test_stage_slices_equal_the_whole_model(tiny_model_dir, family):
    ckpt = open_checkpoint(tiny_model_dir(family, seed=23))
    tokens = random_tokens(30, 300, seed=7)
    want = prefill_then_decode([whole(ckpt)], tokens, 24)
    # the dense layer 0 alone, then sparse layers; each stage keeps a latent cache of its own layers
    parts = [build_stage(ckpt, StageSpec(a, b, a == 0, b == 4)) for a, b in ((0, 1), (1, 3), (3, 4))]
    assert torch.equal(prefill_then_decode(parts, tokens, 24), want)


def test_a_row_is_the_same_alone_and_among_others(tiny_model_dir):
    """Tree rows, prompt chunks and decode rows of several requests share calls: a latent-attention
    row's logits must not depend on them (the lossless property), bitwise."""
    ckpt = open_checkpoint(tiny_model_dir("deepseek_v3", seed=24))
    model = whole(ckpt)
    tokens = random_tokens(21, 300, seed=8)
    kv = model.make_kv_cache(64)
    n = len(tokens)
    causal = torch.ones(n, n, dtype=torch.bool).tril().numpy()
    together = run_rows(model, kv, torch.tensor(tokens), list(range(n)), list(range(n)), list(range(n)), causal)
    for i in (0, 5, 20):  # the same row alone, reading the cache the call above wrote
        alone = run_rows(model, kv, torch.tensor(tokens[i:i + 1]), [i], [i], list(range(i + 1)), None)
        assert torch.equal(alone[0], together[i]), f"row {i}"


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_bytes_a_token_holds_are_the_latent(tiny_model_dir, family):
    """(kv_lora_rank + qk_rope_head_dim) x element size x layers, read off a stage's real cache,
    and what the KV pool's sizing counts (engine/kv_pool.py)."""
    ckpt = open_checkpoint(tiny_model_dir(family, seed=21))
    cfg = json.loads((ckpt.path / "config.json").read_text())
    latent = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]  # 32 + 8
    for spec in (StageSpec.whole(ckpt.config), StageSpec(1, 3, False, False)):
        worker = StageWorker(build_stage(ckpt, spec), 8, 4)
        layers = spec.end - spec.start
        assert worker.kv.v is None and tuple(worker.kv.k.shape[1:]) == (32, 1, latent)
        assert worker.kv.bytes_per_token() == latent * 4 * layers  # float32 activations
        assert bytes_per_token(ckpt.config, spec, 4) == latent * 4 * layers
    # against the per-head K and V transformers keeps: 2 x heads x (16 + 8) keys and 16 values
    assert latent < cfg["num_attention_heads"] * (16 + 8 + 16)


def copy_with(src, dst, config_edit=None, tensors_edit=None):
    shutil.copytree(src, dst)
    if config_edit:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors_edit:
        tensors = load_file(dst / "model.safetensors")
        tensors_edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(model_type="deepseek_v32"), r"deepseek_v32.*sparse attention \(the lightning indexer"),
    (lambda c: c.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
     r"quantization_config \(fp8\).*bfloat16 conversion"),
    (lambda c: c.update(topk_method="noaux_tc", model_type="deepseek_v2"), r"topk_method 'noaux_tc'"),
], ids=["v3.2-indexer", "fp8", "v2-unknown-router"])
def test_what_is_not_covered_is_refused_by_name(tiny_model_dir, tmp_path, edit, message):
    path = copy_with(tiny_model_dir("deepseek_v3", seed=21), tmp_path / "m", edit)
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(path)


def test_missing_latent_projection_is_named(tiny_model_dir, tmp_path):
    def drop(t):
        del t["model.layers.2.self_attn.kv_b_proj.weight"]

    path = copy_with(tiny_model_dir("deepseek_v3", seed=21), tmp_path / "m", tensors_edit=drop)
    ckpt = open_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"'layers\.2\.self_attn\.kv_b_proj\.weight' is missing"):
        whole(ckpt)
    build_stage(ckpt, StageSpec(0, 2, True, False))  # a stage without layer 2 does not read it


def test_multi_token_prediction_layers_are_skipped_with_a_line(tiny_model_dir, tmp_path, capfd):
    """A checkpoint carrying num_nextn_predict_layers extra layers (layers.4.* here) loads its 4
    decoder layers and says it skipped the rest; the tokens are the checkpoint's without them."""
    src = tiny_model_dir("deepseek_v3", seed=21)

    def add_mtp(t):
        for name in [n for n in t if n.startswith("model.layers.3.")]:
            t[name.replace("layers.3.", "layers.4.")] = t[name].clone()
        t["model.layers.4.eh_proj.weight"] = torch.zeros(64, 128)

    path = copy_with(src, tmp_path / "m", lambda c: c.update(num_nextn_predict_layers=1), add_mtp)
    ckpt = open_checkpoint(path)
    assert ckpt.config.num_layers == 4 and not any(n.startswith("layers.4.") for n in ckpt.names())
    assert "multi-token-prediction" in capfd.readouterr().err
    tokens = random_tokens(10, 300, seed=9)
    assert torch.equal(Session([whole(ckpt)]).extend(tokens), Session([whole(open_checkpoint(src))]).extend(tokens))
