"""Damaged and hostile checkpoints give one clear CheckpointError: never another exception, a hang,
or an allocation a header asked for (checkpoint_fuzz.py beside this file has the mutations; the long
run is benchmarks/fuzz_checkpoints.py)."""

from __future__ import annotations

import json
import random
import struct

import pytest

from checkpoint_fuzz import LAYERS, gguf_fields, hf_config, mutations, try_load, write_tiny_gguf, write_tiny_hf

from specpipe.loader import CheckpointError, open_checkpoint


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def test_the_seed_files_load(work):
    assert try_load(write_tiny_gguf(work / "ok.gguf")) == ("loaded", "")
    assert try_load(write_tiny_hf(work / "ok_hf")) == ("loaded", "")


def test_a_sample_of_mutations_loads_or_is_refused(work):
    # A fixed sample of every kind (hostile header fields, cuts, bit flips, hostile safetensors
    # headers, config.json and index values); the whole set runs in the benchmark script.
    every = mutations(work / "seeds", n_random=8, seed=1)
    sample = random.Random(0).sample(every, 120)
    bad = []
    for i, m in enumerate(sample):
        d = work / f"m{i}"
        d.mkdir()
        outcome, detail = try_load(m.apply(d))
        if outcome not in ("loaded", "refused"):
            bad.append((m.name, outcome, detail))
    assert not bad


def _gguf_with_block_count(work, value):
    data = write_tiny_gguf(work / "bc.gguf").read_bytes()
    key = b"llama.block_count"
    # the key's bytes, then its u32 value type (4 = uint32), then the value
    at = data.index(key) + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 4
    out = bytearray(data)
    out[at + 4:at + 8] = struct.pack("<I", value)
    path = work / f"bc{value}.gguf"
    path.write_bytes(bytes(out))
    return path


@pytest.mark.parametrize("layers", [2**31, 3, 1])
def test_gguf_layer_count_the_tensors_do_not_bear_out(work, layers):
    # Before: 2**31 layers hung building the stage's modules (or failed a 2**31 set), 3 failed later.
    with pytest.raises(CheckpointError, match=f"the config says {layers} layers, the file holds tensors for "
                                              f"layers 0..{LAYERS - 1}"):
        open_checkpoint(_gguf_with_block_count(work, layers))


@pytest.mark.parametrize("key, value, message", [
    ("num_hidden_layers", 2**40, "the config says 1099511627776 layers"),
    ("hidden_size", 2**40, r"'embed_tokens.weight' has shape \(64, 32\), the config's vocab_size x hidden_size"),
    ("head_dim", 2**40, r"'layers.0.self_attn.q_proj.weight' has shape"),
    ("intermediate_size", 2**62, r"'layers.0.mlp.gate_proj.weight' has shape"),
    ("hidden_size", "x", "wrong type or range"),
    ("num_attention_heads", 0, "wrong type or range"),
    ("vocab_size", None, "wrong type or range"),
])
def test_hf_config_values_the_tensors_do_not_bear_out(work, key, value, message):
    d = write_tiny_hf(work / f"hf_{key}_{value}")
    (d / "config.json").write_text(json.dumps({**hf_config(), key: value}))
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(d)


@pytest.mark.parametrize("file, text, message", [
    ("config.json", "[]", "expected a JSON object, got list"),
    ("config.json", "{", "invalid JSON"),
    ("model.safetensors.index.json", "{", "invalid JSON"),
    ("model.safetensors.index.json", '{"weight_map": 1}', "shard file names in the model directory"),
    ("model.safetensors.index.json", '{"weight_map": {"a": "/etc/passwd"}}', "shard file names"),
    ("model.safetensors.index.json", '{"weight_map": {"a": "../x.safetensors"}}', "shard file names"),
    # The tokenizer's files (a TokenizerError). Before: AttributeError / TypeError from deep inside
    # the tokenizer's loading or the template's compiling.
    ("tokenizer_config.json", "[]", "expected a JSON object, got list"),
    ("generation_config.json", "null", "expected a JSON object, got NoneType"),
    ("tokenizer_config.json", '{"bos_token": 5}', "bos_token must be a string"),
    ("tokenizer_config.json", '{"eos_token": {"content": ["x"]}}', "eos_token must be a string"),
    ("tokenizer_config.json", '{"chat_template": 5}', "the chat template must be a string"),
    ("tokenizer_config.json", '{"chat_template": [{"name": "default", "template": 7}]}',
     "the chat template must be a string"),
])
def test_hf_json_files_of_the_wrong_shape(work, file, text, message):
    from specpipe.tokenizer.tokenizer import Tokenizer, TokenizerError

    d = write_tiny_hf(work / f"json_{abs(hash((file, text)))}")
    (d / file).write_text(text)
    tokenizer = file.startswith(("tokenizer", "generation_config"))
    with pytest.raises(TokenizerError if tokenizer else CheckpointError, match=message):
        Tokenizer.from_path(d) if tokenizer else open_checkpoint(d)


def test_the_field_map_covers_the_header(work):
    data = write_tiny_gguf(work / "map.gguf").read_bytes()
    roles = {f.role for f in gguf_fields(data)}
    assert roles >= {"tensor_count", "kv_count", "strlen", "vtype", "etype", "arrlen", "value", "n_dims", "dim",
                     "ttype", "toffset"}


def test_eos_ids_outside_the_vocabulary_are_ignored(work):
    from specpipe.tokenizer.tokenizer import Tokenizer

    d = write_tiny_hf(work / "eos_ids")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2**70, -1, True, 2]}))
    assert Tokenizer.from_path(d).eos_token_ids == (2,)


def test_a_packed_type_without_a_kernel_is_refused_by_name(work):
    # Before: a tensor typed Q8_1 (9) reached the kernels' block table and raised KeyError.
    data = bytearray(write_tiny_gguf(work / "q81.gguf").read_bytes())
    f = next(f for f in gguf_fields(bytes(data)) if f.role == "ttype" and
             struct.unpack_from("<I", data, f.offset)[0] == 8)  # the first Q8_0 matrix
    struct.pack_into("<I", data, f.offset, 9)
    (work / "q81.gguf").write_bytes(bytes(data))
    assert try_load(work / "q81.gguf")[0] == "refused"
    with pytest.raises(CheckpointError, match="weight type SpecPipe cannot compute: Q8_1"):
        open_checkpoint(work / "q81.gguf")  # refused at open now, before anything is read


def _group_of(work, heads: int):
    """A tiny GGUF with `heads` query heads over one KV head (head size 32)."""
    return write_tiny_gguf(work / f"group{heads}.gguf", heads=heads, kv_heads=1, head_dim=32)


def test_more_query_heads_per_kv_head_than_the_native_attention_takes_are_refused_at_load(work):
    # Before: the file loaded, then every forward failed in sp_decoder_layer with "bad shape (... a slot
    # out of range or rows not covered by the segments?)".
    from specpipe.config import StageSpec
    from specpipe.kernels import native
    from specpipe.model.stage import build_stage

    if not native.available():
        pytest.skip("the native attention is not built: the torch attention has no group limit")
    ckpt = open_checkpoint(_group_of(work, native.MAX_GROUP + 1))
    with pytest.raises(CheckpointError, match=f"group{native.MAX_GROUP + 1}.gguf: {native.MAX_GROUP + 1} query heads "
                                              f"over 1 KV heads .* takes at most {native.MAX_GROUP} per KV head"):
        build_stage(ckpt, StageSpec.whole(ckpt.config))
    assert try_load(_group_of(work, native.MAX_GROUP + 1))[0] == "refused"
    assert try_load(_group_of(work, native.MAX_GROUP)) == ("loaded", "")  # the limit itself runs


def test_a_group_past_the_native_limit_runs_where_the_native_attention_does_not(work, monkeypatch):
    # The limit is the native attention's: a stage that runs the torch attention (no native library,
    # or a GPU) loads such a model and runs its forward.
    from specpipe.kernels import native

    monkeypatch.setattr(native, "available", lambda: False)
    assert try_load(_group_of(work, 65)) == ("loaded", "")


def test_the_fuzzer_runs_a_forward_on_what_it_loads(work, monkeypatch):
    # Before: try_load only built the stage, so a model that builds and then fails every forward (the
    # group above, without its load check) counted as "loaded".
    from specpipe.kernels import native
    from specpipe.model import stage

    if not native.available():
        pytest.skip("the native attention is not built")
    monkeypatch.setattr(stage, "check_attention_group", lambda ckpt, max_group: None)
    outcome, detail = try_load(_group_of(work, native.MAX_GROUP + 1))
    assert outcome == "crash", detail
