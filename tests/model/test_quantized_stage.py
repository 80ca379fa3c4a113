"""build_stage keeps weights as stored: GGUF blocks packed, bf16 as bf16, HF weights quantized
at load when asked; the packed path with the reference kernel equals the float32 path bitwise."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
from checkpoint_helpers import bf16_copy

from specpipe.config import StageSpec
from specpipe.kernels import native
from specpipe.kernels.ggml_types import dequantize
from specpipe.kernels.qlinear import FloatLinear, QuantEmbedding, QuantLinear
from specpipe.loader import open_checkpoint
from specpipe.model.runner import run_rows
from specpipe.model.stage import build_stage, weight_nbytes

Q = gguf.GGMLQuantizationType


def forward(model, data):
    n = data.shape[0]
    kv = model.make_kv_cache(n)
    return run_rows(model, kv, data, list(range(n)), list(range(n)), list(range(n)), None)


def test_smollm2_first_and_last_stage_equal_float32_path(smollm2):
    ids = torch.tensor([1, 9690, 198, 504, 3575, 282, 4649])
    first = build_stage(smollm2, StageSpec(0, 2, True, False), kernel="dequant")
    assert isinstance(first.embed_tokens, QuantEmbedding) and first.embed_tokens.qtype == Q.Q8_0
    assert all(isinstance(m, QuantLinear) and m.qtype == Q.Q4_1 for n, m in first.named_modules()
               if n.endswith("_proj"))
    assert not any(p.numel() > 576 for p in first.parameters())  # only norms stay float
    ref = build_stage(smollm2, StageSpec(0, 2, True, False), kernel="float32")
    # The portable kernel multiplies exactly the dequantized weights, a tile of rows at a time:
    # the float32 path's values, its sums grouped as MKL groups them for the tile's row count
    # (tests/kernels/test_portable_fallback.py), so equal to float32 rounding, not bitwise.
    exact = build_stage(smollm2, StageSpec(0, 2, True, False), kernel="dequant")
    hidden = forward(exact, ids)
    torch.testing.assert_close(hidden, forward(ref, ids), rtol=1e-5, atol=1e-5 * hidden.abs().max().item())
    last = build_stage(smollm2, StageSpec(28, 30, False, True), kernel="dequant")  # tied head from the embedding's blocks
    assert isinstance(last.lm_head, QuantLinear) and last.lm_head.qtype == Q.Q8_0
    ref_last = build_stage(smollm2, StageSpec(28, 30, False, True), kernel="float32")
    logits, ref_logits = forward(last, hidden), forward(ref_last, hidden)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5 * ref_logits.abs().max().item())
    assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1))
    # The native kernel (int8 activations, as llama.cpp), where built, stays close to it.
    if native.available():
        fast = forward(build_stage(smollm2, StageSpec(0, 2, True, False), kernel="native"), ids)
        assert (fast - hidden).abs().max() <= 0.05 * hidden.abs().max()


def test_smollm2_whole_holds_the_file_once(smollm2):
    model = build_stage(smollm2, StageSpec.whole(smollm2.config), kernel="dequant")
    assert model.lm_head.packed.data_ptr() == model.embed_tokens.packed.data_ptr()  # tied: shared
    size = os.path.getsize(smollm2.path)
    assert weight_nbytes(model) <= 1.15 * size, (weight_nbytes(model), size)




def test_bf16_checkpoint_stays_bf16_unless_float32_is_asked(tiny_llama_dir, tmp_path):
    ckpt = open_checkpoint(bf16_copy(tiny_llama_dir, tmp_path / "bf16"))
    kept = build_stage(ckpt, StageSpec.whole(ckpt.config), dtype=None)
    up = kept.layers["0"].mlp.up_proj
    assert isinstance(up, FloatLinear) and up.weight.dtype == torch.bfloat16
    assert kept.layers["0"].input_layernorm.weight.dtype == torch.float32  # norms and activations f32
    assert kept.make_kv_cache(4).k.dtype == torch.float32
    f32 = build_stage(ckpt, StageSpec.whole(ckpt.config), dtype=torch.float32)
    assert f32.layers["0"].mlp.up_proj.weight.dtype == torch.float32
    ids = torch.tensor([5, 17, 33, 90])
    assert torch.equal(forward(kept, ids), forward(f32, ids))  # the per-call upcast is exact


@pytest.mark.parametrize("quantization,qtype,bound", [("int8", Q.Q8_0, 1 / 127), ("int4", Q.Q4_0, 1 / 8)])
def test_hf_quantized_at_load(tiny_llama_dir, quantization, qtype, bound):
    ckpt = open_checkpoint(tiny_llama_dir)
    model = build_stage(ckpt, StageSpec.whole(ckpt.config), quantization=quantization, stack=False)
    projections = {n: m for n, m in model.named_modules() if n.endswith("_proj") or n == "lm_head"}
    assert projections and all(isinstance(m, QuantLinear) and m.qtype == qtype for m in projections.values())
    assert isinstance(model.embed_tokens, QuantEmbedding)
    for name, m in projections.items():  # each weight within its format's rounding of the original
        w = ckpt.load(f"{name}.weight")
        got = dequantize(m.packed, qtype)
        block_max = w.abs().reshape(w.shape[0], -1, 32).amax(-1, keepdim=True)  # (N, K/32, 1)
        err = (got - w).abs().reshape(w.shape[0], -1, 32)
        assert (err <= block_max * bound * 1.01 + 1e-6).all(), name
    ids = torch.tensor([5, 17, 33, 90, 5, 17])
    assert torch.isfinite(forward(model, ids)).all()


def test_default_kernel_keeps_gguf_packed(smollm2, monkeypatch):
    monkeypatch.delenv("SPECPIPE_KERNEL", raising=False)
    model = build_stage(smollm2, StageSpec(0, 1, True, False), stack=False)
    proj = model.layers["0"].mlp.up_proj
    # packed on a CPU either way: the native kernel where it is built, else the portable one
    assert isinstance(proj, QuantLinear) and proj.kernel == ("native" if native.available() else "dequant")
    monkeypatch.setenv("SPECPIPE_KERNEL", "float32")
    assert isinstance(build_stage(smollm2, StageSpec(0, 1, True, False)).layers["0"].mlp.up_proj, FloatLinear)
    monkeypatch.setenv("SPECPIPE_KERNEL", "fastest")
    with pytest.raises(ValueError, match="unknown kernel 'fastest'"):
        build_stage(smollm2, StageSpec(0, 1, True, False))


@pytest.mark.skipif(not native.available(), reason="projections are stacked on the native kernel, not built here")
def test_stacked_projections_change_no_bit(smollm2):
    """q/k/v and gate/up become one native call each; every logit keeps its bits."""
    spec = StageSpec(0, 3, True, False)
    apart = build_stage(smollm2, spec, kernel="native", stack=False)
    stacked = build_stage(smollm2, spec, kernel="native")
    layer = stacked.layers["0"]
    assert layer.self_attn.qkv.num_calls == 1 and layer.mlp.gate_up.num_calls == 1
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "up_proj")
    assert weight_nbytes(stacked) == weight_nbytes(apart)
    for ids in (torch.tensor([1, 9690, 198, 504, 3575, 282, 4649]), torch.tensor([9690])):
        assert torch.equal(forward(stacked, ids), forward(apart, ids))


@pytest.mark.skipif(not native.available(), reason="projections are stacked on the native kernel, not built here")
def test_stacking_groups_runs_of_one_type():
    """Parts of different types (Q4_K_M files store some v projections as Q6_K) stay separate;
    each output equals its own projection's, bitwise, with or without biases."""
    from specpipe.kernels.qlinear import StackedLinear

    rng = np.random.default_rng(0)
    def part(qtype, n, bias):
        w = rng.standard_normal((n, 64)).astype(np.float32)
        packed = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w, qtype)))
        b = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if bias else None
        return QuantLinear(packed, qtype, 64, n, b)

    for bias in (False, True):
        parts = [part(Q.Q4_0, 32, bias), part(Q.Q4_0, 16, bias), part(Q.Q8_0, 16, bias)]
        stacked = StackedLinear(parts)
        assert stacked.num_calls == 2 and stacked.sizes == [[32, 16], [16]]
        for t in (1, 5):
            x = torch.from_numpy(rng.standard_normal((t, 64)).astype(np.float32))
            for got, p in zip(stacked(x), parts):
                assert torch.equal(got, p(x))


def _packed_tensors(model):
    """(module name, packed tensor) of each quantized module, a tied tensor once."""
    seen, out = set(), []
    for name, m in model.named_modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)) and m.packed.data_ptr() not in seen:
            seen.add(m.packed.data_ptr())
            out.append((name, m.packed))
    return out


@pytest.mark.skipif(not native.available(), reason="the fused layers run on the native kernel, not built here")
def test_weights_packed_in_read_order_change_no_bit(smollm2, monkeypatch):
    """build_stage moves every packed weight into one run of memory, layer by layer in the order
    a step reads them (qkv, o, gate_up, down), the embedding last; no output changes."""
    import specpipe.model.stage as stage

    spec = StageSpec(0, 3, True, False)
    monkeypatch.setattr(stage, "pack_weights", lambda model: 0)
    loose = build_stage(smollm2, spec, kernel="native")
    monkeypatch.undo()
    packed = build_stage(smollm2, spec, kernel="native")
    tensors = sorted(_packed_tensors(packed), key=lambda e: e[1].data_ptr())
    names = [n for n, _ in tensors]
    want = [f"layers.{i}.{p}" for i in range(3) for p in ("self_attn.qkv.groups.0", "self_attn.o_proj",
                                                         "mlp.gate_up.groups.0", "mlp.down_proj")]
    assert names == want + ["embed_tokens"]
    for (_, a), (_, b) in zip(tensors, tensors[1:]):  # each right after the one before, on its own lines
        assert b.data_ptr() == a.data_ptr() + -(-a.numel() // 64) * 64
    assert weight_nbytes(packed) == weight_nbytes(loose)
    for ids in (torch.tensor([1, 9690, 198, 504, 3575, 282, 4649]), torch.tensor([9690])):
        assert torch.equal(forward(packed, ids), forward(loose, ids))


def test_packing_frees_the_old_buffers(smollm2, monkeypatch):
    """pack_weights leaves nothing holding the buffers the weights were read into (a view of one
    kept alive by a tensor that was only repointed would hold the whole file twice)."""
    import weakref

    import specpipe.model.stage as stage

    monkeypatch.setattr(stage, "pack_weights", lambda model: 0)
    model = build_stage(smollm2, StageSpec(0, 2, True, False), stack=False)  # no fused layer: no raw pointers
    monkeypatch.undo()
    ids = torch.tensor([1, 9690, 198, 504])
    before = forward(model, ids)
    tensors = _packed_tensors(model)
    size, old = sum(t.numel() for _, t in tensors), [weakref.ref(t) for _, t in tensors]
    del tensors
    assert stage.pack_weights(model) >= size
    assert all(r() is None for r in old)
    assert torch.equal(forward(model, ids), before)
