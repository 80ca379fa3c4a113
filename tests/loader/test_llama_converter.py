"""llama.cpp's own converter (tests/llama_converter.py) on the tiny Llama: the file it writes
(Q/K rows permuted, its names and metadata) loads to the Hugging Face directory's config and logits."""

from __future__ import annotations

from llama_converter import convert
from test_gguf_families import assert_close_configs, prefill_logits, whole

from specpipe.loader import open_checkpoint
from specpipe.loader.gguf_metadata import read_gguf_metadata


def test_llama_converted_by_llama_cpp_loads_to_the_same_logits(tiny_model_dir, tmp_path):
    hf_dir = tiny_model_dir("llama")
    path = convert(hf_dir, tmp_path / "llama.gguf")
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"] == "llama" and meta["tokenizer.ggml.model"] == "gpt2"
    hf, gg = open_checkpoint(hf_dir), open_checkpoint(path)
    assert_close_configs(gg.config, hf.config)
    want = prefill_logits(whole(hf))
    assert (prefill_logits(whole(gg)) - want).abs().max() < 1e-5 * want.abs().max()
