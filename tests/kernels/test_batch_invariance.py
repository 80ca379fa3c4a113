"""Batch invariance: a row's output never depends on the rows that share its call.

Kernel level: every kernel this process can use, on every type it supports, and the float
linear (float32 and bf16 weights): a row alone equals, bitwise, the same row among 1-63 others.
Model level: a stage's forward over mixed segments (a tree under a context with its mask, a
prompt chunk, a decode row), float32 / bf16-stored / Q8_0 / Q4_0 weights, the families whose
rows take other paths (mixture of experts, sliding window), native and torch attention: each row
computed in a call of its own (same context, same mask row) equals, bitwise, that row in the
batch, and so does the row plain decoding computes (its visible slots alone). Also the sparse
MLP alone: a row routed by itself equals that row among many.
"""

from __future__ import annotations


import gguf
import numpy as np
import pytest
from checkpoint_helpers import bf16_copy
import torch

from specpipe.config import StageSpec
from specpipe.kernels import native
from specpipe.kernels.ggml_types import BLOCKS
from specpipe.kernels.qlinear import FloatLinear, QuantLinear, select_outputs
from specpipe.kernels.registry import kernels
from specpipe.loader import open_checkpoint
from specpipe.model.attention import SegmentPlan
from specpipe.model.runner import run_segments
from specpipe.model.stage import build_stage

Q = gguf.GGMLQuantizationType
CPU_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
N, K, ROWS = 96, 512, 64


def random_packed(qtype: Q, n: int, k: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # gguf-py cannot encode these: random valid blocks
        bs, ts = BLOCKS[qtype]
        raw = rng.integers(0, 256, (n * k // bs, ts), dtype=np.uint8)
        for off in ((208,) if qtype == Q.Q6_K else (0, 2)):
            raw[:, off:off + 2] = rng.uniform(-0.05, 0.05, (len(raw), 1)).astype(np.float16).view(np.uint8)
        return torch.from_numpy(raw.reshape(n, -1))
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(w, qtype)))


def assert_invariant(f, x: torch.Tensor) -> None:
    full = f(x)  # (ROWS, N)
    for t in range(1, ROWS):
        assert torch.equal(f(x[:t]), full[:t]), f"{t} rows differ from the same rows among {ROWS}"
    for i in (0, 5, ROWS - 1):  # a row alone, from any position of the batch
        assert torch.equal(f(x[i:i + 1])[0], full[i]), f"row {i} alone differs"


CASES = [(k.name, q) for k in kernels() for q in CPU_TYPES if k.supports(q, "cpu")]


@pytest.mark.parametrize("kernel,qtype", CASES, ids=[f"{k}-{q.name}" for k, q in CASES])
def test_kernel_rows_do_not_depend_on_the_batch(kernel, qtype):
    k = next(k for k in kernels() if k.name == kernel)
    layer = QuantLinear(random_packed(qtype, N, K, int(qtype)), qtype, K, N, kernel=k)
    x = torch.randn(ROWS, K, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert_invariant(layer, x)


@pytest.mark.parametrize("kernel,qtype", [c for c in CASES if c[0] in ("native", "dequant")],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_selected_outputs_keep_their_bits(kernel, qtype):
    """A head over part of the vocabulary (select_outputs, --draft-vocab) gives those outputs'
    bits with the native kernel: an element depends on its own weight row alone. The dequantizing
    fallback multiplies in float32 (MKL/oneDNN sgemm), whose summation order can follow the number
    of outputs (last-bit differences on an AMD EPYC, none on an Intel Xeon), so there the outputs
    agree to rounding only; only a draft cuts its head, so the engine's output never depends on it."""
    k = next(k for k in kernels() if k.name == kernel)
    layer = QuantLinear(random_packed(qtype, N, K, int(qtype)), qtype, K, N, kernel=k,
                        bias=torch.randn(N, generator=torch.Generator().manual_seed(2)))
    ids = torch.tensor([0, 5, 6, 40, 95])
    part = select_outputs(layer, ids)
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got, want = part(x), layer(x)[:, ids]
    assert part.out_features == len(ids)
    if kernel == "native":
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", sorted({k for k, _ in CASES}))
def test_activations_keep_their_dtype(kernel):
    """bfloat16 activations (`--dtype bfloat16` on a GGUF file) come back as bfloat16: the float32
    result rounded once, as the KV cache and the next layer expect (float32 crashed the KV write)."""
    k = next(k for k in kernels() if k.name == kernel)
    layer = QuantLinear(random_packed(Q.Q4_K, N, K, 3), Q.Q4_K, K, N, kernel=k,
                        bias=torch.randn(N, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, layer(x.float()).to(torch.bfloat16))


def test_every_cpu_type_has_a_kernel():
    assert {q for _, q in CASES} == set(CPU_TYPES)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_float_linear_rows_do_not_depend_on_the_batch(weight_dtype):
    # torch's own F.linear is not: the float path pads to a fixed row tile (torch_kernels.py).
    g = torch.Generator().manual_seed(1)
    for n, k in ((N, K), (1536, 576), (64, 64)):
        layer = FloatLinear(k, n, bias=True)
        with torch.no_grad():
            layer.weight = torch.nn.Parameter(torch.randn(n, k, generator=g).to(weight_dtype))
            layer.bias = torch.nn.Parameter(torch.randn(n, generator=g).to(weight_dtype))
        with torch.inference_mode():
            assert_invariant(layer, torch.randn(ROWS, k, generator=g))


def test_moe_rows_do_not_depend_on_the_batch(tiny_model_dir):
    """A sparse MLP's row, routed and summed alone, equals the same row among 63 others, bitwise
    (each expert then runs on a different set of rows)."""
    from specpipe.model.moe import SparseMoE

    model = build_stage(open_checkpoint(tiny_model_dir("qwen3_moe")), StageSpec(0, 1, True, False))
    moe = model.layers["0"].mlp
    assert isinstance(moe, SparseMoE)
    x = torch.randn(ROWS, 64, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        chosen, _ = moe.route(x)
        assert len(torch.unique(chosen)) == 4  # every expert has rows: the grouping is exercised
        assert_invariant(moe, x)
        full = moe(x)
        for i in range(ROWS):  # every row alone, whichever experts it chose
            assert torch.equal(moe(x[i:i + 1])[0], full[i]), f"row {i} alone differs"


# --- model level ---------------------------------------------------------------------------------




def mixed_batch(rng: np.random.Generator):
    """Three segments: 5 tree rows under a 10-token context (slots 0-14, random tree mask), a
    6-row prompt chunk after a 4-token context (slots 20-29), one decode row (slots 40-47)."""
    parents = [-1, 0, 0, 1, 2]  # within the tree
    mask = np.zeros((5, 15), dtype=bool)
    mask[:, :10] = True
    for i, p in enumerate(parents):
        mask[i, 10 + i] = True
        while p >= 0:
            mask[i, 10 + p], p = True, parents[p]
    chunk = np.ones((6, 10), dtype=bool)
    chunk[:, 4:] = np.tri(6, dtype=bool)
    segments = [SegmentPlan(5, list(range(15)), mask), SegmentPlan(6, list(range(20, 30)), chunk),
                SegmentPlan(1, list(range(40, 48)), None)]
    positions = [10, 11, 11, 12, 12] + list(range(4, 10)) + [7]
    write = list(range(10, 15)) + list(range(24, 30)) + [47]
    contexts = [(list(range(10)), list(range(10))), (list(range(20, 24)), list(range(4))),
                (list(range(40, 47)), list(range(7)))]  # (slots, positions) written first
    tokens = torch.from_numpy(rng.integers(0, 200, 12))
    return segments, positions, write, contexts, tokens


# Families whose rows take other paths: experts chosen per row (qwen3_moe, and int8 experts on
# the quantized seam), a sliding window shorter than the contexts (gemma3_text, window 6),
# partial rotary with LongRoPE (phi3).
FAMILY_VARIANTS = {"qwen3_moe": ("qwen3_moe", {}), "gemma3": ("gemma3_text", {}), "phi3": ("phi3", {}),
                   # Q8_0 blocks need rows of a multiple of 32: the tiny expert's 48 is widened
                   "qwen3_moe-int8": ("qwen3_moe", dict(moe_intermediate_size=64))}
ATTENTION = ["native", "torch"] if native.available() else ["torch"]


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("variant", ["f32", "bf16-stored", "int8", "int4", "int4pack", *FAMILY_VARIANTS])
def test_stage_rows_do_not_depend_on_the_batch(tiny_llama_dir, tiny_model_dir, tmp_path, variant, attention,
                                               monkeypatch):
    if attention == "torch":
        monkeypatch.setattr(native, "available", lambda: False)
    path = bf16_copy(tiny_llama_dir, tmp_path / "bf16") if variant == "bf16-stored" else tiny_llama_dir
    if variant in FAMILY_VARIANTS:
        family, overrides = FAMILY_VARIANTS[variant]
        path = tiny_model_dir(family, **overrides)
    quant = {"int8": "int8", "int4": "int4", "int4pack": "int4", "qwen3_moe-int8": "int8"}.get(variant)
    model = build_stage(open_checkpoint(path), StageSpec(0, 4, True, True),
                        dtype=None if variant == "bf16-stored" else torch.float32, quantization=quant,
                        kernel="int4pack" if variant == "int4pack" else None)
    if variant == "bf16-stored":
        assert model.layers["0"].mlp.up_proj.weight.dtype == torch.bfloat16
    if quant:
        mlp = model.layers["0"].mlp
        assert any(isinstance(m, QuantLinear) for m in mlp.modules())
    rng = np.random.default_rng(0)
    kv = model.make_kv_cache(48)
    segments, positions, write, contexts, tokens = mixed_batch(rng)
    for slots, pos in contexts:
        ctx = torch.from_numpy(rng.integers(0, 200, len(slots)))
        run_segments(model, kv, ctx, pos, slots, [SegmentPlan(len(slots), slots, np.tri(len(slots), dtype=bool))])
    batch = run_segments(model, kv, tokens, positions, write, segments)  # (12, V)
    row = 0
    for seg in segments:
        for i in range(seg.num_rows):
            one = SegmentPlan(1, seg.read_slots, None if seg.mask is None else seg.mask[i:i + 1])
            alone = run_segments(model, kv, tokens[row:row + 1], [positions[row]], [write[row]], [one])
            assert torch.equal(alone[0], batch[row]), f"{variant}: row {row} alone differs from the batch"
            # As pp computes it: only the slots the row sees, none masked (a tree node's row must
            # equal the committed token's row at the same position).
            seen = [s for j, s in enumerate(seg.read_slots) if seg.mask is None or seg.mask[i, j]]
            plain = run_segments(model, kv, tokens[row:row + 1], [positions[row]], [write[row]],
                                 [SegmentPlan(1, seen, None)])
            assert torch.equal(plain[0], batch[row]), f"{variant}: row {row} differs from its unmasked twin"
            row += 1
