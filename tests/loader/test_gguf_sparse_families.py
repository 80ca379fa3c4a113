"""DeepSeek V2 / V3, GLM-4.5 and MiniMax-M2 as llama.cpp writes them: the tiny checkpoints converted
by llama.cpp's own convert_hf_to_gguf.py (tests/llama_converter.py) load to the Hugging Face path's
config, logits and greedy tokens, whole and split into two stages that each read only their own
layers' bytes; DeepSeek's kv_b_proj comes back exactly from llama.cpp's split attn_k_b / attn_v_b,
and GLM's multi-token-prediction layer, which the converter keeps, is skipped with a line.
Conversions are made once per module (each runs the converter in a subprocess, a few seconds)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from llama_converter import convert
from safetensors.torch import load_file, save_file
from test_gguf_families import assert_close_configs, prefill_logits, whole

from specpipe.loader import CheckpointError, open_checkpoint
from specpipe.loader.gguf_metadata import read_gguf_metadata
from specpipe.loader.partition import partition_layers
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage

# The tiny families (tests/conftest.py TINY_FAMILIES) with what the released config.json files say
# beyond transformers' fields: DeepSeek V3's scoring_func, from which the converter writes the
# gating function (a deepseek2 file without one is routed by softmax, as llama.cpp reads V2 files).
FAMILIES = {"deepseek_v2": {}, "deepseek_v3": dict(scoring_func="sigmoid", topk_method="noaux_tc"),
            "glm4_moe": {}, "minimax_m2": {}}
PROMPT = [5, 17, 33, 90, 5, 17, 120, 7, 99, 42, 250, 3]
N = 16


def with_prediction_layer(src, dst):
    """A copy of the tiny GLM-4.5 with the multi-token-prediction layer its released files carry
    (layers.4: a decoder layer plus eh_proj and three norms; config.json already says 1)."""
    hf_dir = shutil.copytree(src, dst)
    assert json.loads((hf_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    tensors = load_file(hf_dir / "model.safetensors")
    for name in [n for n in tensors if n.startswith("model.layers.3.")]:
        tensors[name.replace("layers.3.", "layers.4.")] = tensors[name].clone()
    tensors["model.layers.4.eh_proj.weight"] = torch.randn(64, 128)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.4.{norm}.weight"] = torch.ones(64)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    return hf_dir


@pytest.fixture(scope="module")
def converted(tiny_model_dir, tmp_path_factory):
    """family -> (Hugging Face directory, the GGUF file llama.cpp's converter makes of it, the
    Hugging Face path's greedy tokens)."""
    done = {}

    def get(family):
        if family not in done:
            hf_dir = tiny_model_dir(family, **FAMILIES[family])
            tmp = tmp_path_factory.mktemp(family)
            if family == "glm4_moe":
                hf_dir = with_prediction_layer(hf_dir, tmp / "hf")
            path = convert(hf_dir, tmp / f"{family}.gguf")
            done[family] = hf_dir, path, greedy([whole(open_checkpoint(hf_dir))], PROMPT, N)
        return done[family]

    return get


def greedy(stages, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens from a chain of stages: a prefill, then one cached row a step."""
    caches = [m.make_kv_cache(len(prompt) + n) for m in stages]
    tokens, start = list(prompt), 0
    while len(tokens) < len(prompt) + n:
        positions = list(range(start, len(tokens)))
        x = torch.tensor(tokens[start:])
        for model, kv in zip(stages, caches):
            x = run_rows(model, kv, x, positions, positions, list(range(len(tokens))),
                         np.tri(len(tokens), dtype=bool)[start:])
        start = len(tokens)
        tokens.append(int(x[-1].argmax()))
    return tokens[len(prompt):]


def bytes_read(ckpt, spec) -> set[str]:
    """The GGUF tensors whose bytes lie in what stage_ranges says `spec`'s stage reads."""
    ranges = [(a, a + n) for _, a, n in ckpt.stage_ranges(spec).ranges]
    tensors = gguf.GGUFReader(ckpt.path).tensors
    return {t.name for t in tensors if any(a <= t.data_offset and t.data_offset + t.n_bytes <= b for a, b in ranges)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_converted_file_gives_the_hf_paths_config_logits_and_tokens(converted, family):
    hf_dir, path, tokens = converted(family)
    hf, gg = open_checkpoint(hf_dir), open_checkpoint(path)
    # GLM's converter names [gMASK] BOS and <|user|> an end of turn, which config.json does not.
    assert gg.config.eos_token_ids[0] == hf.config.eos_token_ids[0]
    assert_close_configs(gg.config, dataclasses.replace(hf.config, bos_token_id=gg.config.bos_token_id,
                                                        eos_token_ids=gg.config.eos_token_ids))
    want = prefill_logits(whole(hf))
    ours = whole(gg)
    assert (prefill_logits(ours) - want).abs().max() < 1e-5 * want.abs().max()
    assert len(set(tokens)) > 3
    assert greedy([ours], PROMPT, N) == tokens


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_stages_read_only_their_layers_and_give_the_same_tokens(converted, family):
    _, path, tokens = converted(family)
    ckpt = open_checkpoint(path)
    specs = partition_layers(ckpt.config.num_layers, 2)
    for spec in specs:  # GLM's prediction layer (blk.4) is read by neither
        layers = {int(n.split(".")[1]) for n in bytes_read(ckpt, spec) if n.startswith("blk.")}
        assert layers == set(range(spec.start, spec.end)), spec
    assert greedy([build_stage(ckpt, s) for s in specs], PROMPT, N) == tokens


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_kv_b_proj_is_joined_from_llama_cpps_split_halves(converted, family):
    hf_dir, path, _ = converted(family)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert {"blk.2.attn_k_b.weight", "blk.2.attn_v_b.weight"} <= names and not any("attn_kv_b" in n for n in names)
    hf, gg = open_checkpoint(hf_dir), open_checkpoint(path)
    assert gg.config.mla.q_lora_rank == (None if family == "deepseek_v2" else 24)
    for layer in range(4):
        name = f"layers.{layer}.self_attn.kv_b_proj.weight"
        assert torch.equal(gg.load(name), hf.load(name))


def test_glm_prediction_layer_is_converted_and_skipped_with_a_line(converted, capfd):
    """The converter keeps GLM's multi-token-prediction layer as blk.4 (nextn_predict_layers 1);
    the loader skips it and says so (the tokens and bytes: the tests above)."""
    _, path, _ = converted("glm4_moe")
    assert "blk.4.nextn.eh_proj.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    capfd.readouterr()
    ckpt = open_checkpoint(path)
    assert "skipping its multi-token-prediction layers (4 and on" in capfd.readouterr().err
    assert ckpt.config.num_layers == 4 and not any(n.startswith("layers.4.") for n in ckpt.names())


def rewritten(path, out, changes: dict, kv_b_whole=None):
    """The converted file at `path` rewritten at `out` by gguf's writer: metadata `changes` (None
    drops a key; the tokenizer's are dropped but for the EOS id), and with `kv_b_whole` (layer ->
    kv_b_proj) each layer's attn_kv_b in place of its attn_k_b / attn_v_b."""
    meta = read_gguf_metadata(path)
    wr = gguf.GGUFWriter(str(out), meta["general.architecture"])
    for key, value in {**meta, **changes}.items():
        if value is None or (key.startswith(("general.", "tokenizer.")) and key != "tokenizer.ggml.eos_token_id"):
            continue
        {bool: wr.add_bool, int: wr.add_uint32, float: wr.add_float32, str: wr.add_string}[type(value)](key, value)
    for t in gguf.GGUFReader(path).tensors:
        if kv_b_whole is None or not t.name.endswith(("attn_k_b.weight", "attn_v_b.weight")):
            wr.add_tensor(t.name, np.array(t.data))
    for layer, w in (kv_b_whole or {}).items():
        wr.add_tensor(f"blk.{layer}.attn_kv_b.weight", w.numpy())
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return out


def test_older_deepseek2_file_with_kv_b_whole_loads_the_same(converted, tmp_path):
    """Files written before llama.cpp split kv_b (attn_kv_b whole, no *_mla sizes: key_length and
    value_length are a head's, head_count_kv the query heads') give the same model."""
    hf_dir, path, tokens = converted("deepseek_v2")
    hf = open_checkpoint(hf_dir)
    older = rewritten(path, tmp_path / "older.gguf", {
        "deepseek2.attention.key_length": 24, "deepseek2.attention.value_length": 16,
        "deepseek2.attention.head_count_kv": 4, "deepseek2.attention.key_length_mla": None,
        "deepseek2.attention.value_length_mla": None},
        {layer: hf.load(f"layers.{layer}.self_attn.kv_b_proj.weight") for layer in range(4)})
    ckpt = open_checkpoint(older)
    assert ckpt.config == open_checkpoint(path).config
    assert greedy([whole(ckpt)], PROMPT, N) == tokens


def test_attention_temperature_is_refused_by_name(converted, tmp_path):
    """Mistral Large 3 is a deepseek2 file with attention temperature tuning, which SpecPipe does
    not implement: refused at open, not run without it."""
    _, path, _ = converted("deepseek_v2")
    out = rewritten(path, tmp_path / "t.gguf", {"deepseek2.attention.temperature_scale": 0.1})
    with pytest.raises(CheckpointError, match=r"attention.temperature_scale \(Mistral Large 3"):
        open_checkpoint(out)
