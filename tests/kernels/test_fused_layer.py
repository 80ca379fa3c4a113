"""A decoder layer as one native call (kernels/native/layer.c, model/fused.py): which layers
qualify, the same bits as the torch-written layer on the same native parts (prefill, tree steps,
gathered read slots, packed segments, every ISA), rows independent of each other, and errors
instead of writes out of bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from specpipe.config import StageSpec
from specpipe.kernels import native
from specpipe.loader import open_checkpoint
from specpipe.model.attention import SegmentPlan
from specpipe.model.runner import run_rows, run_segments
from specpipe.model.stage import build_stage

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")


def fused_count(model) -> int:
    return sum(layer.native is not None for layer in model.layers.values())


def pair(ckpt, monkeypatch, spec=None, **kw):
    """The same stage built with fused layers and with the torch-written ones."""
    spec = spec or StageSpec.whole(ckpt.config)
    fused = build_stage(ckpt, spec, **kw)
    monkeypatch.setenv("SPECPIPE_FUSED_LAYERS", "0")
    plain = build_stage(ckpt, spec, **kw)
    monkeypatch.delenv("SPECPIPE_FUSED_LAYERS")
    assert fused_count(fused) == len(fused.layers) and fused_count(plain) == 0
    return fused, plain


def steps(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """A causal prefill of 12 rows, then a tree step of 4 nodes whose KV goes to scattered slots
    (read back through a gather), then one decode row reading a non-contiguous slot list."""
    kv = model.make_kv_cache(48)
    out = [run_rows(model, kv, ids[:12], list(range(12)), list(range(12)), list(range(12)),
                    np.tril(np.ones((12, 12), dtype=bool)))]
    tree = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=bool)
    mask = np.concatenate([np.ones((4, 12), dtype=bool), tree], axis=1)
    nodes = [30, 21, 40, 33]
    out.append(run_rows(model, kv, ids[12:16], [12, 13, 13, 14], nodes, list(range(12)) + nodes, mask))
    out.append(run_rows(model, kv, ids[16:17], [15], [44], list(range(12)) + [30, 40, 33, 44], None))
    return out


@pytest.mark.parametrize("arch, quantization", [("llama", "int4"), ("qwen2", "int8"), ("mistral", "int4")])
def test_fused_layers_equal_the_torch_written_ones(tiny_model_dir, monkeypatch, arch, quantization):
    ckpt = open_checkpoint(tiny_model_dir(arch))
    fused, plain = pair(ckpt, monkeypatch, quantization=quantization)
    ids = torch.tensor(np.random.default_rng(0).integers(3, ckpt.config.vocab_size, 17))
    for a, b in zip(steps(fused, ids), steps(plain, ids)):
        assert torch.equal(a, b)


def test_middle_stage_and_packed_segments(tiny_model_dir, monkeypatch):
    """A stage without embedding or head; two sequences packed in one call, one of them
    reading a slot range and the other a gathered list under a mask."""
    ckpt = open_checkpoint(tiny_model_dir("qwen2"))
    fused, plain = pair(ckpt, monkeypatch, spec=StageSpec(1, 3, False, False), quantization="int4")
    x = torch.randn(7, ckpt.config.hidden_size, generator=torch.Generator().manual_seed(3))
    segs = [SegmentPlan(3, [0, 1, 2], np.tril(np.ones((3, 3), dtype=bool))),
            SegmentPlan(4, [9, 5, 7, 6], np.tril(np.ones((4, 4), dtype=bool)))]
    outs, written = [], [0, 1, 2, 9, 5, 7, 6]
    for model in (fused, plain):
        kv = model.make_kv_cache(16)
        outs.append(run_segments(model, kv, x, [0, 1, 2, 0, 1, 2, 3], written, segs))
        outs.append(torch.cat([kv.k[:, written], kv.v[:, written]]))  # other slots: never written
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


def test_a_row_alone_equals_the_row_among_others(tiny_model_dir):
    """Batch invariance of the fused path: the last row of a causal chain computed alone (its
    predecessors' KV already cached) has the bits it has when the chain is one call."""
    ckpt = open_checkpoint(tiny_model_dir("llama"))
    model = build_stage(ckpt, StageSpec.whole(ckpt.config), quantization="int4")
    assert fused_count(model) == len(model.layers)
    ids = torch.tensor(np.random.default_rng(1).integers(3, ckpt.config.vocab_size, 9))
    kv = model.make_kv_cache(16)
    together = run_rows(model, kv, ids, list(range(9)), list(range(9)), list(range(9)),
                        np.tril(np.ones((9, 9), dtype=bool)))
    kv2 = model.make_kv_cache(16)
    run_rows(model, kv2, ids[:8], list(range(8)), list(range(8)), list(range(8)), np.tril(np.ones((8, 8), dtype=bool)))
    alone = run_rows(model, kv2, ids[8:], [8], [8], list(range(9)), None)
    assert torch.equal(alone[0], together[8])


def test_every_isa_gives_the_same_bits(tiny_model_dir, monkeypatch):
    ckpt = open_checkpoint(tiny_model_dir("llama"))
    model = build_stage(ckpt, StageSpec.whole(ckpt.config), quantization="int8")
    ids = torch.tensor(np.random.default_rng(2).integers(3, ckpt.config.vocab_size, 17))
    results = {}
    try:
        for isa in native.supported_isas():
            monkeypatch.setenv("SPECPIPE_NATIVE_ISA", isa)
            native.reload_isa_code()
            results[isa] = steps(model, ids)
    finally:
        monkeypatch.delenv("SPECPIPE_NATIVE_ISA", raising=False)
        native.reload_isa_code()
    base = results.pop("portable")
    for isa, outs in results.items():
        assert all(torch.equal(a, b) for a, b in zip(outs, base)), isa


@pytest.mark.parametrize("arch, why", [("qwen3", "q/k norms"), ("gemma3_text", "sandwich norms, GeGLU, +1 norms"),
                                       ("mixtral", "experts")])
def test_other_layers_keep_the_torch_forward(tiny_model_dir, arch, why):
    ckpt = open_checkpoint(tiny_model_dir(arch))
    assert fused_count(build_stage(ckpt, StageSpec.whole(ckpt.config), quantization="int4")) == 0, why


def test_float_weights_are_not_fused(tiny_llama_dir):
    ckpt = open_checkpoint(tiny_llama_dir)
    assert fused_count(build_stage(ckpt, StageSpec.whole(ckpt.config))) == 0  # float32 F.linear layers
    assert fused_count(build_stage(ckpt, StageSpec.whole(ckpt.config), quantization="int4", stack=False)) == 0
    # bfloat16 activations: the C layer reads float32 only
    assert fused_count(build_stage(ckpt, StageSpec.whole(ckpt.config), quantization="int4", dtype=torch.bfloat16)) == 0


def test_a_slot_out_of_range_is_an_error_not_a_write(tiny_llama_dir):
    ckpt = open_checkpoint(tiny_llama_dir)
    model = build_stage(ckpt, StageSpec.whole(ckpt.config), quantization="int4")
    kv = model.make_kv_cache(8)
    kv.k.zero_()  # (uninitialised otherwise)
    with pytest.raises(RuntimeError, match="slot"):
        run_rows(model, kv, torch.tensor([5, 6]), [0, 1], [0, 8], [0, 1], None)
    with pytest.raises(RuntimeError, match="slot"):
        run_rows(model, kv, torch.tensor([5]), [0], [0], [0, 11], None)
    assert not kv.k.any()  # nothing written


def test_silu_mul_matches_torch():
    from specpipe.kernels.native.layer import silu_mul

    g = torch.randn(5, 77, generator=torch.Generator().manual_seed(0)) * 6
    g[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.5, -1e-30])
    u = torch.randn(5, 77, generator=torch.Generator().manual_seed(1))
    got, want = silu_mul(g, u), F.silu(g) * u
    torch.testing.assert_close(got, want, rtol=3e-6, atol=1e-30)
    # rows that are views of a stacked gate|up output, and a row alone: the same bits
    gu = torch.cat([g, u], dim=1)
    assert torch.equal(silu_mul(gu[:, :77], gu[:, 77:]), got)
    assert torch.equal(silu_mul(g[3:4], u[3:4]), got[3:4])
    # every ISA path this CPU runs gives the portable path's bits
    from specpipe.kernels import native

    for isa in native.supported_isas():
        assert torch.equal(silu_mul(g, u, isa=isa), got), isa
