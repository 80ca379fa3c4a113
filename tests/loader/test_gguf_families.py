"""Every family as a GGUF file with llama.cpp's names and conventions (checkpoint_helpers.gguf_twin)
loads to the same logits as its Hugging Face twin; a Mixtral written as `llama` is found by its
experts; expert weights kept quantized run on the quantized-linear seam."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from checkpoint_helpers import gguf_twin

from specpipe.config import StageSpec
from specpipe.kernels.qlinear import QuantLinear
from specpipe.loader import CheckpointError, open_checkpoint
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage

FAMILIES = ["qwen3", "qwen3_moe", "mixtral", "gemma3_text", "phi3"]
# llama.cpp has no metadata for Gemma 3's query_pre_attn_scalar: it takes the head dim (as every
# released Gemma 3 but the 27B, which it recognises by its 62 layers), so the twin uses that.
GGUF_OVERRIDES = {"gemma3_text": dict(query_pre_attn_scalar=32)}
TOKENS = [5, 17, 33, 90, 5, 17, 33, 90, 5, 17, 120, 7, 5, 17, 250, 3, 99, 42, 5, 17]  # past Gemma's window (6)


def prefill_logits(model) -> torch.Tensor:
    n = len(TOKENS)
    kv = model.make_kv_cache(n)
    return run_rows(model, kv, torch.tensor(TOKENS), list(range(n)), list(range(n)), list(range(n)),
                    np.tri(n, dtype=bool))  # (n, V)


def assert_close_configs(a, b, where: str = "config") -> None:
    if dataclasses.is_dataclass(a) and type(a) is type(b):
        for f in dataclasses.fields(a):
            assert_close_configs(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, float) or (isinstance(a, tuple) and a and isinstance(a[0], float)):
        assert a == pytest.approx(b, rel=1e-6), where
    else:
        assert a == b, where


def whole(ckpt, kernel=None):
    return build_stage(ckpt, StageSpec.whole(ckpt.config), kernel=kernel)


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_twin_matches_safetensors(tiny_model_dir, tmp_path, family):
    hf_dir = tiny_model_dir(family, **GGUF_OVERRIDES.get(family, {}))
    hf, gg = open_checkpoint(hf_dir), open_checkpoint(gguf_twin(hf_dir, tmp_path / f"{family}.gguf"))
    # The same architecture, except what llama.cpp folds into the weights (Gemma's norm + 1);
    # GGUF stores its numbers (norm epsilon, RoPE factors) as float32.
    assert_close_configs(gg.config, dataclasses.replace(hf.config, norm_plus_one=False))
    want = prefill_logits(whole(hf))
    got = prefill_logits(whole(gg))
    assert (got - want).abs().max() < 1e-5 * want.abs().max()


def test_mixtral_written_as_llama_is_detected(tiny_model_dir, tmp_path):
    ckpt = open_checkpoint(gguf_twin(tiny_model_dir("mixtral"), tmp_path / "mixtral.gguf"))
    assert ckpt.config.arch == "mixtral" and ckpt.config.moe.num_experts == 4
    assert "layers.0.mlp.experts.3.down_proj.weight" in ckpt.names()


def test_quantized_experts_use_the_quantized_seam(tiny_model_dir, tmp_path):
    """Q8_0 experts stay packed (QuantLinear, reference kernel) and compute what the same weights
    dequantized at load compute."""
    import gguf

    ckpt = open_checkpoint(gguf_twin(tiny_model_dir("mixtral"), tmp_path / "q8.gguf", gguf.GGMLQuantizationType.Q8_0))
    packed = whole(ckpt, kernel="dequant")
    assert isinstance(packed.layers["0"].mlp.experts[1].up_proj, QuantLinear)
    want = prefill_logits(whole(ckpt, kernel="float32"))
    assert (prefill_logits(packed) - want).abs().max() < 1e-5 * want.abs().max()


def test_unsupported_architecture_names_the_missing_piece(tiny_model_dir, tmp_path):
    import gguf

    path = tmp_path / "q2moe.gguf"
    wr = gguf.GGUFWriter(str(path), "qwen2moe")
    wr.add_block_count(1)
    wr.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(CheckpointError, match=r"'qwen2moe' \(it needs shared experts \(with their gate\)"):
        open_checkpoint(path)
